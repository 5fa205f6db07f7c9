//! The Trainer: the optimisation loop around a model, a token dataset and AdamW.
//!
//! One optimizer step = `gradient_accumulation_steps` micro-batches whose gradients add into
//! one buffer. The loss of the step is the sum of token losses over all micro-batches divided by
//! the number of non-ignored targets in all of them (Hugging Face's `num_items_in_batch`), so
//! accumulation gives the same gradient as one large batch.

pub mod args;
pub mod backend;
pub mod best_model;
pub mod checkpoint;
pub mod cpu_backend;
pub mod data_parallel;
pub mod disk;
pub mod eval;
pub mod flat_buffer;
#[cfg(feature = "cuda")]
pub mod gpu_backend;
pub mod host;
pub mod log;
pub mod model_parallel;
mod model_parallel_checkpoint;
pub mod optimizer_file;
pub mod optimizer_layout;
pub mod optimizer_shards;
mod saving;
pub mod stage_executor;
pub mod state;
pub mod tensorboard;
pub mod zero;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use adaptfp16::{AmpPlan, Signals, TimeUnit};
use tilearn_ops::DType;
use tilearn_optim::{AdamW, AdamWConfig, LrSchedule, ParamGroup, SchedulerType};

pub use args::{EvalStrategy, ReportTo, SaveStrategy, TrainLength, TrainingArguments};
pub use backend::{ModelInit, StepBackend, WholeStep};
pub use cpu_backend::CpuBackend;
pub use data_parallel::{DataParallel, DdpOptions, ZeroStage};
pub use disk::{FilesystemSpace, FreeSpace};
pub use eval::{EvalLoss, EvalSet};
pub use log::{EvalRecord, LogRecord, TrainLog};
pub use state::{SchedulerState, TrainerState};
pub use tensorboard::TensorBoardLog;

use crate::config::LlamaConfig;
use crate::cuda_graphs::StepConditions;
use crate::data::{DataLoader, LoaderOptions, LoaderState, TokenDataset, WorkerHook};
use crate::model::{LlamaForCausalLM, count_valid_targets};
use crate::params::{ParamSpec, ParamStore};
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
    /// The process's peak resident host memory (`VmHWM`), where the platform reports it.
    pub host_peak_rss_bytes: Option<u64>,
    /// Seconds from the Trainer's start clock ([`Trainer::set_start_time`]) to the end of this
    /// run's first optimizer step (`None` when no step ran).
    pub time_to_first_step: Option<f64>,
    /// Seconds the final model's files took to write.
    pub final_save_seconds: f64,
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
    /// The free space the disk checks consult (the real filesystem's unless a test injects
    /// one).
    space: Arc<dyn FreeSpace>,
    /// What time-to-first-step is measured from.
    started: Instant,
    /// This rank's place in data parallelism (a single process by default).
    dp: DataParallel,
    /// The held-out set evaluated as `args.eval_strategy` says.
    eval: Option<EvalSet>,
    /// This rank's place in tensor × pipeline parallelism (`None` unless
    /// [`Trainer::set_model_parallel`]).
    mp: Option<ModelParallelPlace>,
    /// The checkpoint this run resumed from (never deleted by rotation).
    resumed_from: Option<PathBuf>,
}

/// A rank's place in tensor × pipeline parallelism, as the Trainer's checkpoints need it.
#[derive(Clone)]
pub struct ModelParallelPlace {
    /// This rank in its model replica (`tp_rank + tp · pp_rank`).
    pub rank: usize,
    pub tp: usize,
    pub pp: usize,
    /// Every rank of the job: the ranks of a checkpoint agree over it that each wrote its part.
    pub world: Arc<dyn tilearn_parallel::Communicator>,
}

impl ModelParallelPlace {
    pub fn size(&self) -> usize {
        self.tp * self.pp
    }
}

/// Observes progress (the CLI's progress bar); called after every optimizer step.
pub trait ProgressSink {
    fn start(&mut self, total_steps: u64, first_step: u64);
    fn step(&mut self, step: u64, loss: f64, lr: f64);
    fn log(&mut self, record: &LogRecord);
    /// An evaluation of the eval set.
    fn eval(&mut self, record: &EvalRecord) {
        self.note(&record.display_line());
    }
    fn finish(&mut self);
    /// A line of information (time to the first step, save times).
    fn note(&mut self, line: &str) {
        println!("{line}");
    }
    /// A problem the run survives (a checkpoint that could not be written).
    fn warn(&mut self, line: &str) {
        eprintln!("warning: {line}");
    }
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
    let (config, groups) = adamw_setup(args, &params.specs);
    Ok(AdamW::new(config, groups, params.numel())?)
}

/// The configuration and groups of [`adamw_for`], for a model with tensors `specs`, without
/// allocating any state.
pub fn adamw_setup(
    args: &TrainingArguments,
    specs: &[ParamSpec],
) -> (AdamWConfig, Vec<ParamGroup>) {
    let layout = ParamStore {
        specs: specs.to_vec(),
        data: Vec::new(),
    };
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
            ranges: layout.decay_ranges(),
            weight_decay: args.weight_decay,
            lr_scale: 1.0,
        },
        ParamGroup {
            name: "no_decay".into(),
            ranges: layout.no_decay_ranges(),
            weight_decay: 0.0,
            lr_scale: 1.0,
        },
    ];
    (config, groups)
}

impl Trainer {
    /// A Trainer on the CPU reference engine.
    pub fn new(
        args: TrainingArguments,
        model: LlamaForCausalLM,
        dataset: TokenDataset,
    ) -> Result<Trainer> {
        args.validate()?;
        best_model::validate(&args)?;
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
        best_model::validate(&args)?;
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
        let numel = backend.specs().iter().map(ParamSpec::numel).sum();
        Ok(Trainer {
            dp: DataParallel::single(numel),
            args,
            config,
            backend,
            dataset: Arc::new(dataset),
            loader_hook: None,
            amp: AmpPlan::Fixed(DType::F32),
            space: Arc::new(FilesystemSpace),
            started: Instant::now(),
            eval: None,
            mp: None,
            resumed_from: None,
        })
    }

    /// The prepared token dataset to evaluate on (`--eval-data`); checked now against the
    /// model's vocabulary and the window length, so a bad set fails before training starts.
    pub fn set_eval_dataset(&mut self, dataset: TokenDataset) -> Result<()> {
        self.eval = Some(EvalSet::new(
            dataset,
            self.config.vocab_size,
            self.args.seq_len,
        )?);
        Ok(())
    }

    /// Evaluates the eval set on the current weights in `precision` (every rank calls it and
    /// gets the same loss).
    pub fn evaluate(&mut self, precision: DType) -> Result<Option<EvalLoss>> {
        let Some(set) = &self.eval else {
            return Ok(None);
        };
        let loss = set.evaluate(
            self.backend.as_mut(),
            &self.dp,
            self.args.eval_batch_size(),
            self.args.max_eval_batches,
            precision,
        )?;
        Ok(Some(loss))
    }

    /// The free-space provider of the disk checks (default: the output filesystem's real free
    /// space); tests inject a small quota.
    pub fn set_free_space(&mut self, space: Arc<dyn FreeSpace>) {
        self.space = space;
    }

    /// What time-to-first-step is measured from (default: when the Trainer was built); the CLI
    /// passes its own start so the report covers model building and loading.
    pub fn set_start_time(&mut self, started: Instant) {
        self.started = started;
    }

    /// Code the data loader's worker thread runs once before producing batches, e.g. pinning it
    /// to CPUs near the GPU (`tilearn_affinity::RankPlan::loader_hook`). A `Fn` behind an `Arc`
    /// because every loader the trainer starts (one per `train` call) runs it.
    pub fn set_loader_hook(&mut self, hook: Arc<dyn Fn() + Send + Sync>) {
        self.loader_hook = Some(hook);
    }

    /// Trains as one rank of data parallelism `dp` (built for this model's parameter count);
    /// under ZeRO the backend's optimizer keeps only this rank's shard from now on.
    pub fn set_data_parallel(&mut self, dp: DataParallel) -> Result<()> {
        let on_device = self.backend.flat_gradients()?.host().is_none();
        // Only a backend with the backward's gradient hook overlaps (the tensor- and
        // pipeline-parallel GPU backends reduce after the backward).
        #[cfg(feature = "cuda")]
        let hooked = self.backend.compute_stream().is_some();
        #[cfg(not(feature = "cuda"))]
        let hooked = false;
        if dp.options().comm_dtype != DType::F32 && on_device && !(dp.options().overlap && hooked) {
            let fix = if hooked {
                "drop --no-ddp-overlap (or --ddp-comm-dtype)"
            } else {
                "this backend reduces after the backward: drop --ddp-comm-dtype"
            };
            return Err(EngineError::InvalidArgument {
                argument: "--ddp-comm-dtype".into(),
                message: format!(
                    "{} compresses its gradients to bf16 inside the all-reduce overlapped with \
                     the backward; {fix}",
                    self.backend.describe()
                ),
            });
        }
        if dp.is_sharded() {
            self.backend.shard_optimizer(dp.owned())?;
        }
        if dp.reduces_each_micro_batch() {
            // ZeRO-2 reducing during the backward: the GPU engine then keeps only the owned
            // gradients plus a window (the CPU engine keeps its whole buffer).
            self.backend.shard_gradients(dp.owned())?;
        }
        self.dp = dp;
        Ok(())
    }

    /// Trains as one rank of a model replica split by tensor and pipeline parallelism (the
    /// backend holds that rank's part; [`Self::set_data_parallel`] then spans the ranks holding
    /// the same part). Only the replica's rank 0 writes the model files (gathered from every
    /// rank); checkpoints add every rank's optimizer slices (see [`ModelParallelPlace`]).
    pub fn set_model_parallel(&mut self, place: ModelParallelPlace) -> Result<()> {
        self.mp = Some(place);
        Ok(())
    }

    /// The number of parameters this rank's backend holds (its slices under tensor
    /// parallelism): the length of the flat buffers data parallelism reduces.
    pub fn local_parameter_count(&self) -> usize {
        self.backend.specs().iter().map(ParamSpec::numel).sum()
    }

    /// Whether this rank writes the run's files (the log, the model, checkpoints): rank 0 of
    /// data parallelism and of its model replica.
    fn writes_files(&self) -> bool {
        self.dp.is_primary() && self.mp.as_ref().is_none_or(|m| m.rank == 0)
    }

    /// This rank's place in data parallelism.
    pub fn data_parallel(&self) -> &DataParallel {
        &self.dp
    }

    /// The model-state bytes this rank holds (weights, gradients, optimizer state) next to the
    /// ZeRO paper's per-rank formula for its stage (see [`zero`]).
    pub fn model_state_report(&self) -> String {
        use zero::per_rank;
        let numel: usize = self.backend.specs().iter().map(ParamSpec::numel).sum();
        let bytes = self.backend.state_layout();
        let state = self.backend.state_held();
        let (world, stage) = (self.dp.world_size(), self.dp.zero_stage());
        let formula = per_rank(bytes, numel as u64, world as u64, stage);
        let owned = self.dp.owned().len() as u64;
        let window = state.grad_window as u64;
        // A backend that holds whole-model gradients under stage 2 (the CPU engine) is
        // counted with the formula's owned shard and its whole buffer named separately below.
        let grads_held = if stage == ZeroStage::Two && self.dp.is_sharded() && window == 0 {
            owned * bytes.grads
        } else {
            state.grads as u64
        };
        let (weights, optimizer) = (state.weights as u64, state.optimizer as u64);
        let held = weights + grads_held + optimizer;
        let grads_text = if window > 0 {
            format!(
                "{grads_held} (owned shard {} + backward window {window})",
                grads_held - window
            )
        } else {
            grads_held.to_string()
        };
        let mut line = format!(
            "model states on rank {}: {held} bytes (weights {} + gradients {grads_text} + \
             optimizer {}); ZeRO stage {}: {} = {:.0} bytes (Ψ = {numel}, N = {world})",
            self.dp.rank(),
            weights,
            optimizer,
            stage.number(),
            zero::formula_text(bytes, stage),
            formula.total(),
        );
        if grads_held < state.grads as u64 {
            // Honest accounting: the engine's backward writes whole-model gradients before
            // they are reduce-scattered into the owned shard.
            line.push_str(&format!(
                "; plus the backward's full gradient buffer of {} bytes, reused every micro-batch",
                state.grads
            ));
        }
        line
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
        let has_eval_set = self.eval.is_some() || a.validation_split_percentage.is_some();
        if a.eval_strategy != EvalStrategy::No && !has_eval_set {
            return Err(EngineError::InvalidArgument {
                argument: "--eval-strategy".into(),
                message: "evaluation needs an eval set; pass --eval-data DIR or \
                          --validation-split-percentage P, or use --eval-strategy no"
                    .into(),
            });
        }

        let (batch, seq, accum) = (
            a.per_device_train_batch_size,
            a.seq_len,
            a.gradient_accumulation_steps,
        );
        let (rank, world) = (self.dp.rank(), self.dp.world_size());
        let mut train_windows = None;
        if let Some(percentage) = a.validation_split_percentage {
            let (set, train) = EvalSet::held_out(self.dataset.clone(), seq, percentage)?;
            self.eval = Some(set);
            train_windows = Some(train);
        }
        let loader_options = LoaderOptions {
            rank,
            world_size: world,
            windows: train_windows,
            ..LoaderOptions::new(batch, seq, a.seed)
        };
        let probe_loader = DataLoader::with_options(self.dataset.clone(), loader_options, None)?;
        let batches_per_epoch = probe_loader.batches_per_epoch();
        drop(probe_loader);
        let steps_per_epoch = batches_per_epoch / accum as u64;
        if steps_per_epoch == 0 {
            return Err(EngineError::InvalidArgument {
                argument: "--gradient-accumulation-steps".into(),
                message: format!(
                    "one epoch has {batches_per_epoch} batches per rank, fewer than {accum} accumulation steps; lower it or use more data"
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
        let windows_per_batch = (batch * world) as u64;
        let mut state = TrainerState {
            global_step: 0,
            max_steps: total_steps,
            loader: LoaderState::default(),
            seed: a.seed,
            tokens_seen: 0,
            windows_per_batch: Some(windows_per_batch),
            best: Default::default(),
        };
        let primary = self.writes_files();
        let best_metric = best_model::BestMetric::parse(a.metric_for_best_model.as_deref())?;
        let mut last_eval = best_model::LastEval::default();
        self.resumed_from = resume.map(Path::to_path_buf);
        if let Some(dir) = resume {
            state = self.restore(dir, &mut scaler)?;
            state.max_steps = total_steps;
            state.loader = resume_position(&state, windows_per_batch, dir)?;
            state.windows_per_batch = Some(windows_per_batch);
            if primary {
                trim_log(&a.output_dir.join(log::LOG_FILE), state.global_step)?;
            }
        }
        let first_step = state.global_step;
        if primary {
            self.check_disk_at_start(first_step, total_steps)?;
        }
        // Only rank 0 writes the log (and the model and checkpoints' shared files).
        let mut log = if primary {
            Some(TrainLog::open(&a.output_dir, resume.is_none())?)
        } else {
            None
        };
        let mut tensorboard_log = match a.report_to {
            ReportTo::TensorBoard if primary => {
                let dir = a
                    .logging_dir
                    .clone()
                    .unwrap_or_else(|| tensorboard::default_logging_dir(&a.output_dir));
                let tb = TensorBoardLog::create(&dir, first_step)?;
                sink.note(&format!("tensorboard: events in {}", tb.path().display()));
                Some(tb)
            }
            _ => None,
        };

        let hook = self
            .loader_hook
            .clone()
            .map(|hook| -> WorkerHook { Box::new(move || hook()) });
        let options = loader_options.starting_at(state.loader);
        let mut loader = DataLoader::with_options(self.dataset.clone(), options, hook)?;
        // The global batch: every rank's micro-batches.
        let tokens_per_step = (batch * seq * accum * world) as u64;

        let mut window = LogWindow::default();
        let (mut first_loss, mut final_loss) = (f64::NAN, f64::NAN);
        let mut last_loss = None;
        let mut skipped_total = 0u64;
        let mut checkpoint_failures: Vec<String> = Vec::new();
        let mut time_to_first_step = None;
        let run_start = Instant::now();
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
            // The valid targets of the whole global batch (Hugging Face's
            // num_items_in_batch), so that the ranks' gradients sum to the global mean.
            let local_targets = micro
                .iter()
                .map(|b| count_valid_targets(&b.labels, batch, seq) as u64)
                .sum::<u64>();
            let denominator = self.dp.sum_count(local_targets)?.max(1) as f64;
            let diverged = |loss: f64, norm: f64| EngineError::InvalidArgument {
                argument: "--learning-rate".into(),
                message: format!(
                    "step {}: loss {loss} / grad norm {norm} is not finite in {precision}; training stopped, the last checkpoint on disk is intact; lower the learning rate, enable clipping or use --fp16 with its loss scaler",
                    state.global_step + 1
                ),
            };
            // The whole step as one replayed CUDA graph where the backend can (--cuda-graphs).
            let conditions = StepConditions {
                micro_batches: accum,
                world_size: world,
                loss_scaling: scaled,
                packed_rows: micro.iter().any(|b| b.positions.is_some()),
                sharded_optimizer: false,
            };
            let whole = self
                .backend
                .whole_step(&micro, denominator, precision, lr, conditions);
            if let Some(note) = self.backend.take_note() {
                sink.note(&note);
            }
            let (loss, skipped, grad_norm) = match whole {
                Some(step) => {
                    let step = step?;
                    let loss = step.loss_sum / denominator;
                    // The step already ran (its update is in the weights); stop before anything
                    // is saved from them.
                    if !loss.is_finite() || !step.grad_norm.is_finite() {
                        return Err(diverged(loss, step.grad_norm));
                    }
                    (loss, false, step.grad_norm)
                }
                None => {
                    self.backend.zero_grads();
                    let mut loss_sum = 0.0;
                    let whole_step = self.backend.forward_backward_step(
                        &micro,
                        denominator,
                        precision,
                        loss_scale,
                    );
                    let ran_whole_step = whole_step.is_some();
                    if let Some(step_loss) = whole_step {
                        loss_sum = step_loss?;
                        if scaled && a.debug_inject_overflow.contains(&(state.global_step + 1)) {
                            self.backend.poison_gradients()?;
                        }
                        self.dp.after_backward(self.backend.as_mut(), true)?;
                    }
                    for (i, b) in micro.iter().enumerate().filter(|_| !ran_whole_step) {
                        let last = i + 1 == micro.len();
                        let poison = scaled
                            && last
                            && a.debug_inject_overflow.contains(&(state.global_step + 1));
                        // The last micro-batch all-reduces its gradients during its own backward where
                        // the run allows it (never when a fault is injected after the backward).
                        // ZeRO-2 reduces every micro-batch during its backward (a fault is then
                        // injected into the reduced gradients afterwards).
                        let each = self.dp.reduces_each_micro_batch();
                        if each || (last && !poison) {
                            let backend = self.backend.as_mut();
                            let overlapped = self.dp.overlapped_backward(
                                backend,
                                b,
                                denominator,
                                precision,
                                loss_scale,
                            )?;
                            if let Some(loss) = overlapped {
                                loss_sum += loss;
                                if poison {
                                    self.backend.poison_gradients()?;
                                }
                                continue;
                            }
                        }
                        loss_sum +=
                            self.backend
                                .forward_backward(b, denominator, precision, loss_scale)?;
                        if poison {
                            self.backend.poison_gradients()?;
                        }
                        self.dp.after_backward(self.backend.as_mut(), last)?;
                    }
                    let loss = self.dp.sum_f64(loss_sum)? / denominator;

                    let mut skipped = false;
                    if scaled {
                        let mut grads = BackendGrads {
                            backend: self.backend.as_mut(),
                            dp: &self.dp,
                            found_inf: false,
                        };
                        scaler.unscale(&mut grads)?;
                        skipped = scaler.update(&mut grads)?.skipped();
                    }
                    let grad_norm = if skipped {
                        f64::NAN
                    } else {
                        let clip_norm = self
                            .dp
                            .clip_grad_norm(self.backend.as_mut(), a.max_grad_norm)?;
                        if !loss.is_finite() || !clip_norm.is_finite() {
                            return Err(diverged(loss, clip_norm));
                        }
                        let norm = self.backend.optimizer_step(lr)?.unwrap_or(clip_norm);
                        self.dp.gather_parameters(self.backend.as_mut())?;
                        if !norm.is_finite() {
                            return Err(diverged(loss, norm));
                        }
                        norm
                    };
                    (loss, skipped, grad_norm)
                }
            };
            state.global_step += 1;
            state.tokens_seen += tokens_per_step;
            state.loader = loader.state();
            skipped_total += skipped as u64;
            last_loss = Some(loss);

            let step_secs = step_start.elapsed().as_secs_f64();
            window.add(loss, grad_norm, step_secs, tokens_per_step, skipped);
            window.add_overlap(self.dp.take_overlap_stats());
            if first_loss.is_nan() {
                first_loss = loss;
            }
            final_loss = loss;
            sink.step(state.global_step, loss, lr as f64);
            if time_to_first_step.is_none() {
                let since_start = self.started.elapsed().as_secs_f64();
                time_to_first_step = Some(since_start);
                sink.note(&format!(
                    "first step done {since_start:.1} s after start ({step_secs:.1} s in the step); host peak RSS {}",
                    show_rss(host::peak_rss_bytes())
                ));
            }
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
                    world,
                );
                if let Some(log) = log.as_mut() {
                    log.write(&record)?;
                }
                if let Some(tb) = tensorboard_log.as_mut() {
                    tb.write(&record)?;
                }
                sink.log(&record);
            }
            if a.evaluates_at(state.global_step, total_steps, steps_per_epoch)
                && let Some(loss) = self.evaluate(precision)?
            {
                let record = EvalRecord {
                    step: state.global_step,
                    epoch: state.global_step as f64 / steps_per_epoch as f64,
                    eval_loss: loss.mean,
                    eval_perplexity: loss.mean.exp(),
                    eval_tokens: loss.tokens,
                    precision: precision.as_str().to_string(),
                };
                if let Some(log) = log.as_mut() {
                    log.write_eval(&record)?;
                }
                if let Some(tb) = tensorboard_log.as_mut() {
                    tb.write_eval(&record)?;
                }
                sink.eval(&record);
                last_eval.record(state.global_step, best_metric.value(&record));
            }
            // The last step's checkpoint comes after the final model (below).
            if !last && a.saves_checkpoint_at(state.global_step, total_steps) {
                let saved =
                    self.checkpoint_judged(&mut state, last_eval, &schedule, &scaler, sink)?;
                checkpoint_failures.extend(saved.err());
            }
            if a.debug_fail_after_step == Some(state.global_step) {
                return Err(EngineError::InvalidArgument {
                    argument: "--debug-fail-after-step".into(),
                    message: format!(
                        "failing on purpose after step {} (fault injection)",
                        state.global_step
                    ),
                });
            }
        }
        sink.finish();
        let elapsed = run_start.elapsed().as_secs_f64();
        // The final model first: a checkpoint that cannot be written never costs the model.
        // Rank 0 holds every weight (ZeRO all-gathers them after each step) and writes it once;
        // under tensor parallelism every rank of its group takes part (the model is gathered).
        // Where ranks hold only shards of the fp32 weights (ZeRO on the GPU), gather them
        // for rank 0's saves first: every rank takes part.
        self.dp.gather_whole_weights(self.backend.as_mut())?;
        // With --load-best-model-at-end the last checkpoint comes first (it holds the state
        // training ended in and may be the best), then the best weights are loaded; the best
        // checkpoint keeps the model on disk whatever happens to the final save.
        let final_checkpoint =
            state.global_step > first_step && a.saves_checkpoint_at(state.global_step, total_steps);
        if final_checkpoint && a.load_best_model_at_end {
            let saved = self.checkpoint_judged(&mut state, last_eval, &schedule, &scaler, sink)?;
            checkpoint_failures.extend(saved.err());
        }
        if a.load_best_model_at_end && self.load_best_model(&state, best_metric, sink)? {
            // Every rank loaded the best weights (under ZeRO each its shard of the fp32
            // masters); stage the whole weights again for rank 0's save.
            self.dp.gather_whole_weights(self.backend.as_mut())?;
        }
        let final_save_seconds = if self.dp.is_primary() {
            self.save_final_model(sink)?
        } else {
            0.0
        };
        if final_checkpoint && !a.load_best_model_at_end {
            let saved = self.try_checkpoint(&state, &schedule, &scaler, sink)?;
            checkpoint_failures.extend(saved.err());
        }
        // Every rank stays until rank 0 has written the model.
        self.dp.barrier()?;
        if !checkpoint_failures.is_empty() {
            return Err(EngineError::CheckpointsNotSaved {
                output_dir: a.output_dir.clone(),
                failures: checkpoint_failures.join("; "),
            });
        }

        let steps_run = state.global_step - first_step;
        Ok(TrainSummary {
            steps: state.global_step,
            first_loss,
            final_loss,
            mean_step_seconds: elapsed / steps_run.max(1) as f64,
            tokens_per_sec: (steps_run * tokens_per_step) as f64 / elapsed.max(1e-9),
            skipped_steps: skipped_total,
            peak_memory_bytes: self.backend.peak_memory_bytes(),
            host_peak_rss_bytes: host::peak_rss_bytes(),
            time_to_first_step,
            final_save_seconds,
            output_dir: a.output_dir.clone(),
        })
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
    /// Overlapped all-reduce: steps measured, their communication and exposed ms.
    overlap_steps: u64,
    comm_ms: f64,
    exposed_ms: f64,
}

impl LogWindow {
    fn add_overlap(&mut self, stats: Option<data_parallel::OverlapStats>) {
        if let Some(s) = stats {
            self.overlap_steps += 1;
            self.comm_ms += s.comm_ms;
            self.exposed_ms += s.exposed_ms;
        }
    }

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
        world_size: usize,
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
            world_size,
            allreduce_ms: (self.overlap_steps > 0)
                .then(|| self.comm_ms / self.overlap_steps as f64),
            allreduce_hidden: (self.overlap_steps > 0).then(|| {
                data_parallel::OverlapStats {
                    buckets: 0,
                    comm_ms: self.comm_ms,
                    exposed_ms: self.exposed_ms,
                }
                .hidden_share()
            }),
        };
        *self = LogWindow::default();
        record
    }
}

/// The backend's gradients as the GradScaler's unscale target (an overflow on any rank counts).
struct BackendGrads<'a> {
    backend: &'a mut dyn StepBackend,
    dp: &'a DataParallel,
    found_inf: bool,
}

impl adaptfp16::UnscaleTarget for BackendGrads<'_> {
    fn unscale_and_check(
        &mut self,
        inv_scale: f32,
    ) -> std::result::Result<(), adaptfp16::BackendError> {
        let boxed = |e: EngineError| Box::new(e) as adaptfp16::BackendError;
        let local = self.backend.unscale_and_check(inv_scale).map_err(boxed)?;
        self.found_inf = self.dp.found_inf(local).map_err(boxed)?;
        Ok(())
    }

    fn found_inf(&mut self) -> std::result::Result<bool, adaptfp16::BackendError> {
        Ok(self.found_inf)
    }
}

/// Peak RSS for log lines.
fn show_rss(bytes: Option<u64>) -> String {
    bytes.map_or("unknown".into(), |b| format!("{:.2} GiB", host::gib(b)))
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

/// Where the loader resumes: the checkpoint's position, converted when the checkpoint was
/// written with another global batch of windows per loader index (another number of ranks or
/// per-device batch); the windows consumed in the epoch must fill whole batches of the new size.
fn resume_position(
    state: &TrainerState,
    windows_per_batch: u64,
    dir: &Path,
) -> Result<LoaderState> {
    let saved = state.windows_per_batch.unwrap_or(windows_per_batch);
    let consumed = state.loader.batch_index * saved;
    if !consumed.is_multiple_of(windows_per_batch) {
        return Err(EngineError::InvalidArgument {
            argument: "--resume-from-checkpoint".into(),
            message: format!(
                "{} stopped after {consumed} windows of its epoch, not a whole number of this \
                 run's loader batches of {windows_per_batch} windows (per-device batch × ranks); \
                 resume with a per-device batch and rank count whose product divides {consumed}",
                dir.display()
            ),
        });
    }
    Ok(LoaderState {
        epoch: state.loader.epoch,
        batch_index: consumed / windows_per_batch,
    })
}

/// Drops log records past `step` (a run that went on after the checkpoint it resumes from).
fn trim_log(path: &Path, step: u64) -> Result<()> {
    if !path.exists() {
        return Ok(());
    }
    let kept: Vec<String> = log::read_log_lines(path)?
        .into_iter()
        .filter(|r| r.step() <= step)
        .map(|r| serde_json::to_string(&r).expect("LogLine serialises"))
        .collect();
    let mut text = kept.join("\n");
    if !text.is_empty() {
        text.push('\n');
    }
    checkpoint::write_atomically(path, text.as_bytes())
}
