//! The Trainer: the optimisation loop around a model, a token dataset and AdamW.
//!
//! One optimizer step = `gradient_accumulation_steps` micro-batches whose gradients add into
//! one buffer. The loss of the step is the sum of token losses over all micro-batches divided by
//! the number of non-ignored targets in all of them (Hugging Face's `num_items_in_batch`), so
//! accumulation gives the same gradient as one large batch.

pub mod args;
pub mod checkpoint;
pub mod log;
pub mod state;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use tilearn_ops::DType;
use tilearn_optim::{AdamW, AdamWConfig, LrSchedule, ParamGroup, SchedulerType};

pub use args::{TrainLength, TrainingArguments};
pub use log::{LogRecord, TrainLog};
pub use state::{SchedulerState, TrainerState};

use crate::data::{DataLoader, LoaderOptions, LoaderState, TokenDataset, WorkerHook};
use crate::model::{Activations, LlamaForCausalLM, count_valid_targets};
use crate::{EngineError, Result};

/// What a finished run reports.
#[derive(Clone, Debug)]
pub struct TrainSummary {
    pub steps: u64,
    pub first_loss: f64,
    pub final_loss: f64,
    pub mean_step_seconds: f64,
    pub tokens_per_sec: f64,
    pub output_dir: PathBuf,
}

/// Trains `model` on `dataset` as `args` say.
pub struct Trainer {
    pub args: TrainingArguments,
    pub model: LlamaForCausalLM,
    dataset: Arc<TokenDataset>,
    /// Run on the data loader's worker thread before its first batch (see
    /// [`Trainer::set_loader_hook`]).
    loader_hook: Option<Arc<dyn Fn() + Send + Sync>>,
}

/// Observes progress (the CLI's progress bar); called after every optimizer step.
pub trait ProgressSink {
    fn start(&mut self, total_steps: u64, first_step: u64);
    fn step(&mut self, step: u64, loss: f64, lr: f64);
    fn log(&mut self, record: &LogRecord);
    fn finish(&mut self);
}

/// A sink that prints each logged record as one line to stdout (non-terminal output).
pub struct PrintLogs;

impl ProgressSink for PrintLogs {
    fn start(&mut self, total_steps: u64, first_step: u64) {
        println!("training: steps {first_step}..{total_steps}");
    }
    fn step(&mut self, _: u64, _: f64, _: f64) {}
    fn log(&mut self, r: &LogRecord) {
        println!(
            "step {:>6}  loss {:.4}  lr {:.3e}  grad_norm {:.3}  tokens/s {:.0}",
            r.step, r.loss, r.lr, r.grad_norm, r.tokens_per_sec
        );
    }
    fn finish(&mut self) {}
}

impl Trainer {
    pub fn new(
        args: TrainingArguments,
        model: LlamaForCausalLM,
        dataset: TokenDataset,
    ) -> Result<Trainer> {
        args.validate()?;
        let max_pos = model.config.max_position_embeddings;
        if args.seq_len > max_pos {
            return Err(EngineError::InvalidArgument {
                argument: "--seq-len".into(),
                message: format!(
                    "{} is above the model's max_position_embeddings ({max_pos}); use --seq-len {max_pos} or less",
                    args.seq_len
                ),
            });
        }
        if dataset.vocab_size() > model.config.vocab_size {
            return Err(EngineError::InvalidArgument {
                argument: "--data".into(),
                message: format!(
                    "the dataset's tokenizer has {} tokens but the model's vocab_size is {}; prepare the data with the model's tokenizer",
                    dataset.vocab_size(),
                    model.config.vocab_size
                ),
            });
        }
        Ok(Trainer {
            args,
            model,
            dataset: Arc::new(dataset),
            loader_hook: None,
        })
    }

    /// Code the data loader's worker thread runs once before producing batches, e.g. pinning it
    /// to CPUs near the GPU (`tilearn_affinity::RankPlan::loader_hook`). A `Fn` behind an `Arc`
    /// because every loader the trainer starts (one per `train` call) runs it.
    pub fn set_loader_hook(&mut self, hook: Arc<dyn Fn() + Send + Sync>) {
        self.loader_hook = Some(hook);
    }

    fn optimizer(&self) -> Result<AdamW> {
        let a = &self.args;
        let config = AdamWConfig {
            lr: a.learning_rate,
            beta1: a.adam_beta1,
            beta2: a.adam_beta2,
            eps: a.adam_epsilon,
            weight_decay: a.weight_decay,
            amsgrad: false,
        };
        let params = &self.model.params;
        let groups = vec![
            ParamGroup {
                name: "decay".into(),
                ranges: params.decay_ranges(),
                weight_decay: a.weight_decay,
                lr_scale: 1.0,
            },
            ParamGroup {
                name: "no_decay".into(),
                ranges: params.no_decay_ranges(),
                weight_decay: 0.0,
                lr_scale: 1.0,
            },
        ];
        Ok(AdamW::new(config, groups, params.numel())?)
    }

    fn schedule(&self, total_steps: u64) -> Result<LrSchedule> {
        let kind: SchedulerType =
            self.args
                .lr_scheduler_type
                .parse()
                .map_err(|_| EngineError::InvalidArgument {
                    argument: "--lr-scheduler-type".into(),
                    message: format!(
                        "`{}` is not a known schedule; use linear, cosine, constant, constant_with_warmup, cosine_with_restarts, polynomial, inverse_sqrt or warmup_stable_decay",
                        self.args.lr_scheduler_type
                    ),
                })?;
        Ok(LrSchedule {
            kind,
            base_lr: self.args.learning_rate,
            warmup_steps: self.args.warmup_steps,
            total_steps,
        })
    }

    /// Runs the loop; with `resume` it continues from that checkpoint directory exactly.
    pub fn train(
        &mut self,
        resume: Option<&Path>,
        sink: &mut dyn ProgressSink,
    ) -> Result<TrainSummary> {
        let a = self.args.clone();
        std::fs::create_dir_all(&a.output_dir)
            .map_err(|e| EngineError::io(&a.output_dir, "create the output directory", e))?;
        probe_writable(&a.output_dir)?;

        let (batch, seq, accum) = (
            a.per_device_train_batch_size,
            a.seq_len,
            a.gradient_accumulation_steps,
        );
        let probe_loader = DataLoader::new(
            self.dataset.clone(),
            batch,
            seq,
            a.seed,
            LoaderState::default(),
        )?;
        let batches_per_epoch = probe_loader.batches_per_epoch();
        drop(probe_loader);
        let steps_per_epoch = batches_per_epoch / accum as u64;
        if steps_per_epoch == 0 {
            return Err(EngineError::InvalidArgument {
                argument: "--gradient-accumulation-steps".into(),
                message: format!(
                    "one epoch has {batches_per_epoch} batches, fewer than {accum} accumulation steps; lower it or use more data"
                ),
            });
        }
        let total_steps = match a.length {
            TrainLength::MaxSteps(n) => n,
            TrainLength::Epochs(e) => ((e * steps_per_epoch as f64).ceil() as u64).max(1),
        };

        let mut optimizer = self.optimizer()?;
        let schedule = self.schedule(total_steps)?;
        let mut state = TrainerState {
            global_step: 0,
            max_steps: total_steps,
            loader: LoaderState::default(),
            seed: a.seed,
            tokens_seen: 0,
        };
        if let Some(dir) = resume {
            state = self.restore(dir, &mut optimizer)?;
            state.max_steps = total_steps;
        }
        if resume.is_some() {
            trim_log(&a.output_dir.join(log::LOG_FILE), state.global_step)?;
        }
        let mut log = TrainLog::open(&a.output_dir, resume.is_none())?;

        let hook = self
            .loader_hook
            .clone()
            .map(|hook| -> WorkerHook { Box::new(move || hook()) });
        let options = LoaderOptions::new(batch, seq, a.seed).starting_at(state.loader);
        let mut loader = DataLoader::with_options(self.dataset.clone(), options, hook)?;
        let mut acts = Activations::new(&self.model.config, batch, seq, a.gradient_checkpointing);
        let mut grads = vec![0.0f32; self.model.params.numel()];
        let tokens_per_step = (batch * seq * accum) as u64;

        let mut window = LogWindow::default();
        let (mut first_loss, mut final_loss) = (f64::NAN, f64::NAN);
        let run_start = Instant::now();
        let first_step = state.global_step;
        sink.start(total_steps, first_step);

        while state.global_step < total_steps {
            let step_start = Instant::now();
            let micro: Vec<_> = (0..accum)
                .map(|_| loader.next_batch())
                .collect::<Result<_>>()?;
            let denominator: usize = micro
                .iter()
                .map(|b| count_valid_targets(&b.labels, batch, seq))
                .sum();
            grads.iter_mut().for_each(|g| *g = 0.0);
            let mut loss_sum = 0.0;
            for b in &micro {
                let stats = self.model.forward_backward(
                    &b.input_ids,
                    &b.labels,
                    batch,
                    seq,
                    Some(denominator.max(1) as f64),
                    &mut acts,
                    &mut grads,
                )?;
                loss_sum += stats.loss_sum;
            }
            let loss = loss_sum / denominator.max(1) as f64;
            let grad_norm = if a.max_grad_norm > 0.0 {
                tilearn_optim::clip_grad_norm(&mut grads, a.max_grad_norm)
            } else {
                tilearn_optim::global_grad_norm(&grads)
            };
            if !loss.is_finite() || !grad_norm.is_finite() {
                return Err(EngineError::InvalidArgument {
                    argument: "--learning-rate".into(),
                    message: format!(
                        "step {}: loss {loss} / grad norm {grad_norm} is not finite; training stopped before the update, the last checkpoint is intact; lower the learning rate or enable clipping",
                        state.global_step + 1
                    ),
                });
            }
            let lr = schedule.lr_at(state.global_step);
            optimizer.step(&mut self.model.params.data, &grads, lr)?;
            state.global_step += 1;
            state.tokens_seen += tokens_per_step;
            state.loader = loader.state();

            let step_secs = step_start.elapsed().as_secs_f64();
            window.add(loss, grad_norm, step_secs, tokens_per_step);
            if first_loss.is_nan() {
                first_loss = loss;
            }
            final_loss = loss;
            sink.step(state.global_step, loss, lr as f64);
            let last = state.global_step == total_steps;
            if state.global_step.is_multiple_of(a.logging_steps.max(1)) || last {
                let record = window.take(
                    state.global_step,
                    state.global_step as f64 / steps_per_epoch as f64,
                    lr as f64,
                );
                log.write(&record)?;
                sink.log(&record);
            }
            if (a.save_steps > 0 && state.global_step.is_multiple_of(a.save_steps)) || last {
                self.save_checkpoint(&state, &optimizer, &schedule)?;
            }
        }
        sink.finish();
        self.model
            .save_pretrained(&a.output_dir, DType::F32, None)?;

        let steps_run = state.global_step - first_step;
        let elapsed = run_start.elapsed().as_secs_f64();
        Ok(TrainSummary {
            steps: state.global_step,
            first_loss,
            final_loss,
            mean_step_seconds: elapsed / steps_run.max(1) as f64,
            tokens_per_sec: (steps_run * tokens_per_step) as f64 / elapsed.max(1e-9),
            output_dir: a.output_dir.clone(),
        })
    }

    fn save_checkpoint(
        &self,
        state: &TrainerState,
        optimizer: &AdamW,
        schedule: &LrSchedule,
    ) -> Result<()> {
        let dir = checkpoint::checkpoint_dir(&self.args.output_dir, state.global_step);
        checkpoint::save_dir_atomically(&dir, |staging| {
            // f32 on disk so that a resume continues bit-for-bit.
            self.model.save_pretrained(staging, DType::F32, None)?;
            optimizer.save_state(&staging.join(state::OPTIMIZER_FILE))?;
            state::write_json(
                &staging.join(state::SCHEDULER_FILE),
                &SchedulerState {
                    lr_scheduler_type: self.args.lr_scheduler_type.clone(),
                    base_lr: schedule.base_lr,
                    warmup_steps: schedule.warmup_steps,
                    total_steps: schedule.total_steps,
                    last_step: state.global_step,
                },
            )?;
            state::write_json(&staging.join(state::TRAINER_STATE_FILE), state)
        })
    }

    fn restore(&mut self, dir: &Path, optimizer: &mut AdamW) -> Result<TrainerState> {
        let state: TrainerState = state::read_json(&dir.join(state::TRAINER_STATE_FILE))?;
        if state.seed != self.args.seed {
            return Err(EngineError::InvalidArgument {
                argument: "--seed".into(),
                message: format!(
                    "{} differs from the checkpoint's seed {}; resume with --seed {}",
                    self.args.seed, state.seed, state.seed
                ),
            });
        }
        let loaded = LlamaForCausalLM::from_pretrained(dir)?;
        if loaded.params.numel() != self.model.params.numel() {
            return Err(EngineError::InvalidArgument {
                argument: "--resume-from-checkpoint".into(),
                message: format!(
                    "{} holds a model of {} parameters, this run builds {}; resume with the same --config/--model",
                    dir.display(),
                    loaded.params.numel(),
                    self.model.params.numel()
                ),
            });
        }
        self.model = loaded;
        optimizer.load_state(&dir.join(state::OPTIMIZER_FILE))?;
        Ok(state)
    }
}

/// Averages over the steps since the last log line, as Hugging Face's Trainer logs.
#[derive(Default)]
struct LogWindow {
    loss: f64,
    grad_norm: f64,
    seconds: f64,
    tokens: u64,
    steps: u64,
}

impl LogWindow {
    fn add(&mut self, loss: f64, grad_norm: f64, seconds: f64, tokens: u64) {
        self.loss += loss;
        self.grad_norm += grad_norm;
        self.seconds += seconds;
        self.tokens += tokens;
        self.steps += 1;
    }

    fn take(&mut self, step: u64, epoch: f64, lr: f64) -> LogRecord {
        let n = self.steps.max(1) as f64;
        let record = LogRecord {
            step,
            epoch,
            loss: self.loss / n,
            lr,
            grad_norm: self.grad_norm / n,
            tokens_per_sec: self.tokens as f64 / self.seconds.max(1e-9),
        };
        *self = LogWindow::default();
        record
    }
}

/// Fails early, naming the directory, when the output directory cannot be written.
fn probe_writable(dir: &Path) -> Result<()> {
    let probe = dir.join(".tilearn-write-probe");
    std::fs::write(&probe, b"ok").map_err(|e| EngineError::Io {
        path: dir.to_path_buf(),
        action: "write to the output directory (choose a writable --output-dir)",
        source: e,
    })?;
    let _ = std::fs::remove_file(probe);
    Ok(())
}

/// Drops log records past `step` (a run that went on after the checkpoint it resumes from).
fn trim_log(path: &Path, step: u64) -> Result<()> {
    if !path.exists() {
        return Ok(());
    }
    let kept: Vec<String> = log::read_log(path)?
        .into_iter()
        .filter(|r| r.step <= step)
        .map(|r| serde_json::to_string(&r).expect("LogRecord serialises"))
        .collect();
    let mut text = kept.join("\n");
    if !text.is_empty() {
        text.push('\n');
    }
    checkpoint::write_atomically(path, text.as_bytes())
}
