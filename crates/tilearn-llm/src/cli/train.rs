//! `tilearn train`: flags named after Hugging Face `TrainingArguments`.
//!
//! Three starting points: `--model DIR` fine-tunes a Hugging Face checkpoint, `--config FILE`
//! starts from random weights, and neither trains the embedded default model. Without `--data`
//! the embedded corpus (a seeded probabilistic grammar, byte-level tokenizer) is generated into
//! `<output-dir>/data`, so a first run needs no download.

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::{Args, ValueEnum};
use tilearn_engine::EngineError;
use tilearn_engine::config::{GenerationConfig, LlamaConfig};
use tilearn_engine::data::{TokenDataset, prepare_embedded_default};
use tilearn_engine::model::model_parallel::PipelineShard;
use tilearn_engine::model::tensor_parallel::TensorShard;
use tilearn_engine::params::{ParamSpec, ParamStore};
use tilearn_engine::trainer::checkpoint::latest_checkpoint;
use tilearn_engine::trainer::data_parallel::DEFAULT_BUCKET_CAP_MB;
use tilearn_engine::trainer::model_parallel::{
    ModelParallelComms, ModelParallelCpuBackend, ModelParallelLayout,
};
use tilearn_engine::trainer::{
    DataParallel, DdpOptions, EvalStrategy, ModelInit, ModelParallelPlace, ReportTo, SaveStrategy,
    TrainLength, Trainer, TrainingArguments, ZeroStage, adamw_for, host,
};
use tilearn_ops::DType;
use tilearn_parallel::pipeline::ScheduleKind;

use super::device::{DeviceChoice, choose_device};
use super::hybrid::{HybridGroups, HybridSizes};
use super::topology::BindCores;
use super::train_ranks::{DdpBackend, Quiet, Ranks};
use crate::{LlmError, Result};

/// Documents generated for the embedded corpus (about 1.5 M byte tokens).
const EMBEDDED_DOCUMENTS: usize = 20_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum EvalStrategyChoice {
    No,
    Steps,
    Epoch,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ReportToChoice {
    /// The JSON-lines log only.
    None,
    /// Also TensorBoard event files (in --logging-dir).
    Tensorboard,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SaveStrategyChoice {
    No,
    Steps,
}

use tilearn_engine::cuda_graphs::{CudaGraphs, DEFAULT_CUDA_GRAPHS};
use tilearn_engine::lce_chunk::LceChunk;
use tilearn_engine::memory_mode::MemoryMode;
use tilearn_engine::offload_checkpoints::OffloadCheckpoints;
use tilearn_engine::weight_copy::WeightCopy;

fn parse_dtype(name: &str) -> std::result::Result<DType, String> {
    DType::parse(name).ok_or_else(|| format!("`{name}` is not a dtype; use bf16, fp16 or f32"))
}

#[derive(Debug, Args)]
pub struct TrainArgs {
    /// Hugging Face checkpoint directory to fine-tune (config.json + *.safetensors).
    #[arg(long, conflicts_with = "config")]
    pub model: Option<PathBuf>,
    /// Hugging Face config.json to train from random weights.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Token shards made by `tilearn prepare-data` (default: the embedded corpus).
    #[arg(long)]
    pub data: Option<PathBuf>,
    #[arg(long, default_value = "runs/tilearn")]
    pub output_dir: PathBuf,
    /// Total optimizer steps; overrides --num-train-epochs.
    #[arg(long)]
    pub max_steps: Option<u64>,
    #[arg(long)]
    pub num_train_epochs: Option<f64>,
    #[arg(long)]
    pub per_device_train_batch_size: Option<usize>,
    #[arg(long, default_value_t = 1)]
    pub gradient_accumulation_steps: usize,
    /// Peak learning rate (default: 5e-5 when fine-tuning, 3e-3 from scratch).
    #[arg(long)]
    pub learning_rate: Option<f32>,
    /// linear, cosine, constant, constant_with_warmup, cosine_with_restarts, polynomial,
    /// inverse_sqrt, warmup_stable_decay (default: linear when fine-tuning, cosine from scratch).
    #[arg(long)]
    pub lr_scheduler_type: Option<String>,
    #[arg(long)]
    pub warmup_steps: Option<u64>,
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f32,
    #[arg(long, default_value_t = 0.9)]
    pub adam_beta1: f32,
    #[arg(long, default_value_t = 0.999)]
    pub adam_beta2: f32,
    #[arg(long, default_value_t = 1e-8)]
    pub adam_epsilon: f32,
    /// Clip the global gradient norm (0 disables).
    #[arg(long, default_value_t = 1.0)]
    pub max_grad_norm: f64,
    /// Tokens per training sequence (default: 1024 when fine-tuning, 128 from scratch; never
    /// above the model's max_position_embeddings).
    #[arg(long)]
    pub seq_len: Option<usize>,
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    #[arg(long, default_value_t = 10)]
    pub logging_steps: u64,
    /// Where each log record goes besides OUTPUT_DIR/train_log.jsonl: `tensorboard` also
    /// writes TensorBoard event files (train/loss, train/learning_rate, eval/loss, …).
    #[arg(long, value_enum, default_value_t = ReportToChoice::None)]
    pub report_to: ReportToChoice,
    /// Directory of the TensorBoard event files (default: OUTPUT_DIR/runs/<time>_<host>, a
    /// new run per start, as Hugging Face's Trainer names it).
    #[arg(long)]
    pub logging_dir: Option<PathBuf>,
    /// `steps`: a checkpoint every --save-steps optimizer steps and after the last step (as
    /// Hugging Face's Trainer); `no`: no checkpoints. The final model is written either way.
    #[arg(long, value_enum, default_value_t = SaveStrategyChoice::Steps)]
    pub save_strategy: SaveStrategyChoice,
    /// Save a checkpoint every N optimizer steps and after the last (0: no checkpoints).
    #[arg(long, default_value_t = 100)]
    pub save_steps: u64,
    /// Checkpoints hold only the model (in --save-dtype), no optimizer state: much smaller,
    /// but training cannot resume from them.
    #[arg(long)]
    pub save_only_model: bool,
    /// Do not end the run with the few greedy samples generated from the saved model (the
    /// first tokens of two training documents continued; on the GPU when training ran there).
    #[arg(long)]
    pub no_samples: bool,
    /// dtype of the final model files: bf16, fp16 or f32 (default: the config's dtype /
    /// torch_dtype, else f32). Resumable checkpoints always hold f32 weights.
    #[arg(long, value_parser = parse_dtype)]
    pub save_dtype: Option<DType>,
    /// Keep at most N checkpoints, deleting the oldest once a newer one is complete.
    #[arg(long)]
    pub save_total_limit: Option<usize>,
    /// Remember the checkpoint with the best --metric-for-best-model (never deleted by
    /// --save-total-limit) and save its weights as the final model. Needs evaluation and
    /// --save-steps a multiple of --eval-steps.
    #[arg(long)]
    pub load_best_model_at_end: bool,
    /// The metric that picks the best checkpoint: eval_loss (default) or eval_perplexity.
    #[arg(long, value_name = "NAME")]
    pub metric_for_best_model: Option<String>,
    /// Token shards made by `tilearn prepare-data` (same tokenizer as --data) to evaluate on:
    /// the mean token loss and perplexity, with the forward only, logged as `eval_loss`.
    #[arg(long, conflicts_with = "validation_split_percentage")]
    pub eval_data: Option<PathBuf>,
    /// Hold out the last P% of the training data's windows from training and evaluate on them
    /// (instead of --eval-data).
    #[arg(long)]
    pub validation_split_percentage: Option<f64>,
    /// `steps`: evaluate every --eval-steps and after the last step; `epoch`: after every
    /// epoch and the last step; `no`: never (default: steps with --eval-data or
    /// --validation-split-percentage, else no).
    #[arg(long, value_enum)]
    pub eval_strategy: Option<EvalStrategyChoice>,
    /// Evaluate every N optimizer steps (default: --logging-steps).
    #[arg(long)]
    pub eval_steps: Option<u64>,
    /// Eval windows per batch on each device (default: the train batch size, the most the
    /// activation memory holds).
    #[arg(long)]
    pub per_device_eval_batch_size: Option<usize>,
    /// Evaluate only the first N batches of the eval set per device (default: all of it).
    #[arg(long)]
    pub max_eval_batches: Option<u64>,
    /// Recompute each block's forward in its backward to save activation memory.
    #[arg(long)]
    pub gradient_checkpointing: bool,
    /// Tokens per chunk of the GPU engine's fused linear + cross entropy: the lm_head product,
    /// the loss and its gradient run chunk by chunk, so only one chunk's [tokens × vocab]
    /// logits exist. `auto` (default): the largest power of two of tokens whose logits fit in
    /// 128 MiB; `0`: no chunking (all logits at once); N: at most N tokens.
    #[arg(long, default_value = "auto", value_parser = LceChunk::parse)]
    pub lce_chunk_tokens: LceChunk,
    /// Where the GPU engine keeps the optimizer state: `default` (fp32 master weights, AdamW
    /// moments, bf16 weights and fp32 gradients on the GPU, 18 bytes a parameter) or `lean`
    /// (master weights and moments in host memory, stepped on the CPU, as ZeRO-Offload: 6
    /// bytes a parameter on the GPU, and the MLP activation recomputed in the backward).
    /// Lean runs bf16 in one process, without CUDA graphs; each step waits for the host AdamW.
    #[arg(long, default_value = "default", value_parser = MemoryMode::parse)]
    pub memory: MemoryMode,
    /// How the GPU engine keeps the bf16/fp16 copy of the weights it computes with: `whole`
    /// (every weight, rewritten by the fused optimizer: 2 bytes a parameter), `per-layer`
    /// (each decoder layer cast from the fp32 master weights just before its forward and its
    /// backward: the same bits in about one layer's room, for two extra reads of the weights
    /// a step) or `auto` (default: per layer under --gradient-checkpointing, whole
    /// otherwise). Not with --memory lean or ZeRO, whose GPU holds no whole master weights.
    #[arg(long, default_value = "auto", value_parser = WeightCopy::parse)]
    pub weight_copy: WeightCopy,
    /// Where gradient checkpointing's layer inputs (and each layer's attention output) live:
    /// `on` (page-locked host memory: `(layers + 1) × batch × seq × hidden` elements plus the
    /// attention outputs, 2.8 GiB at TinyLlama's 16 K tokens; a second stream copies each one
    /// out after its layer's forward and back one layer ahead in the backward, and the
    /// recomputation skips the attention forward; steps run eagerly, no CUDA graphs; not with
    /// --pp-size > 1), `off` (on the GPU), or `auto` (default: on for sequences of 16 K tokens
    /// or more under --gradient-checkpointing when half the host's available memory, shared
    /// among this host's ranks, holds it). A bare `--offload-checkpoints` means `on`.
    #[arg(long, default_value = "auto", num_args = 0..=1, default_missing_value = "on",
          value_parser = OffloadCheckpoints::parse)]
    pub offload_checkpoints: OffloadCheckpoints,
    /// Replay each GPU training step as one CUDA graph, captured once (zeroing, forward,
    /// backward, clipping and AdamW; token ids, the loss factor and the learning rate reach it
    /// through device buffers): `on` (refuse steps that cannot be captured), `off`, or `auto`
    /// (capture where the step is static; gradient accumulation, fp16 loss scaling, packed
    /// rows and several processes run eagerly, with the reason logged once).
    #[arg(long, default_value_t = DEFAULT_CUDA_GRAPHS, value_parser = CudaGraphs::parse)]
    pub cuda_graphs: CudaGraphs,
    /// Make GPU steps bit-reproducible from run to run: the flash attention backward runs its
    /// two kernels without atomics. Off (default): on Hopper it runs one kernel that sums dQ
    /// with f32 atomic adds, faster, with differences at the level of f32 rounding between
    /// runs.
    #[arg(long)]
    pub deterministic: bool,
    /// A `checkpoint-N` directory of an earlier run with the same flags.
    #[arg(long)]
    pub resume_from_checkpoint: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
    /// Compute in fp16 with the GradScaler (alone: every step; with --amp-policy: the mixed
    /// precision the policy switches to).
    #[arg(long)]
    pub fp16: bool,
    /// Compute in bf16 (no loss scaling needed).
    #[arg(long)]
    pub bf16: bool,
    /// Compute in fp32 (the default on the CPU; the GPU defaults to bf16).
    #[arg(long)]
    pub fp32: bool,
    /// Same as --fp32: turn off the GPU's default bf16 mixed precision.
    #[arg(long)]
    pub no_bf16: bool,
    /// Adaptive mixed precision: 0 time-based, 1 time + learning rate, 2 loss-based, auto
    /// (fp16 with fallback on recurring overflows or a collapsed loss scale).
    #[arg(long)]
    pub amp_policy: Option<adaptfp16::PolicyId>,
    /// First period in mixed precision (policies 0 and 1; default 10).
    #[arg(long)]
    pub amp_start: Option<u64>,
    /// Last period in mixed precision (policies 0 and 1).
    #[arg(long)]
    pub amp_end: Option<u64>,
    /// How long one decision is held (policy 1; auto's fallback period).
    #[arg(long)]
    pub amp_hold: Option<u64>,
    /// Policy 2 is switched on every this many periods (default 1000).
    #[arg(long)]
    pub amp_interval: Option<u64>,
    /// Policy 2 stays on this long in each interval (default 100).
    #[arg(long)]
    pub amp_interval_hold: Option<u64>,
    /// Whether policy periods count optimizer steps or epochs.
    #[arg(long)]
    pub amp_unit: Option<adaptfp16::TimeUnit>,
    /// What auto falls back to: bf16 or fp32.
    #[arg(long)]
    pub amp_fallback: Option<tilearn_ops::DType>,
    /// Fault injection for testing the fp16 overflow path: make every gradient infinite at
    /// these optimizer steps (1-based, comma-separated).
    #[arg(long, value_delimiter = ',', hide = true)]
    pub debug_inject_overflow: Vec<u64>,
    /// Fault injection for testing failed saves: the checkpoints after these optimizer steps
    /// fail with a simulated "no space left on device" (1-based, comma-separated).
    #[arg(long, value_delimiter = ',', hide = true)]
    pub debug_fail_checkpoint_write: Vec<u64>,
    /// Fault injection for testing restarts: fail after this optimizer step (and its
    /// checkpoint), in the first attempt of a launched job only (or always, run alone).
    #[arg(long, hide = true)]
    pub debug_fail_after_step: Option<u64>,
    /// Pin this rank's threads near its GPU (LOCAL_RANK / LOCAL_WORLD_SIZE /
    /// CUDA_VISIBLE_DEVICES say which GPU); TILEARN_AFFINITY=off overrides. See `tilearn info
    /// --topology` for the plan.
    #[arg(long, value_enum, default_value_t = BindCores::Auto)]
    pub bind_cores: BindCores,
    /// Data parallel (under `tilearn launch`, torchrun or srun): gradients are all-reduced in
    /// buckets of this many MiB (PyTorch DDP's bucket_cap_mb; the first bucket is 1 MiB).
    #[arg(long, default_value_t = DEFAULT_BUCKET_CAP_MB)]
    pub ddp_bucket_cap_mb: f64,
    /// The dtype gradients are all-reduced in: f32, or bf16 (half the traffic, summed in f32).
    #[arg(long, value_parser = parse_dtype, default_value = "f32")]
    pub ddp_comm_dtype: DType,
    /// Reduce the gradients only after the whole backward, instead of each layer's as soon as
    /// it is done (the GPU engine overlaps the all-reduce with the backward by default; the
    /// log's `allreduce_ms`/`allreduce_hidden` report how much of it was hidden).
    #[arg(long)]
    pub no_ddp_overlap: bool,
    /// What carries device buffers between ranks (the gradients, and the activations and
    /// partial sums of --tp-size/--pp-size): nccl or host (TCP through page-locked memory; the
    /// CPU's). Default on the GPU: nccl unless two ranks run on one GPU (compared by
    /// UUID), else host.
    #[arg(long, value_enum)]
    pub ddp_backend: Option<DdpBackend>,
    /// ZeRO: 1 shards the optimizer state (and the master weights it steps) across the ranks,
    /// 2 also the gradients; 0 is plain data parallel. Default: TILEARN_HYBRID_ZERO_STAGE, else 0.
    #[arg(long)]
    pub zero_stage: Option<String>,
    /// Tensor parallelism: split every layer's matrices, the embedding and the loss over this
    /// many consecutive ranks (Megatron-style; with --pp-size and data parallelism around
    /// either on both engines). Default: TILEARN_HYBRID_TP_SIZE, else 1. Data parallelism spans the launched ranks / tp.
    #[arg(long)]
    pub tp_size: Option<usize>,
    /// Megatron's sequence parallelism with --tp-size: the norms and the residual stream hold
    /// each rank's chunk of the tokens, all-gathered before the column-parallel projections and
    /// reduce-scattered after the row-parallel ones (instead of all-reduced). Needs batch ×
    /// --seq-len divisible by the tensor-parallel size.
    #[arg(long)]
    pub sequence_parallel: bool,
    /// Pipeline parallelism: split the layers into this many stages balanced by compute (on
    /// the GPU engine with 1f1b or gpipe and untied embeddings; with --tp-size and data
    /// parallelism around it on both engines); the micro-batches of a step are
    /// --gradient-accumulation-steps. Default: TILEARN_HYBRID_PP_SIZE, else 1.
    #[arg(long)]
    pub pp_size: Option<usize>,
    /// The pipeline schedule: 1f1b (default), gpipe, or interleaved (with --virtual-stages).
    #[arg(long, value_enum, default_value_t = PipelineSchedule::OneFOneB)]
    pub pp_schedule: PipelineSchedule,
    /// Model chunks per pipeline stage for --pp-schedule interleaved (Megatron's virtual
    /// stages; micro-batches must be a multiple of --pp-size).
    #[arg(long, default_value_t = 2)]
    pub virtual_stages: usize,
    /// Layers of each pipeline chunk in model order, e.g. 9,8,8,7 (default: balanced by
    /// compute, lm_head and the loss counted on the last).
    #[arg(long, value_delimiter = ',')]
    pub pp_layers: Option<Vec<usize>>,
}

/// `--pp-schedule`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PipelineSchedule {
    #[value(name = "1f1b")]
    OneFOneB,
    Gpipe,
    Interleaved,
}

impl PipelineSchedule {
    pub(crate) fn kind(self, virtual_stages: usize) -> ScheduleKind {
        match self {
            PipelineSchedule::OneFOneB => ScheduleKind::OneFOneB,
            PipelineSchedule::Gpipe => ScheduleKind::GPipe,
            PipelineSchedule::Interleaved => ScheduleKind::Interleaved { virtual_stages },
        }
    }
}

/// Defaults that differ between fine-tuning (Hugging Face's) and training from scratch (a recipe
/// that makes a small random model learn quickly).
struct Recipe {
    learning_rate: f32,
    scheduler: &'static str,
    warmup_steps: u64,
    batch: usize,
    seq_len: usize,
    length: TrainLength,
}

const FINE_TUNE: Recipe = Recipe {
    learning_rate: 5e-5,
    scheduler: "linear",
    warmup_steps: 0,
    batch: 8,
    seq_len: 1024,
    length: TrainLength::Epochs(3.0),
};

const FROM_SCRATCH: Recipe = Recipe {
    learning_rate: 3e-3,
    scheduler: "cosine",
    warmup_steps: 20,
    batch: 16,
    seq_len: 128,
    length: TrainLength::MaxSteps(300),
};

pub fn run(args: TrainArgs) -> Result<()> {
    let started = Instant::now();
    match Ranks::join()? {
        None => run_rank(args, None, started),
        Some(ranks) => run_rank(args, Some(&ranks), started).map_err(|e| ranks.report(e)),
    }
}

/// One run, alone or as one rank of a launched job.
fn run_rank(args: TrainArgs, ranks: Option<&Ranks>, started: Instant) -> Result<()> {
    let primary = ranks.is_none_or(Ranks::is_primary);
    // `tilearn launch --max-restarts`: a restarted group continues from the newest checkpoint.
    let restart = ranks.map_or(0, |r| r.group.env().restart);
    let resume = match &args.resume_from_checkpoint {
        Some(dir) => Some(dir.clone()),
        None if restart > 0 => latest_checkpoint(&args.output_dir),
        None => None,
    };
    if restart > 0 && primary {
        match &resume {
            Some(dir) => println!("restart {restart}: resuming from {}", dir.display()),
            None => println!("restart {restart}: no checkpoint yet, starting over"),
        }
    }
    if args.logging_dir.is_some() && args.report_to == ReportToChoice::None {
        return Err(LlmError::Usage {
            flag: "--logging-dir".into(),
            message: "only TensorBoard event files go there; add --report-to tensorboard".into(),
        });
    }
    let ddp = DdpOptions {
        bucket_cap_mb: args.ddp_bucket_cap_mb,
        comm_dtype: args.ddp_comm_dtype,
        zero_stage: ZeroStage::from_flag_or_env(args.zero_stage.as_deref())?,
        overlap: !args.no_ddp_overlap,
    };
    ddp.validate()?;
    let trains_on_gpu = choose_device(args.device)?;
    if args.memory.is_lean() {
        if !trains_on_gpu {
            return Err(LlmError::Usage {
                flag: "--memory lean".into(),
                message: "keeps the GPU's optimizer state in host memory; the CPU engine has \
                          it there already: use --device cuda, or drop the flag"
                    .into(),
            });
        }
        let processes = ranks.map_or(1, |r| r.group.world_size());
        args.memory
            .check(&[tilearn_ops::DType::BF16], processes)
            .map_err(LlmError::from)?;
    }
    args.weight_copy
        .check(args.memory.is_lean(), ddp.zero_stage.number())
        .map_err(LlmError::from)?;
    if args.offload_checkpoints == OffloadCheckpoints::On {
        let why = if !trains_on_gpu {
            Some("offloads the GPU engine's checkpoints to host memory; use --device cuda")
        } else if !args.gradient_checkpointing {
            Some(
                "offloads the layer inputs gradient checkpointing keeps; add --gradient-checkpointing",
            )
        } else {
            None
        };
        if let Some(why) = why {
            return Err(LlmError::Usage {
                flag: "--offload-checkpoints".into(),
                message: why.into(),
            });
        }
    }
    let hybrid = hybrid_sizes(&args, ranks, trains_on_gpu)?;
    let amp = amp_plan(&args, trains_on_gpu)?;
    // Before anything spawns threads (rayon's pool, the loader): they inherit the main thread's
    // CPU mask.
    let loader_hook = super::topology::bind_this_rank(args.bind_cores.resolve(trains_on_gpu));
    let (config, init, recipe) = model_start(&args)?;
    let dataset = match ranks {
        // Rank 0 may generate the embedded corpus; the others open it after.
        Some(ranks) => ranks.rank0_first(|| open_dataset(&args, primary))?,
        None => open_dataset(&args, true)?,
    };
    let eval_dataset = args
        .eval_data
        .as_deref()
        .map(open_eval_dataset)
        .transpose()?;
    let length = match (args.max_steps, args.num_train_epochs) {
        (Some(steps), _) => TrainLength::MaxSteps(steps),
        (None, Some(epochs)) => TrainLength::Epochs(epochs),
        (None, None) if args.data.is_some() => TrainLength::Epochs(3.0),
        (None, None) => recipe.length,
    };
    let seq_len = args
        .seq_len
        .unwrap_or(recipe.seq_len.min(config.max_position_embeddings));
    if primary {
        // Fine-tuning examples are one row each; say how many the sequence length cuts.
        for set in std::iter::once(&dataset).chain(&eval_dataset) {
            if let Some(warning) = set
                .truncation(seq_len)
                .and_then(|t| t.warning(set.dir(), seq_len))
            {
                eprintln!("{warning}");
            }
        }
    }
    let training = TrainingArguments {
        output_dir: args.output_dir.clone(),
        length,
        per_device_train_batch_size: args.per_device_train_batch_size.unwrap_or(recipe.batch),
        gradient_accumulation_steps: args.gradient_accumulation_steps,
        learning_rate: args.learning_rate.unwrap_or(recipe.learning_rate),
        lr_scheduler_type: args
            .lr_scheduler_type
            .clone()
            .unwrap_or_else(|| recipe.scheduler.into()),
        warmup_steps: args.warmup_steps.unwrap_or(recipe.warmup_steps),
        weight_decay: args.weight_decay,
        adam_beta1: args.adam_beta1,
        adam_beta2: args.adam_beta2,
        adam_epsilon: args.adam_epsilon,
        max_grad_norm: args.max_grad_norm,
        seq_len,
        seed: args.seed,
        logging_steps: args.logging_steps,
        report_to: match args.report_to {
            ReportToChoice::None => ReportTo::None,
            ReportToChoice::Tensorboard => ReportTo::TensorBoard,
        },
        logging_dir: args.logging_dir.clone(),
        save_strategy: match args.save_strategy {
            SaveStrategyChoice::No => SaveStrategy::No,
            SaveStrategyChoice::Steps => SaveStrategy::Steps,
        },
        save_steps: args.save_steps,
        save_only_model: args.save_only_model,
        save_dtype: args.save_dtype,
        save_total_limit: args.save_total_limit,
        load_best_model_at_end: args.load_best_model_at_end,
        metric_for_best_model: args.metric_for_best_model.clone(),
        gradient_checkpointing: args.gradient_checkpointing,
        lce_chunk: args.lce_chunk_tokens,
        cuda_graphs: args.cuda_graphs,
        deterministic: args.deterministic,
        memory: args.memory,
        weight_copy: args.weight_copy,
        offload_checkpoints: args.offload_checkpoints,
        eval_strategy: match args.eval_strategy {
            Some(EvalStrategyChoice::No) => EvalStrategy::No,
            Some(EvalStrategyChoice::Steps) => EvalStrategy::Steps,
            Some(EvalStrategyChoice::Epoch) => EvalStrategy::Epoch,
            None if args.eval_data.is_some() || args.validation_split_percentage.is_some() => {
                EvalStrategy::Steps
            }
            None => EvalStrategy::No,
        },
        eval_steps: args.eval_steps,
        per_device_eval_batch_size: args.per_device_eval_batch_size,
        max_eval_batches: args.max_eval_batches,
        validation_split_percentage: args.validation_split_percentage,
        progress_bar: true,
        debug_inject_overflow: args.debug_inject_overflow.clone(),
        debug_fail_checkpoint_write: args.debug_fail_checkpoint_write.clone(),
        debug_fail_after_step: args.debug_fail_after_step.filter(|_| restart == 0),
    };
    let params: usize = ParamStore::specs_for(&config)
        .iter()
        .map(ParamSpec::numel)
        .sum();
    let (mut trainer, gradients) = if let (true, Some(sizes), Some(ranks)) = (
        trains_on_gpu,
        hybrid.filter(HybridSizes::splits_model),
        ranks,
    ) {
        let (trainer, backend) = if sizes.pp > 1 {
            let pipe = match &args.pp_layers {
                Some(counts) => {
                    PipelineShard::with_layer_counts(&config, sizes.pp_rank, sizes.pp, 1, counts)?
                }
                None => {
                    PipelineShard::balanced(&config, sizes.pp_rank, sizes.pp, 1, training.seq_len)?
                }
            };
            let schedule = args.pp_schedule.kind(1);
            gpu_pipeline_parallel_trainer(
                training,
                &config,
                &init,
                (dataset, &amp, ddp),
                (&sizes, ranks, pipe, schedule),
                args.ddp_backend,
            )?
        } else {
            gpu_tensor_parallel_trainer(
                training,
                &config,
                &init,
                (dataset, &amp, ddp),
                (&sizes, ranks),
                args.ddp_backend,
            )?
        };
        if primary {
            println!("{}; device buffers over {backend}", sizes.describe());
        }
        (trainer, None)
    } else if trains_on_gpu {
        gpu_trainer(
            training,
            &config,
            &init,
            dataset,
            &amp,
            ranks,
            args.ddp_backend,
        )?
    } else if let (Some(sizes), Some(ranks)) = (hybrid.filter(HybridSizes::splits_model), ranks) {
        let groups = HybridGroups::new(&sizes, ranks.host.as_ref())?;
        let schedule = args.pp_schedule.kind(args.virtual_stages);
        let chunks = match schedule {
            ScheduleKind::Interleaved { virtual_stages } => virtual_stages,
            _ => 1,
        };
        let layout = ModelParallelLayout {
            tp: TensorShard {
                rank: sizes.tp_rank,
                size: sizes.tp,
            },
            pipe: match &args.pp_layers {
                Some(counts) => PipelineShard::with_layer_counts(
                    &config,
                    sizes.pp_rank,
                    sizes.pp,
                    chunks,
                    counts,
                )?,
                None => PipelineShard::balanced(
                    &config,
                    sizes.pp_rank,
                    sizes.pp,
                    chunks,
                    training.seq_len,
                )?,
            },
            schedule,
            sequence_parallel: args.sequence_parallel,
        };
        let comms = ModelParallelComms {
            tp: groups.tp,
            pp: groups.pp,
            replica: groups.replica,
        };
        let shape = (training.per_device_train_batch_size, training.seq_len);
        let recompute = training.gradient_checkpointing;
        let full = init.build_host(config.clone())?;
        let backend = ModelParallelCpuBackend::new(
            &full,
            layout,
            comms,
            |local| adamw_for(&training, local),
            shape,
            recompute,
        )?;
        drop(full);
        let mut trainer =
            Trainer::with_backend(training, config.clone(), Box::new(backend), dataset)?;
        trainer.set_model_parallel(ModelParallelPlace {
            rank: sizes.tp_rank + sizes.tp * sizes.pp_rank,
            tp: sizes.tp,
            pp: sizes.pp,
            world: ranks.host.clone(),
        })?;
        if let Some(dp) = groups.dp {
            let local = trainer.local_parameter_count();
            trainer.set_data_parallel(DataParallel::new(dp.clone(), dp, ddp, local)?)?;
        }
        if primary {
            let sp = if args.sequence_parallel {
                " with sequence parallelism"
            } else {
                ""
            };
            println!("{}{sp}", sizes.describe());
        }
        (trainer, None)
    } else {
        let trainer = Trainer::new(training, init.build_host(config.clone())?, dataset)?;
        let gradients = ranks
            .map(|r| r.cpu_gradient_communicator(args.ddp_backend))
            .transpose()?;
        (trainer, gradients)
    };
    if let (Some(ranks), Some(gradients)) = (ranks, gradients) {
        trainer.set_data_parallel(ranks.data_parallel(gradients, ddp, params)?)?;
        println!("{}", trainer.model_state_report());
    }
    if let Some(eval) = eval_dataset {
        trainer.set_eval_dataset(eval)?;
    }
    trainer.set_start_time(started);
    if primary {
        if ranks.is_some() {
            println!("{}", trainer.data_parallel().describe());
        }
        print_model_line(&config, params, &trainer);
    }
    trainer.set_amp_plan(amp);
    if let Some(hook) = loader_hook {
        trainer.set_loader_hook(hook);
    }
    let mut sink = if primary {
        super::progress::sink()
    } else {
        Box::new(Quiet)
    };
    let summary = trainer.train(resume.as_deref(), sink.as_mut())?;
    // The samples below load the saved model afresh; free the trainer's (device) memory first.
    drop(trainer);
    if primary {
        if let Some(model_dir) = &args.model {
            let copied = super::tokenizer_files::copy_tokenizer_files(model_dir, &args.output_dir)?;
            if !copied.is_empty() {
                println!(
                    "copied the tokenizer files of {} beside the model ({})",
                    model_dir.display(),
                    copied.join(", ")
                );
            }
        }
        print_summary(&summary);
        super::plot::plot_after_training(&args.output_dir);
        if !args.no_samples {
            let data = args
                .data
                .clone()
                .unwrap_or_else(|| args.output_dir.join("data"));
            super::train_samples::print_after_training(&summary.output_dir, &data, trains_on_gpu);
        }
    }
    Ok(())
}

/// The 3D layout of a launched run (`None` alone); tensor parallelism needs a launcher and the
/// CPU engine.
fn hybrid_sizes(
    args: &TrainArgs,
    ranks: Option<&Ranks>,
    trains_on_gpu: bool,
) -> Result<Option<HybridSizes>> {
    let Some(ranks) = ranks else {
        // A plain run is one rank: any size above 1 needs `tilearn launch`.
        let alone = HybridSizes::new(args.tp_size, args.pp_size, 0, 1)?;
        debug_assert_eq!(alone.tp, 1);
        if args.sequence_parallel {
            return Err(sequence_parallel_needs_tp());
        }
        return Ok(None);
    };
    let sizes = HybridSizes::new(
        args.tp_size,
        args.pp_size,
        ranks.group.rank(),
        ranks.group.world_size(),
    )?;
    if args.sequence_parallel && sizes.tp < 2 {
        return Err(sequence_parallel_needs_tp());
    }
    if sizes.splits_model() && trains_on_gpu {
        gpu_split_supported(&sizes, args.sequence_parallel, args.pp_schedule)?;
    }
    Ok(Some(sizes))
}

/// What the GPU engine's model parallelism runs so far (the rest runs on the CPU engine):
/// tensor parallelism, pipeline parallelism (1F1B or GPipe) and both together, with data
/// parallelism around them or not; not sequence parallelism or interleaving.
fn gpu_split_supported(
    sizes: &HybridSizes,
    sequence_parallel: bool,
    schedule: PipelineSchedule,
) -> Result<()> {
    let refuse = |flag: &str, what: &str| {
        Err(LlmError::Usage {
            flag: flag.into(),
            message: format!(
                "{what} runs on the CPU engine only so far (the GPU engine splits a model by \
                 tensor and pipeline parallelism, with the 1F1B or GPipe schedule and without \
                 sequence parallelism); add --device cpu, or drop the flag"
            ),
        })
    };
    if sizes.pp > 1 && schedule == PipelineSchedule::Interleaved {
        return refuse("--pp-schedule", "the interleaved schedule");
    }
    if sequence_parallel {
        return refuse("--sequence-parallel", "sequence parallelism");
    }
    Ok(())
}

fn sequence_parallel_needs_tp() -> LlmError {
    LlmError::Usage {
        flag: "--sequence-parallel".into(),
        message: "splits the tokens between tensor-parallel products, so it needs --tp-size 2 \
                  or more (under tilearn launch); drop the flag or raise --tp-size"
            .into(),
    }
}

fn print_model_line(config: &LlamaConfig, params: usize, trainer: &Trainer) {
    let training = &trainer.args;
    println!(
        "model: {} parameters, {} layers, hidden {}; device {}; batch {}×{} tokens × {} accumulation; output {}",
        params,
        config.num_hidden_layers,
        config.hidden_size,
        trainer.backend_description(),
        training.per_device_train_batch_size,
        training.seq_len,
        training.gradient_accumulation_steps,
        training.output_dir.display()
    );
}

fn print_summary(summary: &tilearn_engine::trainer::TrainSummary) {
    println!(
        "done: {} steps ({} skipped by the loss scaler), loss {:.4} -> {:.4}, {:.3} s/step, {:.0} tokens/s, peak memory {:.2} GiB, host peak RSS {}, first step after {}, final save {:.1} s; model saved to {}",
        summary.steps,
        summary.skipped_steps,
        summary.first_loss,
        summary.final_loss,
        summary.mean_step_seconds,
        summary.tokens_per_sec,
        host::gib(summary.peak_memory_bytes),
        summary
            .host_peak_rss_bytes
            .map_or("unknown".into(), |b| format!("{:.2} GiB", host::gib(b))),
        summary
            .time_to_first_step
            .map_or("no step".into(), |t| format!("{t:.1} s")),
        summary.final_save_seconds,
        summary.output_dir.display()
    );
}

/// The gradients' communicator of a data-parallel run (`None` alone).
type GradientComm = Option<std::sync::Arc<dyn tilearn_parallel::Communicator>>;

/// A Trainer on the GPU whose weights are streamed from `init` into device memory (no host
/// copy of the model), and, in a launched job, the communicator for its gradients.
#[cfg(feature = "cuda")]
fn gpu_trainer(
    training: TrainingArguments,
    config: &LlamaConfig,
    init: &ModelInit,
    dataset: TokenDataset,
    amp: &adaptfp16::AmpPlan,
    ranks: Option<&Ranks>,
    ddp_backend: Option<DdpBackend>,
) -> Result<(Trainer, GradientComm)> {
    use tilearn_engine::trainer::gpu_backend::GpuBackend;
    // Built for every precision the plan may choose, so periods switch without rebuilding.
    let precisions = amp.possible_precisions();
    let backend = GpuBackend::from_init(
        config,
        init,
        &training,
        super::device::local_gpu(),
        &precisions,
    )?;
    let gradients = ranks
        .map(|r| r.gpu_gradient_communicator(ddp_backend, backend.stream()))
        .transpose()?;
    let trainer = Trainer::with_backend(training, config.clone(), Box::new(backend), dataset)?;
    Ok((trainer, gradients))
}

/// A Trainer for one tensor-parallel rank on the GPU engine (see
/// `tilearn_engine::trainer::gpu_backend::tensor_parallel`); its group's collectives on device
/// buffers go over NCCL, or through the host communicator staged on a stream of the rank's GPU
/// (`backend`, see [`Ranks::gpu_model_parallel_world`]).
#[cfg(feature = "cuda")]
fn gpu_tensor_parallel_trainer(
    training: TrainingArguments,
    config: &LlamaConfig,
    init: &ModelInit,
    (dataset, amp, ddp): (TokenDataset, &adaptfp16::AmpPlan, DdpOptions),
    (sizes, ranks): (&HybridSizes, &Ranks),
    backend: Option<DdpBackend>,
) -> Result<(Trainer, &'static str)> {
    use tilearn_engine::trainer::gpu_backend::tensor_parallel::GpuTensorParallelBackend;
    let ordinal = super::device::local_gpu();
    let staging = tilearn_ops::cuda::GpuDevice::new(ordinal)?;
    let world = ranks.gpu_model_parallel_world(backend, staging.stream().clone())?;
    let groups = HybridGroups::new(sizes, world.as_ref())?;
    let Some(tp) = groups.tp else {
        return Err(LlmError::Usage {
            flag: "--tp-size".into(),
            message: "internal: a split run without a tensor-parallel group".into(),
        });
    };
    let precisions = amp.possible_precisions();
    let shard = TensorShard {
        rank: sizes.tp_rank,
        size: sizes.tp,
    };
    let backend = GpuTensorParallelBackend::from_init(
        config,
        init,
        &training,
        (ordinal, &precisions),
        shard,
        tp,
    )?;
    let mut trainer = Trainer::with_backend(training, config.clone(), Box::new(backend), dataset)?;
    trainer.set_model_parallel(ModelParallelPlace {
        rank: sizes.tp_rank,
        tp: sizes.tp,
        pp: 1,
        // The job's communicator lives as long as the trainer (its groups were cut from it).
        world: world.clone(),
    })?;
    // Data parallelism around the split: each tp rank's gradients are summed with the same
    // tp rank's of the other replicas (after the backward, not overlapped with it).
    if let Some(dp) = groups.dp {
        let local = trainer.local_parameter_count();
        trainer.set_data_parallel(DataParallel::new(dp.clone(), dp, ddp, local)?)?;
    }
    Ok((trainer, world.backend()))
}

/// A Trainer for one pipeline stage on the GPU engine (see
/// `tilearn_engine::trainer::gpu_backend::pipeline_parallel`); its activations cross stages,
/// and with data parallelism around the pipeline its gradients are summed between the
/// replicas' same stages, over NCCL or through the host communicator staged on a stream of the
/// rank's GPU (`backend`, see [`Ranks::gpu_model_parallel_world`]).
#[cfg(feature = "cuda")]
fn gpu_pipeline_parallel_trainer(
    training: TrainingArguments,
    config: &LlamaConfig,
    init: &ModelInit,
    (dataset, amp, ddp): (TokenDataset, &adaptfp16::AmpPlan, DdpOptions),
    (sizes, ranks, pipe, schedule): (&HybridSizes, &Ranks, PipelineShard, ScheduleKind),
    backend: Option<DdpBackend>,
) -> Result<(Trainer, &'static str)> {
    use tilearn_engine::trainer::gpu_backend::pipeline_parallel::{
        GpuPipelineParallelBackend, TensorSplit,
    };
    let ordinal = super::device::local_gpu();
    let staging = tilearn_ops::cuda::GpuDevice::new(ordinal)?;
    let world = ranks.gpu_model_parallel_world(backend, staging.stream().clone())?;
    let groups = HybridGroups::new(sizes, world.as_ref())?;
    let internal = |message: &str| LlmError::Usage {
        flag: "--pp-size".into(),
        message: format!("internal: {message}"),
    };
    let Some(pp) = groups.pp else {
        return Err(internal("a pipelined run without a pipeline group"));
    };
    // Tensor parallelism inside each stage (`gpu_split_supported` decides whether it runs).
    let split = match (sizes.tp > 1, groups.tp, groups.replica) {
        (false, _, _) => None,
        (true, Some(tp), Some(replica)) => Some(TensorSplit {
            shard: TensorShard {
                rank: sizes.tp_rank,
                size: sizes.tp,
            },
            tp,
            replica,
        }),
        _ => {
            return Err(internal(
                "a split stage without its tensor or replica group",
            ));
        }
    };
    let precisions = amp.possible_precisions();
    let backend = GpuPipelineParallelBackend::with_tensor_split(
        config,
        init,
        &training,
        (ordinal, &precisions),
        (pipe, schedule),
        pp,
        split,
    )?;
    let mut trainer = Trainer::with_backend(training, config.clone(), Box::new(backend), dataset)?;
    trainer.set_model_parallel(ModelParallelPlace {
        rank: sizes.tp_rank + sizes.tp * sizes.pp_rank,
        tp: sizes.tp,
        pp: sizes.pp,
        // The job's communicator lives as long as the trainer (its groups were cut from it).
        world: world.clone(),
    })?;
    if let Some(dp) = groups.dp {
        let local = trainer.local_parameter_count();
        trainer.set_data_parallel(DataParallel::new(dp.clone(), dp, ddp, local)?)?;
    }
    Ok((trainer, world.backend()))
}

#[cfg(not(feature = "cuda"))]
fn gpu_pipeline_parallel_trainer(
    _training: TrainingArguments,
    _config: &LlamaConfig,
    _init: &ModelInit,
    _data: (TokenDataset, &adaptfp16::AmpPlan, DdpOptions),
    _split: (&HybridSizes, &Ranks, PipelineShard, ScheduleKind),
    _backend: Option<DdpBackend>,
) -> Result<(Trainer, &'static str)> {
    Err(LlmError::Usage {
        flag: "--device cuda".into(),
        message: "this build has no CUDA kernels; rebuild with --features cuda".into(),
    })
}

#[cfg(not(feature = "cuda"))]
fn gpu_tensor_parallel_trainer(
    _training: TrainingArguments,
    _config: &LlamaConfig,
    _init: &ModelInit,
    _data: (TokenDataset, &adaptfp16::AmpPlan, DdpOptions),
    _split: (&HybridSizes, &Ranks),
    _backend: Option<DdpBackend>,
) -> Result<(Trainer, &'static str)> {
    Err(LlmError::Usage {
        flag: "--device cuda".into(),
        message: "this build has no CUDA kernels; rebuild with --features cuda".into(),
    })
}

#[cfg(not(feature = "cuda"))]
fn gpu_trainer(
    _training: TrainingArguments,
    _config: &LlamaConfig,
    _init: &ModelInit,
    _dataset: TokenDataset,
    _amp: &adaptfp16::AmpPlan,
    _ranks: Option<&Ranks>,
    _ddp_backend: Option<DdpBackend>,
) -> Result<(Trainer, GradientComm)> {
    // choose_device only picks the GPU when the CUDA kernels are compiled in.
    Err(LlmError::Usage {
        flag: "--device cuda".into(),
        message: "this build has no CUDA kernels; rebuild with --features cuda".into(),
    })
}

/// The precision flags as a validated plan; errors name the flag.
fn amp_plan(args: &TrainArgs, on_gpu: bool) -> Result<adaptfp16::AmpPlan> {
    let any_flag = args.fp16 || args.bf16 || args.fp32 || args.no_bf16 || args.amp_policy.is_some();
    if on_gpu && !any_flag {
        // The GPU default: bf16 mixed precision with fp32 master weights.
        return Ok(adaptfp16::AmpPlan::Fixed(tilearn_ops::DType::BF16));
    }
    let flags = adaptfp16::cli::AmpArgs {
        fp16: args.fp16,
        bf16: args.bf16,
        fp32: args.fp32 || args.no_bf16,
        policy: args.amp_policy,
        start: args.amp_start,
        end: args.amp_end,
        hold: args.amp_hold,
        interval: args.amp_interval,
        interval_hold: args.amp_interval_hold,
        unit: args.amp_unit,
        fallback: args.amp_fallback,
    };
    adaptfp16::cli::plan_from_args(&flags).map_err(|e| LlmError::Usage {
        flag: "precision".into(),
        message: e.to_string(),
    })
}

/// The model's config, where its weights come from, and the matching recipe.
fn model_start(args: &TrainArgs) -> Result<(LlamaConfig, ModelInit, Recipe)> {
    if let Some(dir) = &args.model {
        let mut config = LlamaConfig::from_file(dir.join(tilearn_engine::checkpoint::CONFIG_FILE))?;
        // Saves of the fine-tuned model keep the source's generation defaults.
        config.generation = GenerationConfig::from_dir(dir)?;
        return Ok((config, ModelInit::Pretrained(dir.clone()), FINE_TUNE));
    }
    let config = match &args.config {
        Some(file) => LlamaConfig::from_file(file)?,
        None => LlamaConfig::from_json_str(
            crate::DEFAULT_CONFIG_JSON,
            Path::new("<embedded default config>"),
        )?,
    };
    Ok((config, ModelInit::Random { seed: args.seed }, FROM_SCRATCH))
}

/// The dataset of `--eval-data`; an error names the flag and the file.
fn open_eval_dataset(dir: &Path) -> Result<TokenDataset> {
    TokenDataset::open(dir).map_err(|e| {
        LlmError::Engine(EngineError::InvalidArgument {
            argument: "--eval-data".into(),
            // The dataset's own error names the file and how to make one.
            message: e.to_string(),
        })
    })
}

/// The dataset of `--data`, else the embedded corpus in `<output-dir>/data`, generated when
/// missing (and `may_generate`: in a launched job rank 0 generates it before the others open it).
fn open_dataset(args: &TrainArgs, may_generate: bool) -> Result<TokenDataset> {
    if let Some(dir) = &args.data {
        return Ok(TokenDataset::open(dir)?);
    }
    let dir = args.output_dir.join("data");
    if may_generate && TokenDataset::open(&dir).is_err() {
        println!(
            "data: generating the embedded grammar corpus into {}",
            dir.display()
        );
        prepare_embedded_default(&dir, args.seed, EMBEDDED_DOCUMENTS)?;
    }
    Ok(TokenDataset::open(&dir)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(tp: usize, pp: usize, world: usize, sp: bool, schedule: PipelineSchedule) -> String {
        let sizes = HybridSizes::new(Some(tp), Some(pp), 0, world).unwrap();
        match gpu_split_supported(&sizes, sp, schedule) {
            Err(LlmError::Usage { flag, message }) => format!("{flag}: {message}"),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    /// The advisor recommends only layouts the GPU engine runs (`plan::engine_support`, whose
    /// rules are written by hand): every layout whose split `tilearn train` refuses on the GPU
    /// is one the advisor marks as refused too, on 8 ranks, for every TP/PP/v and ZeRO stage.
    #[test]
    fn the_advisor_never_recommends_a_split_the_gpu_engine_refuses() {
        use tilearn_engine::plan::engine_support::gpu_engine_refusal;
        use tilearn_engine::plan::layout::{Layout, ShardStage};
        let config = LlamaConfig::from_json_str(
            r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 256,
                "intermediate_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
                "num_key_value_heads": 8, "vocab_size": 1000}"#,
            "consistency.json",
        )
        .unwrap();
        let mut checked = 0;
        for (tp, pp) in [
            (1, 1),
            (2, 1),
            (4, 1),
            (1, 2),
            (1, 4),
            (2, 2),
            (2, 4),
            (4, 2),
        ] {
            for v in [1, 2] {
                for zero in ShardStage::ALL {
                    let layout = Layout {
                        tp,
                        pp,
                        virtual_stages: v,
                        dp: 8 / (tp * pp),
                        zero,
                        micro_batch: 1,
                        micro_batches: 8,
                        checkpointing: false,
                        offload_checkpoints: false,
                    };
                    let schedule = if v > 1 {
                        PipelineSchedule::Interleaved
                    } else {
                        PipelineSchedule::OneFOneB
                    };
                    let sizes = HybridSizes::new(Some(tp), Some(pp), 0, 8).unwrap();
                    let train_refuses = sizes.splits_model()
                        && gpu_split_supported(&sizes, false, schedule).is_err();
                    if train_refuses {
                        assert!(
                            gpu_engine_refusal(&config, &layout).is_some(),
                            "the advisor would recommend {layout:?}, which train refuses"
                        );
                        checked += 1;
                    }
                }
            }
        }
        assert!(checked > 0);
    }

    #[test]
    fn the_gpu_engine_splits_by_tensor_and_pipeline_parallelism_with_data_parallelism() {
        let ok = |tp, pp, schedule| {
            let sizes = HybridSizes::new(Some(tp), Some(pp), 0, tp * pp).unwrap();
            gpu_split_supported(&sizes, false, schedule)
        };
        assert!(ok(2, 1, PipelineSchedule::OneFOneB).is_ok());
        assert!(ok(1, 2, PipelineSchedule::OneFOneB).is_ok());
        assert!(ok(1, 4, PipelineSchedule::Gpipe).is_ok());
        // Data parallelism around the pipeline (pp 2 × dp 2) and around the tensor split
        // (tp 2 × dp 2).
        let pp_dp = HybridSizes::new(Some(1), Some(2), 0, 4).unwrap();
        assert_eq!(pp_dp.dp, 2);
        assert!(gpu_split_supported(&pp_dp, false, PipelineSchedule::OneFOneB).is_ok());
        let tp_dp = HybridSizes::new(Some(2), Some(1), 0, 4).unwrap();
        assert_eq!(tp_dp.dp, 2);
        assert!(gpu_split_supported(&tp_dp, false, PipelineSchedule::OneFOneB).is_ok());
        // Both splits, with and without replicas around them.
        assert!(ok(2, 2, PipelineSchedule::OneFOneB).is_ok());
        assert!(ok(2, 2, PipelineSchedule::Gpipe).is_ok());
        let tp_pp_dp = HybridSizes::new(Some(2), Some(2), 0, 8).unwrap();
        assert_eq!(tp_pp_dp.dp, 2);
        assert!(gpu_split_supported(&tp_pp_dp, false, PipelineSchedule::OneFOneB).is_ok());

        let interleaved = refusal(1, 2, 2, false, PipelineSchedule::Interleaved);
        assert!(
            interleaved.starts_with("--pp-schedule") && interleaved.contains("--device cpu"),
            "{interleaved}"
        );
        let sp = refusal(2, 1, 2, true, PipelineSchedule::OneFOneB);
        assert!(sp.starts_with("--sequence-parallel"), "{sp}");
    }
}
