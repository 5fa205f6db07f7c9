//! The CTR training loop shared by `tilearn ctr train` and the tests: prefetched shuffled
//! batches, one fused step per batch, periodic held-out evaluation with exact AUC, throughput.

use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::data::{CtrBatch, Prefetcher};
use crate::error::Result;
use crate::metrics::auc;
use crate::model::{CtrModel, bce_with_logits};

/// How long and how to train.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainOptions {
    pub steps: usize,
    pub batch_size: usize,
    /// AdamW's learning rate for the dense part.
    pub dense_lr: f32,
    /// Evaluate on the held-out split every this many steps (and after the last).
    pub eval_every: usize,
    pub seed: u64,
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
}

/// Mean BCE loss and exact AUC of `model` on `data` (AUC `None` when one class is absent).
pub fn evaluate(model: &CtrModel, data: &CtrBatch) -> Result<(f64, Option<f64>)> {
    let mut logits = Vec::with_capacity(data.len());
    for start in (0..data.len()).step_by(4096) {
        logits.extend(model.predict(&data.slice(start..(start + 4096).min(data.len())))?);
    }
    Ok((
        bce_with_logits(&logits, &data.labels),
        auc(&logits, &data.labels),
    ))
}

/// Trains `model` on `train` for `options.steps` steps, calling `on_log` with each record
/// (every `eval_every` steps and after the last) and `on_step` after every step.
pub fn train(
    model: &mut CtrModel,
    train: Arc<CtrBatch>,
    eval: &CtrBatch,
    options: &TrainOptions,
    mut on_step: impl FnMut(usize, f64),
    mut on_log: impl FnMut(&LogRecord) -> Result<()>,
) -> Result<Vec<LogRecord>> {
    let mut records = Vec::new();
    let (mut loss_sum, mut steps_in_window, mut samples_in_window) = (0.0, 0usize, 0usize);
    let mut window_time = 0.0f64;
    let batches = Prefetcher::new(train, options.batch_size, options.steps, options.seed);
    for (i, batch) in batches.enumerate() {
        let started = Instant::now();
        let stats = model.train_step(&batch, options.dense_lr)?;
        window_time += started.elapsed().as_secs_f64();
        loss_sum += stats.loss;
        steps_in_window += 1;
        samples_in_window += batch.len();
        let step = i + 1;
        on_step(step, stats.loss);
        if step % options.eval_every.max(1) == 0 || step == options.steps {
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
            };
            on_log(&record)?;
            records.push(record);
            (loss_sum, steps_in_window, samples_in_window, window_time) = (0.0, 0, 0, 0.0);
        }
    }
    Ok(records)
}
