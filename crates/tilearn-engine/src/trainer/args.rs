//! Training arguments, named after Hugging Face `TrainingArguments` so users find what they know.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use tilearn_ops::DType;

use crate::cuda_graphs::CudaGraphs;
use crate::lce_chunk::LceChunk;
use crate::memory_mode::MemoryMode;
use crate::offload_checkpoints::OffloadCheckpoints;
use crate::weight_copy::WeightCopy;
use crate::{EngineError, Result};

/// When checkpoints are written (Hugging Face's `save_strategy`; `epoch` and `best` are not
/// supported).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SaveStrategy {
    /// No checkpoints; the final model is still written.
    No,
    /// Every `save_steps` optimizer steps and after the last step.
    Steps,
}

/// When the eval set is evaluated (Hugging Face's `eval_strategy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum EvalStrategy {
    /// No evaluation.
    #[default]
    No,
    /// Every `eval_steps` optimizer steps and after the last step.
    Steps,
    /// At the end of every epoch and after the last step.
    Epoch,
}

/// Where log records are reported besides `train_log.jsonl` (Hugging Face's `report_to`; its
/// default is `none` since transformers 5).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReportTo {
    /// The JSON-lines log only.
    #[default]
    None,
    /// Also TensorBoard event files in the logging dir.
    TensorBoard,
}

/// How long to train: a fixed number of optimizer steps, or whole epochs over the data.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum TrainLength {
    MaxSteps(u64),
    Epochs(f64),
}

/// Everything the Trainer needs besides the model and the data.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrainingArguments {
    pub output_dir: PathBuf,
    pub length: TrainLength,
    pub per_device_train_batch_size: usize,
    pub gradient_accumulation_steps: usize,
    pub learning_rate: f32,
    /// Hugging Face scheduler name: linear, cosine, constant, constant_with_warmup, …
    pub lr_scheduler_type: String,
    pub warmup_steps: u64,
    pub weight_decay: f32,
    pub adam_beta1: f32,
    pub adam_beta2: f32,
    pub adam_epsilon: f32,
    /// Clip the global gradient norm to this value; 0 disables clipping.
    pub max_grad_norm: f64,
    pub seq_len: usize,
    pub seed: u64,
    pub logging_steps: u64,
    /// Where log records are reported besides the JSON-lines log.
    #[serde(default)]
    pub report_to: ReportTo,
    /// The TensorBoard event files' directory; `None`: `<output_dir>/runs/<time>_<host>`
    /// (Hugging Face's default, see
    /// [`default_logging_dir`](super::tensorboard::default_logging_dir)).
    #[serde(default)]
    pub logging_dir: Option<PathBuf>,
    /// With [`SaveStrategy::Steps`], a checkpoint every this many optimizer steps and one after
    /// the last step (see [`TrainingArguments::saves_checkpoint_at`]); 0 writes none.
    pub save_strategy: SaveStrategy,
    pub save_steps: u64,
    /// Checkpoints hold only the model (in `save_dtype`): no optimizer, scheduler or scaler
    /// state, so they cannot be resumed (Hugging Face's `save_only_model`).
    #[serde(default)]
    pub save_only_model: bool,
    /// The dtype of the final model files (and of `save_only_model` checkpoints); `None`: the
    /// dtype of the model's config (`dtype`/`torch_dtype`), else f32 — what transformers
    /// saves for a model loaded with its default `dtype="auto"`. Resumable checkpoints always
    /// hold the f32 master weights.
    #[serde(default, with = "hf_dtype")]
    pub save_dtype: Option<DType>,
    /// Keep at most this many `checkpoint-N` directories, deleting the oldest once a newer one
    /// is complete (Hugging Face's `save_total_limit`); `None` keeps all.
    #[serde(default)]
    pub save_total_limit: Option<usize>,
    /// Remember the checkpoint with the best `metric_for_best_model`, keep it through rotation
    /// and load its weights before the final model is written (Hugging Face's
    /// `load_best_model_at_end`; see [`super::best_model`]).
    #[serde(default)]
    pub load_best_model_at_end: bool,
    /// `eval_loss` (default) or `eval_perplexity`.
    #[serde(default)]
    pub metric_for_best_model: Option<String>,
    pub gradient_checkpointing: bool,
    /// Tokens per chunk of the GPU engine's fused linear + cross entropy
    /// (`--lce-chunk-tokens`; see [`crate::lce_chunk`]). The CPU engine ignores it.
    #[serde(default)]
    pub lce_chunk: LceChunk,
    /// Whether the GPU engine replays each step as one CUDA graph (`--cuda-graphs`; see
    /// [`crate::cuda_graphs`]). The CPU engine ignores it.
    #[serde(default)]
    pub cuda_graphs: CudaGraphs,
    /// Bit-reproducible GPU backwards (`--deterministic`): the flash attention backward in its
    /// two-kernel form without atomics instead of the faster one-pass form, whose dQ rounds
    /// differently from run to run (see `tilearn_ops::cuda::FlashBackward`). The CPU engine
    /// is deterministic whatever it says.
    #[serde(default)]
    pub deterministic: bool,
    /// Where the GPU engine keeps the optimizer state (`--memory`; see
    /// [`crate::memory_mode`]). The CPU engine ignores it.
    #[serde(default)]
    pub memory: MemoryMode,
    /// How the GPU engine keeps the 16-bit copy of the weights (`--weight-copy`; see
    /// [`crate::weight_copy`]). The CPU engine ignores it.
    #[serde(default)]
    pub weight_copy: WeightCopy,
    /// Where the GPU engine keeps gradient checkpointing's layer inputs
    /// (`--offload-checkpoints`; see [`crate::offload_checkpoints`]). The CPU engine ignores
    /// it.
    #[serde(default)]
    pub offload_checkpoints: OffloadCheckpoints,
    /// When the eval set ([`Trainer::set_eval_dataset`](super::Trainer::set_eval_dataset)) is
    /// evaluated.
    #[serde(default)]
    pub eval_strategy: EvalStrategy,
    /// With [`EvalStrategy::Steps`], evaluate every this many optimizer steps; `None`: every
    /// `logging_steps` (Hugging Face's default).
    #[serde(default)]
    pub eval_steps: Option<u64>,
    /// Eval windows per batch on each rank; `None`: the train batch size.
    #[serde(default)]
    pub per_device_eval_batch_size: Option<usize>,
    /// Evaluate at most this many batches per rank (the first ones); `None`: the whole set.
    #[serde(default)]
    pub max_eval_batches: Option<u64>,
    /// Hold out the last this many percent of the training data's windows from training and
    /// evaluate on them (instead of a separate eval set).
    #[serde(default)]
    pub validation_split_percentage: Option<f64>,
    /// Show a progress bar (the CLI turns it on when stderr is a terminal).
    pub progress_bar: bool,
    /// Fault injection: make every gradient infinite at these optimizer steps (1-based) when
    /// they run in fp16, as an fp16 backward overflow would (`--debug-inject-overflow`).
    #[serde(default)]
    pub debug_inject_overflow: Vec<u64>,
    /// Fault injection: the checkpoint writes after these optimizer steps fail with a simulated
    /// "no space left on device" once the model files are in the staging directory
    /// (`--debug-fail-checkpoint-write`).
    #[serde(default)]
    pub debug_fail_checkpoint_write: Vec<u64>,
    /// Fault injection: the run fails after this optimizer step (and its checkpoint), as a
    /// crashing rank would (`--debug-fail-after-step`, for tests of `--max-restarts`).
    #[serde(default)]
    pub debug_fail_after_step: Option<u64>,
}

impl Default for TrainingArguments {
    /// Hugging Face's defaults where they exist (lr 5e-5, linear schedule, max_grad_norm 1.0,
    /// betas 0.9/0.999, eps 1e-8, logging every 500 steps, seed 42).
    fn default() -> Self {
        TrainingArguments {
            output_dir: PathBuf::from("runs/tilearn"),
            length: TrainLength::Epochs(3.0),
            per_device_train_batch_size: 8,
            gradient_accumulation_steps: 1,
            learning_rate: 5e-5,
            lr_scheduler_type: "linear".into(),
            warmup_steps: 0,
            weight_decay: 0.0,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_epsilon: 1e-8,
            max_grad_norm: 1.0,
            seq_len: 512,
            seed: 42,
            logging_steps: 500,
            report_to: ReportTo::None,
            logging_dir: None,
            save_strategy: SaveStrategy::Steps,
            save_steps: 500,
            save_only_model: false,
            save_dtype: None,
            save_total_limit: None,
            load_best_model_at_end: false,
            metric_for_best_model: None,
            gradient_checkpointing: false,
            lce_chunk: LceChunk::Auto,
            cuda_graphs: CudaGraphs::default(),
            deterministic: false,
            memory: MemoryMode::Default,
            weight_copy: WeightCopy::Auto,
            offload_checkpoints: OffloadCheckpoints::Auto,
            eval_strategy: EvalStrategy::No,
            eval_steps: None,
            per_device_eval_batch_size: None,
            max_eval_batches: None,
            validation_split_percentage: None,
            progress_bar: false,
            debug_inject_overflow: Vec::new(),
            debug_fail_checkpoint_write: Vec::new(),
            debug_fail_after_step: None,
        }
    }
}

impl TrainingArguments {
    /// Whether a checkpoint is written after optimizer step `step` of a run of `max_steps`:
    /// Hugging Face's `DefaultFlowCallback.on_step_end` saves when `save_strategy == STEPS and
    /// save_steps > 0 and global_step % save_steps == 0`, and when `global_step >= max_steps`
    /// "if args.save_strategy == SaveStrategy.STEPS" (transformers 4.4x–5: the end of training
    /// is always saved under the steps strategy). `save_steps` 0 writes none, as
    /// `save_strategy no` does.
    pub fn saves_checkpoint_at(&self, step: u64, max_steps: u64) -> bool {
        self.save_strategy == SaveStrategy::Steps
            && self.save_steps > 0
            && (step.is_multiple_of(self.save_steps) || step >= max_steps)
    }

    /// How many checkpoints a run writes after steps `first_step + 1 ..= max_steps`.
    pub fn checkpoints_between(&self, first_step: u64, max_steps: u64) -> u64 {
        if self.save_strategy == SaveStrategy::No || self.save_steps == 0 || first_step >= max_steps
        {
            return 0;
        }
        let multiples = max_steps / self.save_steps - first_step / self.save_steps;
        multiples + u64::from(!max_steps.is_multiple_of(self.save_steps))
    }

    /// Eval windows per batch on each rank.
    pub fn eval_batch_size(&self) -> usize {
        self.per_device_eval_batch_size
            .unwrap_or(self.per_device_train_batch_size)
    }

    /// Whether the eval set is evaluated after optimizer step `step` of a run of `max_steps`
    /// with `steps_per_epoch` steps per epoch: Hugging Face's `DefaultFlowCallback` rule
    /// (multiples of `eval_steps`, or epoch ends), plus the end of training.
    pub fn evaluates_at(&self, step: u64, max_steps: u64, steps_per_epoch: u64) -> bool {
        let every = match self.eval_strategy {
            EvalStrategy::No => return false,
            EvalStrategy::Steps => self.eval_steps.unwrap_or(self.logging_steps),
            EvalStrategy::Epoch => steps_per_epoch,
        };
        step >= max_steps || (every > 0 && step.is_multiple_of(every))
    }

    /// Rejects values that cannot work, naming the flag and the fix.
    pub fn validate(&self) -> Result<()> {
        let bad = |argument: &str, message: String| {
            Err(EngineError::InvalidArgument {
                argument: argument.into(),
                message,
            })
        };
        if self.per_device_train_batch_size == 0 {
            return bad("--per-device-train-batch-size", "must be at least 1".into());
        }
        if self.gradient_accumulation_steps == 0 {
            return bad("--gradient-accumulation-steps", "must be at least 1".into());
        }
        if self.seq_len < 2 {
            return bad(
                "--seq-len",
                format!(
                    "is {}; a causal LM needs at least 2 tokens per sequence",
                    self.seq_len
                ),
            );
        }
        if !self.learning_rate.is_finite() || self.learning_rate < 0.0 {
            return bad(
                "--learning-rate",
                format!("is {}; use a finite value >= 0", self.learning_rate),
            );
        }
        if !self.max_grad_norm.is_finite() || self.max_grad_norm < 0.0 {
            return bad(
                "--max-grad-norm",
                format!(
                    "is {}; use a finite value >= 0 (0 disables clipping)",
                    self.max_grad_norm
                ),
            );
        }
        if self.eval_steps == Some(0) {
            return bad("--eval-steps", "must be at least 1".into());
        }
        if self.max_eval_batches == Some(0) {
            return bad(
                "--max-eval-batches",
                "must be at least 1 (turn evaluation off with --eval-strategy no)".into(),
            );
        }
        let eval_batch = self.eval_batch_size();
        if eval_batch == 0 || eval_batch > self.per_device_train_batch_size {
            // The engines' activation arenas hold up to the train batch.
            return bad(
                "--per-device-eval-batch-size",
                format!(
                    "is {eval_batch}; use 1 to --per-device-train-batch-size ({}), the batch \
                     the activation memory is sized for",
                    self.per_device_train_batch_size
                ),
            );
        }
        if self.save_total_limit == Some(0) {
            return bad(
                "--save-total-limit",
                "is 0; keep at least 1 checkpoint, or write none with --save-strategy no".into(),
            );
        }
        match self.length {
            TrainLength::MaxSteps(0) => bad("--max-steps", "must be at least 1".into()),
            TrainLength::Epochs(e) if !(e.is_finite() && e > 0.0) => bad(
                "--num-train-epochs",
                format!("is {e}; use a positive number"),
            ),
            _ => Ok(()),
        }
    }
}

/// `Option<DType>` as its Hugging Face name (`"bfloat16"`) in serialised arguments.
mod hf_dtype {
    use serde::{Deserialize, Deserializer, Serializer};
    use tilearn_ops::DType;

    pub fn serialize<S: Serializer>(dtype: &Option<DType>, s: S) -> Result<S::Ok, S::Error> {
        match dtype {
            Some(d) => s.serialize_some(d.hf_name()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<DType>, D::Error> {
        match Option::<String>::deserialize(d)? {
            None => Ok(None),
            Some(name) => DType::parse(&name).map(Some).ok_or_else(|| {
                serde::de::Error::custom(format!(
                    "unknown dtype `{name}`; use float32, bfloat16 or float16"
                ))
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn steps(every: u64) -> TrainingArguments {
        TrainingArguments {
            save_steps: every,
            ..TrainingArguments::default()
        }
    }

    #[test]
    fn hf_rule_saves_multiples_and_the_last_step() {
        let a = steps(3);
        let saved: Vec<u64> = (1..=7).filter(|&s| a.saves_checkpoint_at(s, 7)).collect();
        assert_eq!(saved, [3, 6, 7]);
        assert_eq!(a.checkpoints_between(0, 7), 3);
        assert_eq!(a.checkpoints_between(3, 6), 1);
        assert_eq!(a.checkpoints_between(4, 7), 2);
        assert_eq!(a.checkpoints_between(7, 7), 0);
    }

    #[test]
    fn eval_points_follow_steps_epochs_and_the_end() {
        let every = |strategy, eval_steps| TrainingArguments {
            eval_strategy: strategy,
            eval_steps,
            logging_steps: 4,
            ..TrainingArguments::default()
        };
        let points = |a: &TrainingArguments| -> Vec<u64> {
            (1..=10).filter(|&s| a.evaluates_at(s, 10, 3)).collect()
        };
        assert_eq!(points(&every(EvalStrategy::Steps, Some(3))), [3, 6, 9, 10]);
        assert_eq!(points(&every(EvalStrategy::Steps, None)), [4, 8, 10]);
        assert_eq!(points(&every(EvalStrategy::Epoch, Some(5))), [3, 6, 9, 10]);
        assert!(points(&every(EvalStrategy::No, Some(1))).is_empty());
    }

    #[test]
    fn save_steps_zero_and_strategy_no_save_nothing() {
        let none = steps(0);
        assert!((1..=5).all(|s| !none.saves_checkpoint_at(s, 5)));
        assert_eq!(none.checkpoints_between(0, 5), 0);
        let no = TrainingArguments {
            save_strategy: SaveStrategy::No,
            ..steps(1)
        };
        assert!((1..=5).all(|s| !no.saves_checkpoint_at(s, 5)));
        assert_eq!(no.checkpoints_between(0, 5), 0);
    }
}
