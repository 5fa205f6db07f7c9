//! Checkpoints of `tilearn ctr train` with exact resume. `OUTPUT/checkpoint-STEP/` holds:
//!
//! * `model.safetensors`: the model ([`crate::model::io`]);
//! * `optimizer.safetensors`: the dense AdamW's state in tilearn-optim's one state-file format;
//! * `sparse_optimizer.safetensors`: the sparse rule's step count and per-row state
//!   ([`crate::SparseState::save_state`]);
//! * `trainer_state.json`: the step, samples seen and the loader's position ([`TrainerState`]).
//!
//! Every file goes through `tilearn_ops::fs`'s atomic write, inside a staging directory
//! `checkpoint-STEP.tmp` renamed into place once complete, so a failed save leaves the earlier
//! checkpoints intact (and removes its staging directory).

use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tilearn_ops::fs::{sync_parent_dir, tmp_path, write_bytes_atomic};

use crate::error::{RecsysError, Result};
use crate::model::io::{load_model, save_model};
use crate::model::{CtrConfig, CtrModel};

pub const TRAINER_STATE_FILE: &str = "trainer_state.json";
/// The dense optimizer's state, named as the LLM trainer's checkpoints name it.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const SPARSE_OPTIMIZER_FILE: &str = "sparse_optimizer.safetensors";

/// Where a run stands, saved as `trainer_state.json`. The loader's batch order is a function
/// of the seed, the training samples and the batch size (the only randomness of training), so
/// these and the next batch index make the continuation exact.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Steps completed.
    pub step: usize,
    /// Training samples consumed so far.
    pub samples_seen: u64,
    /// The loader's position: the index of the next batch it yields.
    pub next_batch: usize,
    /// The loader's seed.
    pub seed: u64,
    pub batch_size: usize,
    /// Samples in the training split.
    pub train_samples: usize,
}

/// The directory of the checkpoint after `step` steps.
pub fn checkpoint_dir(output_dir: &Path, step: usize) -> PathBuf {
    output_dir.join(format!("checkpoint-{step}"))
}

/// Writes `output_dir/checkpoint-STEP/` (see the module docs) and returns it; with `keep`,
/// then deletes the oldest checkpoints until `keep` remain.
pub fn save_checkpoint(
    output_dir: &Path,
    model: &CtrModel,
    state: &TrainerState,
    keep: Option<usize>,
) -> Result<PathBuf> {
    let final_dir = checkpoint_dir(output_dir, state.step);
    let staging = tmp_path(&final_dir);
    if staging.exists() {
        fs::remove_dir_all(&staging).map_err(|e| RecsysError::io(&staging, e))?;
    }
    fs::create_dir_all(&staging).map_err(|e| RecsysError::io(&staging, e))?;
    let written = write_checkpoint_files(&staging, model, state).and_then(|()| {
        if final_dir.exists() {
            // A re-run of the same step: the new checkpoint is complete, the old one goes now.
            fs::remove_dir_all(&final_dir).map_err(|e| RecsysError::io(&final_dir, e))?;
        }
        fs::rename(&staging, &final_dir).map_err(|e| RecsysError::io(&final_dir, e))
    });
    if let Err(e) = written {
        // Best effort: a half-written checkpoint only takes space.
        let _ = fs::remove_dir_all(&staging);
        return Err(e);
    }
    sync_parent_dir(&final_dir);
    if let Some(keep) = keep {
        for (_, old) in checkpoints(output_dir).into_iter().rev().skip(keep.max(1)) {
            fs::remove_dir_all(&old).map_err(|e| RecsysError::io(&old, e))?;
        }
    }
    Ok(final_dir)
}

fn write_checkpoint_files(dir: &Path, model: &CtrModel, state: &TrainerState) -> Result<()> {
    save_model(dir, &model.config, &model.tables, &model.dense)?;
    model.adamw.save_state(&dir.join(OPTIMIZER_FILE))?;
    model.sparse.save_state(&dir.join(SPARSE_OPTIMIZER_FILE))?;
    let path = dir.join(TRAINER_STATE_FILE);
    let json = serde_json::to_string_pretty(state).expect("trainer state serialises");
    write_bytes_atomic(&path, json.as_bytes()).map_err(|e| RecsysError::io(&path, e))
}

/// The complete `checkpoint-STEP` directories of `output_dir`, oldest first (staging
/// directories `checkpoint-STEP.tmp` do not parse as a step and are left out).
pub fn checkpoints(output_dir: &Path) -> Vec<(usize, PathBuf)> {
    let Ok(entries) = fs::read_dir(output_dir) else {
        return Vec::new();
    };
    let mut found: Vec<(usize, PathBuf)> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .filter_map(|e| {
            let step = e.file_name().to_str()?.strip_prefix("checkpoint-")?.parse();
            Some((step.ok()?, e.path()))
        })
        .collect();
    found.sort();
    found
}

/// Loads the checkpoint `dir` into `model` (built with this run's config and optimizers) and
/// returns where the run stood. The checkpoint's model config must equal the run's (an error
/// names the first field that differs); a missing or damaged file is an error naming it.
pub fn load_checkpoint(dir: &Path, model: &mut CtrModel) -> Result<TrainerState> {
    let damaged = |e: RecsysError| {
        RecsysError::invalid(
            "checkpoint",
            format!(
                "{e}; {} is incomplete or damaged: resume from another checkpoint-STEP directory of the run, or train without --resume-from-checkpoint",
                dir.display()
            ),
        )
    };
    if !dir.is_dir() {
        return Err(RecsysError::invalid(
            "checkpoint",
            format!(
                "{} is not a directory; pass OUTPUT/checkpoint-STEP as written by --save-steps",
                dir.display()
            ),
        ));
    }
    let path = dir.join(TRAINER_STATE_FILE);
    let text = fs::read_to_string(&path).map_err(|e| damaged(RecsysError::io(&path, e)))?;
    let state: TrainerState = serde_json::from_str(&text).map_err(|e| {
        damaged(RecsysError::Format {
            path: path.clone(),
            message: e.to_string(),
        })
    })?;
    let saved = load_model(dir).map_err(damaged)?;
    check_same_config(&saved.config, &model.config)?;
    model
        .adamw
        .load_state(&dir.join(OPTIMIZER_FILE))
        .map_err(|e| damaged(e.into()))?;
    model
        .sparse
        .load_state(&dir.join(SPARSE_OPTIMIZER_FILE))
        .map_err(damaged)?;
    model.tables = saved.tables;
    model.dense = saved.dense;
    Ok(state)
}

/// Fails naming the field of the model config that differs between the checkpoint and this
/// run: the model kind first (it changes several derived fields), then the others.
fn check_same_config(saved: &CtrConfig, run: &CtrConfig) -> Result<()> {
    if saved.model != run.model {
        return Err(RecsysError::invalid(
            "checkpoint",
            format!(
                "its model has `model` = {:?}, this run's is {:?}; resume with the --model the checkpoint was trained with",
                saved.model, run.model
            ),
        ));
    }
    let (saved, run) = (
        serde_json::to_value(saved).expect("config serialises"),
        serde_json::to_value(run).expect("config serialises"),
    );
    let (Some(saved), Some(run)) = (saved.as_object(), run.as_object()) else {
        unreachable!("a CtrConfig serialises to a JSON object");
    };
    for (field, value) in saved {
        if run.get(field) != Some(value) {
            return Err(RecsysError::invalid(
                "checkpoint",
                format!(
                    "its model has `{field}` = {value}, this run's has {}; resume with the flags the checkpoint was trained with",
                    run.get(field).cloned().unwrap_or_default()
                ),
            ));
        }
    }
    Ok(())
}
