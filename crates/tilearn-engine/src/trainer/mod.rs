//! The Trainer: the optimisation loop around a model, a token dataset and AdamW.
//!
//! One optimizer step = `gradient_accumulation_steps` micro-batches whose gradients add into
//! one buffer. The loss of the step is the sum of token losses over all micro-batches divided by
//! the number of non-ignored targets in all of them (Hugging Face's `num_items_in_batch`), so
//! accumulation gives the same gradient as one large batch.

pub mod args;
pub mod backend;
pub mod checkpoint;
pub mod cpu_backend;
#[cfg(feature = "cuda")]
pub mod gpu_backend;
pub mod log;
pub mod state;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use adaptfp16::{AmpPlan, GradScaler, Signals, TimeUnit};
use tilearn_ops::DType;
use tilearn_optim::{AdamW, AdamWConfig, LrSchedule, ParamGroup, SchedulerType};

pub use args::{TrainLength, TrainingArguments};
pub use backend::StepBackend;
pub use cpu_backend::CpuBackend;
pub use log::{LogRecord, TrainLog};
pub use state::{SchedulerState, TrainerState};

use crate::config::LlamaConfig;
use crate::data::{DataLoader, LoaderOptions, LoaderState, TokenDataset, WorkerHook};
use crate::model::{LlamaForCausalLM, count_valid_targets};
use crate::params::ParamStore;
use crate::{EngineError, Result};

/// What a finished run reports.
#[derive(Clone, Debug)]
pub struct TrainSummary {
    pub steps: u64,
    pub first_loss: f64,
    pub final_loss: f64,
    pub mean_step_seconds: f64,
    pub tokens_per_sec: f64,
    /// Optimizer steps skipped by the GradScaler (non-finite fp16 gradients).
    pub skipped_steps: u64,
    pub peak_memory_bytes: u64,
    pub output_dir: PathBuf,
}

/// Trains a model on `dataset` as `args` say, on whichever [`StepBackend`] holds the model.
pub struct Trainer {
    pub args: TrainingArguments,
    config: LlamaConfig,
    backend: Box<dyn StepBackend>,
    dataset: Arc<TokenDataset>,
    /// Run on the data loader's worker thread before its first batch (see
    /// [`Trainer::set_loader_hook`]).
    loader_hook: Option<Arc<dyn Fn() + Send + Sync>>,
    amp: AmpPlan,
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
        println!("{}", r.display_line());
    }
    fn finish(&mut self) {}
}

/// Hugging Face's grouping for AdamW: weight decay on matrices and embeddings, none on norms
/// and biases.
pub fn adamw_for(args: &TrainingArguments, params: &ParamStore) -> Result<AdamW> {
    let config = AdamWConfig {
        lr: args.learning_rate,
        beta1: args.adam_beta1,
        beta2: args.adam_beta2,
        eps: args.adam_epsilon,
        weight_decay: args.weight_decay,
        amsgrad: false,
    };
    let groups = vec![
        ParamGroup {
            name: "decay".into(),
            ranges: params.decay_ranges(),
            weight_decay: args.weight_decay,
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

impl Trainer {
    /// A Trainer on the CPU reference engine.
    pub fn new(
        args: TrainingArguments,
        model: LlamaForCausalLM,
        dataset: TokenDataset,
    ) -> Result<Trainer> {
        args.validate()?;
        let optimizer = adamw_for(&args, &model.params)?;
        let config = model.config.clone();
        let backend = CpuBackend::new(
            model,
            optimizer,
            args.per_device_train_batch_size,
            args.seq_len,
            args.gradient_checkpointing,
        );
        Trainer::with_backend(args, config, Box::new(backend), dataset)
    }

    /// A Trainer on any backend (the CUDA engine builds its own).
    pub fn with_backend(
        args: TrainingArguments,
        config: LlamaConfig,
        backend: Box<dyn StepBackend>,
        dataset: TokenDataset,
    ) -> Result<Trainer> {
        args.validate()?;
        let max_pos = config.max_position_embeddings;
        if args.seq_len > max_pos {
            return Err(EngineError::InvalidArgument {
                argument: "--seq-len".into(),
                message: format!(
                    "{} is above the model's max_position_embeddings ({max_pos}); use --seq-len {max_pos} or less",
                    args.seq_len
                ),
            });
        }
        if dataset.vocab_size() > config.vocab_size {
            return Err(EngineError::InvalidArgument {
                argument: "--data".into(),
                message: format!(
                    "the dataset's tokenizer has {} tokens but the model's vocab_size is {}; prepare the data with the model's tokenizer",
                    dataset.vocab_size(),
                    config.vocab_size
                ),
            });
        }
        Ok(Trainer {
            args,
            config,
            backend,
            dataset: Arc::new(dataset),
            loader_hook: None,
            amp: AmpPlan::Fixed(DType::F32),
        })
    }

    /// Code the data loader's worker thread runs once before producing batches, e.g. pinning it
    /// to CPUs near the GPU (`tilearn_affinity::RankPlan::loader_hook`). A `Fn` behind an `Arc`
    /// because every loader the trainer starts (one per `train` call) runs it.
    pub fn set_loader_hook(&mut self, hook: Arc<dyn Fn() + Send + Sync>) {
        self.loader_hook = Some(hook);
    }

    /// The precision plan: a fixed precision (default fp32) or an adaptive policy.
    pub fn set_amp_plan(&mut self, plan: AmpPlan) {
        self.amp = plan;
    }

    /// Where the steps run.
    pub fn backend_description(&self) -> String {
        self.backend.describe()
    }

    /// The model with its current weights.
    pub fn model(&mut self) -> Result<&LlamaForCausalLM> {
        self.backend.model()
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

        if let Some(p) = self
            .amp
            .possible_precisions()
            .into_iter()
            .find(|&p| !self.backend.supports(p))
        {
            return Err(EngineError::InvalidArgument {
                argument: "precision".into(),
                message: format!(
                    "{} cannot run {p} periods; choose a precision it supports (or --device cpu)",
                    self.backend.describe()
                ),
            });
        }
        let schedule = self.schedule(total_steps)?;
        let mut scaler = self.amp.new_scaler();
        let mut state = TrainerState {
            global_step: 0,
            max_steps: total_steps,
            loader: LoaderState::default(),
            seed: a.seed,
            tokens_seen: 0,
        };
        if let Some(dir) = resume {
            state = self.restore(dir, &mut scaler)?;
            state.max_steps = total_steps;
            trim_log(&a.output_dir.join(log::LOG_FILE), state.global_step)?;
        }
        let mut log = TrainLog::open(&a.output_dir, resume.is_none())?;

        let hook = self
            .loader_hook
            .clone()
            .map(|hook| -> WorkerHook { Box::new(move || hook()) });
        let options = LoaderOptions::new(batch, seq, a.seed).starting_at(state.loader);
        let mut loader = DataLoader::with_options(self.dataset.clone(), options, hook)?;
        let tokens_per_step = (batch * seq * accum) as u64;

        let mut window = LogWindow::default();
        let (mut first_loss, mut final_loss) = (f64::NAN, f64::NAN);
        let mut last_loss = None;
        let mut skipped_total = 0u64;
        let run_start = Instant::now();
        let first_step = state.global_step;
        sink.start(total_steps, first_step);

        while state.global_step < total_steps {
            let step_start = Instant::now();
            let lr = schedule.lr_at(state.global_step);
            let period = match self.amp.unit() {
                TimeUnit::Step => state.global_step,
                TimeUnit::Epoch => state.global_step / steps_per_epoch,
            };
            let signals = Signals {
                lr: Some(lr as f64),
                loss: last_loss,
            };
            let precision = self.amp.decide(period, signals, Some(&mut scaler))?;
            let scaled = precision.needs_loss_scaling() && scaler.is_enabled();
            let loss_scale = if scaled { scaler.get_scale() } else { 1.0 };

            let micro: Vec<_> = (0..accum)
                .map(|_| loader.next_batch())
                .collect::<Result<_>>()?;
            let denominator = micro
                .iter()
                .map(|b| count_valid_targets(&b.labels, batch, seq))
                .sum::<usize>()
                .max(1) as f64;
            self.backend.zero_grads();
            let mut loss_sum = 0.0;
            for b in &micro {
                loss_sum += self
                    .backend
                    .forward_backward(b, denominator, precision, loss_scale)?;
            }
            if scaled && a.debug_inject_overflow.contains(&(state.global_step + 1)) {
                self.backend.poison_gradients()?;
            }
            let loss = loss_sum / denominator;

            let mut skipped = false;
            if scaled {
                let mut grads = BackendGrads {
                    backend: self.backend.as_mut(),
                    found_inf: false,
                };
                scaler.unscale(&mut grads)?;
                skipped = scaler.update(&mut grads)?.skipped();
            }
            let grad_norm = if skipped {
                f64::NAN
            } else {
                let clip_norm = self.backend.clip_grad_norm(a.max_grad_norm);
                let diverged = |norm: f64| EngineError::InvalidArgument {
                    argument: "--learning-rate".into(),
                    message: format!(
                        "step {}: loss {loss} / grad norm {norm} is not finite in {precision}; training stopped, the last checkpoint on disk is intact; lower the learning rate, enable clipping or use --fp16 with its loss scaler",
                        state.global_step + 1
                    ),
                };
                if !loss.is_finite() || !clip_norm.is_finite() {
                    return Err(diverged(clip_norm));
                }
                let norm = self.backend.optimizer_step(lr)?.unwrap_or(clip_norm);
                if !norm.is_finite() {
                    return Err(diverged(norm));
                }
                norm
            };
            state.global_step += 1;
            state.tokens_seen += tokens_per_step;
            state.loader = loader.state();
            skipped_total += skipped as u64;
            last_loss = Some(loss);

            let step_secs = step_start.elapsed().as_secs_f64();
            window.add(loss, grad_norm, step_secs, tokens_per_step, skipped);
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
                    precision,
                    if precision.needs_loss_scaling() {
                        scaler.get_scale() as f64
                    } else {
                        1.0
                    },
                );
                log.write(&record)?;
                sink.log(&record);
            }
            if (a.save_steps > 0 && state.global_step.is_multiple_of(a.save_steps)) || last {
                self.save_checkpoint(&state, &schedule, &scaler)?;
            }
        }
        sink.finish();
        self.backend
            .model()?
            .save_pretrained(&a.output_dir, DType::F32, None)?;

        let steps_run = state.global_step - first_step;
        let elapsed = run_start.elapsed().as_secs_f64();
        Ok(TrainSummary {
            steps: state.global_step,
            first_loss,
            final_loss,
            mean_step_seconds: elapsed / steps_run.max(1) as f64,
            tokens_per_sec: (steps_run * tokens_per_step) as f64 / elapsed.max(1e-9),
            skipped_steps: skipped_total,
            peak_memory_bytes: self.backend.peak_memory_bytes(),
            output_dir: a.output_dir.clone(),
        })
    }

    fn save_checkpoint(
        &mut self,
        state: &TrainerState,
        schedule: &LrSchedule,
        scaler: &GradScaler,
    ) -> Result<()> {
        let dir = checkpoint::checkpoint_dir(&self.args.output_dir, state.global_step);
        let lr_scheduler_type = self.args.lr_scheduler_type.clone();
        let backend = &mut self.backend;
        let amp = &self.amp;
        checkpoint::save_dir_atomically(&dir, |staging| {
            // f32 on disk so that a resume continues bit-for-bit.
            backend
                .model()?
                .save_pretrained(staging, DType::F32, None)?;
            backend.save_optimizer(&staging.join(state::OPTIMIZER_FILE))?;
            state::write_json(
                &staging.join(state::SCHEDULER_FILE),
                &SchedulerState {
                    lr_scheduler_type,
                    base_lr: schedule.base_lr,
                    warmup_steps: schedule.warmup_steps,
                    total_steps: schedule.total_steps,
                    last_step: state.global_step,
                },
            )?;
            if scaler.is_enabled() {
                state::write_json(&staging.join(state::SCALER_FILE), &scaler.state_dict_json())?;
            }
            if let AmpPlan::Adaptive(policy) = amp {
                state::write_json(&staging.join(state::AMP_POLICY_FILE), &policy.state_json()?)?;
            }
            state::write_json(&staging.join(state::TRAINER_STATE_FILE), state)
        })
    }

    fn restore(&mut self, dir: &Path, scaler: &mut GradScaler) -> Result<TrainerState> {
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
        if loaded.config != self.config {
            return Err(EngineError::InvalidArgument {
                argument: "--resume-from-checkpoint".into(),
                message: format!(
                    "{} holds a different model ({} parameters) from the one this run builds; resume with the same --config/--model",
                    dir.display(),
                    loaded.params.numel(),
                ),
            });
        }
        self.backend
            .restore(loaded, &dir.join(state::OPTIMIZER_FILE))?;
        let scaler_file = dir.join(state::SCALER_FILE);
        if scaler.is_enabled() && scaler_file.exists() {
            let json: serde_json::Value = state::read_json(&scaler_file)?;
            scaler.load_state_dict_json(&json)?;
        }
        let policy_file = dir.join(state::AMP_POLICY_FILE);
        if let (AmpPlan::Adaptive(policy), true) = (&mut self.amp, policy_file.exists()) {
            let json: serde_json::Value = state::read_json(&policy_file)?;
            policy.load_state_json(&json)?;
        }
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
    skipped: u64,
}

impl LogWindow {
    fn add(&mut self, loss: f64, grad_norm: f64, seconds: f64, tokens: u64, skipped: bool) {
        self.loss += loss;
        if !skipped {
            self.grad_norm += grad_norm;
        }
        self.seconds += seconds;
        self.tokens += tokens;
        self.steps += 1;
        self.skipped += skipped as u64;
    }

    fn take(
        &mut self,
        step: u64,
        epoch: f64,
        lr: f64,
        precision: DType,
        loss_scale: f64,
    ) -> LogRecord {
        let n = self.steps.max(1) as f64;
        let applied = self.steps - self.skipped;
        let record = LogRecord {
            step,
            epoch,
            loss: self.loss / n,
            lr,
            // Skipped steps have no meaningful norm; a window of only skipped steps logs NaN.
            grad_norm: if applied > 0 {
                self.grad_norm / applied as f64
            } else {
                f64::NAN
            },
            tokens_per_sec: self.tokens as f64 / self.seconds.max(1e-9),
            precision: precision.as_str().to_string(),
            loss_scale,
            skipped_steps: self.skipped,
        };
        *self = LogWindow::default();
        record
    }
}

/// The backend's gradients as the GradScaler's unscale target.
struct BackendGrads<'a> {
    backend: &'a mut dyn StepBackend,
    found_inf: bool,
}

impl adaptfp16::UnscaleTarget for BackendGrads<'_> {
    fn unscale_and_check(
        &mut self,
        inv_scale: f32,
    ) -> std::result::Result<(), adaptfp16::BackendError> {
        self.found_inf = self
            .backend
            .unscale_and_check(inv_scale)
            .map_err(|e| Box::new(e) as adaptfp16::BackendError)?;
        Ok(())
    }

    fn found_inf(&mut self) -> std::result::Result<bool, adaptfp16::BackendError> {
        Ok(self.found_inf)
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
