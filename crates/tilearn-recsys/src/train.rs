//! The CTR training loop shared by `tilearn ctr train` and the tests: prefetched shuffled
//! batches, one fused step per batch, periodic held-out evaluation with exact AUC, throughput.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::cache::RowCacheLog;
use crate::checkpoint::{TrainerState, save_checkpoint};
use crate::data::{CtrBatch, Prefetcher};
use crate::error::{RecsysError, Result};
use crate::jagged::JaggedBatch;
use crate::metrics::auc;
use crate::model::{CtrConfig, bce_with_logits};
use crate::stepper::CtrStepper;

/// Where and how often to write checkpoints ([`crate::checkpoint`]).
#[derive(Debug, Clone, PartialEq)]
pub struct SavePolicy {
    pub output_dir: PathBuf,
    /// A checkpoint every this many steps (>= 1).
    pub every: usize,
    /// Keep only the newest this many checkpoints.
    pub keep: Option<usize>,
}

/// How long and how to train.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainOptions {
    /// The step to stop after (counted from the start of the run, resumed or not).
    pub steps: usize,
    pub batch_size: usize,
    /// AdamW's learning rate for the dense part.
    pub dense_lr: f32,
    /// Evaluate on the held-out split every this many steps (and after the last).
    pub eval_every: usize,
    pub seed: u64,
    pub save: Option<SavePolicy>,
    /// Continue from this state (read by [`crate::checkpoint::load_checkpoint`] into the model).
    pub resume: Option<TrainerState>,
}

impl TrainOptions {
    /// The state of a run of these options after `step` steps and `samples_seen` samples.
    fn state(&self, step: usize, samples_seen: u64, train_samples: usize) -> TrainerState {
        TrainerState {
            step,
            samples_seen,
            next_batch: step,
            seed: self.seed,
            batch_size: self.batch_size,
            train_samples,
        }
    }

    /// Fails, naming the field, unless `resume` continues a run of these options on
    /// `train_samples` samples (another seed, batch size or data would not be the same run).
    fn check_resume(&self, resume: &TrainerState, train_samples: usize) -> Result<()> {
        let expected = self.state(resume.step, resume.samples_seen, train_samples);
        let fields = [
            ("seed", "--seed", resume.seed, expected.seed),
            (
                "batch_size",
                "--batch-size",
                resume.batch_size as u64,
                expected.batch_size as u64,
            ),
            (
                "train_samples",
                "the same --data / --synthetic-samples",
                resume.train_samples as u64,
                expected.train_samples as u64,
            ),
            (
                "next_batch",
                "a trainer_state.json written by tilearn",
                resume.next_batch as u64,
                expected.next_batch as u64,
            ),
        ];
        for (field, fix, saved, run) in fields {
            if saved != run {
                return Err(RecsysError::invalid(
                    "checkpoint",
                    format!(
                        "trainer_state.json has `{field}` = {saved}, this run has {run}; resume with {fix}"
                    ),
                ));
            }
        }
        if resume.step > self.steps {
            return Err(RecsysError::invalid(
                "checkpoint",
                format!(
                    "it is at step {}, past --steps {}; pass --steps above the checkpoint's step",
                    resume.step, self.steps
                ),
            ));
        }
        Ok(())
    }
}

/// One line of `train_log.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LogRecord {
    pub step: usize,
    /// Mean training loss over the steps since the previous record.
    pub loss: f64,
    pub eval_loss: Option<f64>,
    pub eval_auc: Option<f64>,
    /// Training samples per second since the previous record (evaluation time excluded).
    pub samples_per_sec: f64,
    /// The row cache since the previous record (tables larger than the device's budget).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub row_cache: Option<RowCacheLog>,
}

/// Samples per prediction call of [`evaluate`] (a row cache needs this many slots at least).
pub const EVAL_CHUNK: usize = 4096;

/// Mean BCE loss and exact AUC of `model` on `data` (AUC `None` when one class is absent).
pub fn evaluate(model: &mut impl CtrStepper, data: &CtrBatch) -> Result<(f64, Option<f64>)> {
    let mut logits = Vec::with_capacity(data.len());
    for start in (0..data.len()).step_by(EVAL_CHUNK) {
        let end = (start + EVAL_CHUNK).min(data.len());
        logits.extend(model.predict(&data.slice(start..end))?);
    }
    Ok((
        bce_with_logits(&logits, &data.labels),
        auc(&logits, &data.labels),
    ))
}

/// The loader's batches with their jagged ids, built on a thread of their own (hashing every
/// categorical value is the costliest host work of a step; here it overlaps the step).
fn with_jagged(
    batches: Prefetcher,
    config: CtrConfig,
) -> impl Iterator<Item = Result<(CtrBatch, JaggedBatch)>> {
    let (sender, receiver) = std::sync::mpsc::sync_channel(Prefetcher::DEPTH);
    std::thread::spawn(move || {
        for batch in batches {
            let item = config.jagged(&batch).map(|jagged| (batch, jagged));
            if sender.send(item).is_err() {
                return;
            }
        }
    });
    receiver.into_iter()
}

/// Trains `model` on `train` for `options.steps` steps, calling `on_log` with each record
/// (every `eval_every` steps and after the last) and `on_step` after every step.
pub fn train(
    model: &mut impl CtrStepper,
    train: Arc<CtrBatch>,
    eval: &CtrBatch,
    options: &TrainOptions,
    mut on_step: impl FnMut(usize, f64),
    mut on_log: impl FnMut(&LogRecord) -> Result<()>,
) -> Result<Vec<LogRecord>> {
    let mut records = Vec::new();
    let (mut loss_sum, mut steps_in_window, mut samples_in_window) = (0.0, 0usize, 0usize);
    let mut window_time = 0.0f64;
    let mut cache_before = model.row_cache()?;
    let train_samples = train.len();
    let (first, mut samples_seen) = match &options.resume {
        Some(resume) => {
            options.check_resume(resume, train_samples)?;
            (resume.step, resume.samples_seen)
        }
        None => (0, 0),
    };
    let batches = Prefetcher::starting_at(
        train,
        options.batch_size,
        options.steps,
        options.seed,
        first,
    );
    for (i, item) in (first..).zip(with_jagged(batches, model.config().clone())) {
        let (batch, jagged) = item?;
        let started = Instant::now();
        let stats = model.step(&batch, &jagged, options.dense_lr)?;
        window_time += started.elapsed().as_secs_f64();
        loss_sum += stats.loss;
        steps_in_window += 1;
        samples_in_window += batch.len();
        samples_seen += batch.len() as u64;
        let step = i + 1;
        on_step(step, stats.loss);
        if let Some(save) = options.save.as_ref().filter(|s| step % s.every.max(1) == 0) {
            let state = options.state(step, samples_seen, train_samples);
            let writes = model.writes_checkpoints();
            let host = model.host()?;
            if writes {
                save_checkpoint(&save.output_dir, host, &state, save.keep)?;
            }
        }
        if step % options.eval_every.max(1) == 0 || step == options.steps {
            // The training window's cache traffic (evaluation's loads come after).
            let cache_now = model.row_cache()?;
            let row_cache = cache_now
                .zip(cache_before)
                .map(|(now, before)| now.since(&before).log());
            let (eval_loss, eval_auc) = if eval.is_empty() {
                (None, None)
            } else {
                let (l, a) = evaluate(model, eval)?;
                (Some(l), a)
            };
            let record = LogRecord {
                step,
                loss: loss_sum / steps_in_window as f64,
                eval_loss,
                eval_auc,
                samples_per_sec: samples_in_window as f64 / window_time.max(1e-9),
                row_cache,
            };
            cache_before = model.row_cache()?;
            on_log(&record)?;
            records.push(record);
            (loss_sum, steps_in_window, samples_in_window, window_time) = (0.0, 0, 0, 0.0);
        }
    }
    Ok(records)
}
