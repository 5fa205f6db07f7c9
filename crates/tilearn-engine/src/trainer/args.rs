//! Training arguments, named after Hugging Face `TrainingArguments` so users find what they know.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::{EngineError, Result};

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
    /// Save a checkpoint every this many optimizer steps; 0 saves only at the end.
    pub save_steps: u64,
    pub gradient_checkpointing: bool,
    /// Show a progress bar (the CLI turns it on when stderr is a terminal).
    pub progress_bar: bool,
    /// Fault injection: make every gradient infinite at these optimizer steps (1-based) when
    /// they run in fp16, as an fp16 backward overflow would (`--debug-inject-overflow`).
    #[serde(default)]
    pub debug_inject_overflow: Vec<u64>,
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
            save_steps: 500,
            gradient_checkpointing: false,
            progress_bar: false,
            debug_inject_overflow: Vec::new(),
        }
    }
}

impl TrainingArguments {
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
