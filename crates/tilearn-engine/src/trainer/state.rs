//! What a checkpoint holds besides the model and optimizer: the step, the epoch, the data
//! loader's position (our only source of randomness during training) and the schedule.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::data::LoaderState;
use crate::{EngineError, Result};

pub const TRAINER_STATE_FILE: &str = "trainer_state.json";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const SCHEDULER_FILE: &str = "scheduler.json";
/// The GradScaler's state (torch's keys), present when fp16 can occur.
pub const SCALER_FILE: &str = "scaler.json";
/// An adaptive precision policy's memory (e.g. auto's overflow window), present with a policy.
pub const AMP_POLICY_FILE: &str = "amp_policy.json";

/// With `--load-best-model-at-end` (see [`super::best_model`]), what the trainer state records
/// about the best checkpoint (Hugging Face's field names).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct BestCheckpoint {
    pub best_metric: Option<f64>,
    pub best_model_checkpoint: Option<PathBuf>,
}

/// Progress of a run, saved as `trainer_state.json` in every checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimizer steps completed.
    pub global_step: u64,
    /// Total optimizer steps planned for the run.
    pub max_steps: u64,
    /// Position of the next batch the loader will yield.
    pub loader: LoaderState,
    /// Seed of the run; a resume with another seed would not continue the same run.
    pub seed: u64,
    /// Tokens consumed so far (inputs, including ignored positions).
    pub tokens_seen: u64,
    /// Windows one loader batch index covers (per-device batch × data-parallel ranks) when the
    /// checkpoint was written, so a resume with another number of ranks finds the same place in
    /// the data; absent in older checkpoints (then: the same as the resuming run).
    #[serde(default)]
    pub windows_per_batch: Option<u64>,
    /// With `--load-best-model-at-end`: the best metric and its checkpoint so far.
    #[serde(default, flatten)]
    pub best: BestCheckpoint,
}

/// The learning-rate schedule's parameters and position, saved as `scheduler.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SchedulerState {
    pub lr_scheduler_type: String,
    pub base_lr: f32,
    pub warmup_steps: u64,
    pub total_steps: u64,
    pub last_step: u64,
}

pub fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let text = serde_json::to_string_pretty(value).expect("state serialises");
    super::checkpoint::write_atomically(path, text.as_bytes())
}

pub fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| EngineError::io(path, "read", e))?;
    serde_json::from_str(&text).map_err(|e| EngineError::Data {
        file: path.to_path_buf(),
        message: format!(
            "not a valid tilearn state file ({e}); was the checkpoint written by tilearn?"
        ),
    })
}
