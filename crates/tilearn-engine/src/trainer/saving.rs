//! The Trainer's saves and its resume: the final model, checkpoints (with the disk checks,
//! rotation and failure handling of the save rules in `docs/ARCHITECTURE.md`), and restoring
//! a checkpoint.
//!
//! A checkpoint that cannot be written (not enough space, or a write error) is reported as a
//! warning and the run goes on; the previous checkpoints stay as they were and the staging
//! directory is removed. After the last step the final model is written first and the final
//! checkpoint after it, so a failing checkpoint never costs the model; the run then ends with
//! [`EngineError::CheckpointsNotSaved`] naming every checkpoint that is missing.

use std::path::Path;
use std::time::Instant;

use adaptfp16::{AmpPlan, GradScaler};
use tilearn_ops::DType;
use tilearn_ops::fs::tmp_path;
use tilearn_optim::LrSchedule;

use super::disk::{self, SaveSizes, show_bytes};
use super::optimizer_shards::{MANIFEST_FILE, OptimizerCheckpoint, ShardManifest, shard_file_name};
use super::{SchedulerState, Trainer, TrainerState, checkpoint, state};
use crate::checkpoint::{CONFIG_FILE, DEFAULT_MAX_SHARD_BYTES};
use crate::config::LlamaConfig;
use crate::{EngineError, Result};

impl Trainer {
    /// The dtype of the final model files: `--save-dtype`, else the config's dtype, else f32.
    fn model_dtype(&self) -> DType {
        self.args
            .save_dtype
            .or(self.config.dtype)
            .unwrap_or(DType::F32)
    }

    pub(super) fn save_sizes(&self) -> SaveSizes {
        SaveSizes::new(
            self.backend.saved_specs(),
            self.model_dtype(),
            self.args.save_only_model,
        )
    }

    /// Refuses a run whose final model and checkpoints (as many as are on disk at once under
    /// `--save-total-limit`: the limit plus the one being written) cannot fit.
    pub(super) fn check_disk_at_start(&self, first_step: u64, total_steps: u64) -> Result<()> {
        let written = self.args.checkpoints_between(first_step, total_steps);
        // Rotation keeps the limit plus the one being written, and never deletes the best.
        let kept_best = u64::from(self.args.load_best_model_at_end);
        let on_disk = match self.args.save_total_limit {
            Some(limit) => written.min(limit as u64 + 1 + kept_best),
            None => written,
        };
        disk::check_run(
            self.space.as_ref(),
            &self.args.output_dir,
            self.save_sizes(),
            on_disk,
        )
    }

    /// Writes the final model into the output directory; returns the seconds it took.
    pub(super) fn save_final_model(&mut self, sink: &mut dyn super::ProgressSink) -> Result<f64> {
        let (dir, dtype) = (self.args.output_dir.clone(), self.model_dtype());
        let bytes = self.save_sizes().model;
        let start = Instant::now();
        let saved =
            self.backend
                .save_model(&dir, &self.config, dtype, Some(DEFAULT_MAX_SHARD_BYTES));
        if let Err(e) = saved {
            // Name the space the model needed next to the write error.
            let free = self.space.available_bytes(&dir).ok();
            return Err(EngineError::InvalidArgument {
                argument: "--output-dir".into(),
                message: format!(
                    "the final model ({} in {dtype}) could not be written to {} ({} free): {e}",
                    show_bytes(bytes),
                    dir.display(),
                    free.map_or("unknown".into(), show_bytes),
                ),
            });
        }
        let secs = start.elapsed().as_secs_f64();
        let written = disk::files_bytes(&dir, |name| {
            name == CONFIG_FILE || (name.starts_with("model") && !name.ends_with(".tmp"))
        });
        sink.note(&format!(
            "saved the final model ({} in {dtype}) to {} in {secs:.1} s ({:.2} GB/s)",
            show_bytes(written),
            dir.display(),
            written as f64 / 1e9 / secs.max(1e-9)
        ));
        Ok(secs)
    }

    /// Writes `checkpoint-<step>` if the disk has room, then rotates old checkpoints. A failure
    /// is reported through `sink` and returned as one line for the end-of-run error. Collective
    /// under ZeRO (every rank writes its optimizer shard); the outer error is a failed
    /// collective, which ends the run.
    pub(super) fn try_checkpoint(
        &mut self,
        state: &TrainerState,
        schedule: &LrSchedule,
        scaler: &GradScaler,
        sink: &mut dyn super::ProgressSink,
    ) -> Result<std::result::Result<(), String>> {
        let dir = checkpoint::checkpoint_dir(&self.args.output_dir, state.global_step);
        let name = format!("checkpoint-{}", state.global_step);
        let start = Instant::now();
        let saved = self.save_checkpoint(&dir, &name, state, schedule, scaler)?;
        if !self.writes_files() {
            // Rank 0 reports the outcome (it knows every rank's part of it).
            return Ok(Ok(()));
        }
        if let Err(e) = saved {
            let line = format!("{name} was not written: {e}");
            sink.warn(&format!(
                "{line}; training goes on, earlier checkpoints are intact"
            ));
            return Ok(Err(line));
        }
        let secs = start.elapsed().as_secs_f64();
        let written = disk::files_bytes(&dir, |_| true);
        sink.note(&format!(
            "saved {name} ({}) in {secs:.1} s ({:.2} GB/s)",
            show_bytes(written),
            written as f64 / 1e9 / secs.max(1e-9)
        ));
        if let Some(limit) = self.args.save_total_limit {
            let mut keep = vec![dir.as_path()];
            keep.extend(self.resumed_from.as_deref());
            keep.extend(state.best.best_model_checkpoint.as_deref());
            match checkpoint::rotate_checkpoints(&self.args.output_dir, limit, &keep) {
                Ok(removed) => {
                    for old in removed {
                        sink.note(&format!(
                            "deleted {} (--save-total-limit {limit})",
                            old.display()
                        ));
                    }
                }
                Err(e) => sink.warn(&e.to_string()),
            }
        }
        Ok(Ok(()))
    }

    /// Rank 0 checks the space and stages the checkpoint; under ZeRO every rank then writes its
    /// optimizer shard into the staging directory, and rank 0 adds the rest (the model, the
    /// states, the shards' manifest) and renames it into place once every shard is written.
    /// Other ranks' inner result is only their own part.
    fn save_checkpoint(
        &mut self,
        dir: &Path,
        name: &str,
        state: &TrainerState,
        schedule: &LrSchedule,
        scaler: &GradScaler,
    ) -> Result<Result<()>> {
        // Collective: rank 0 writes whole weights, which ZeRO on the GPU may hold in shards.
        self.dp.gather_whole_weights(self.backend.as_mut())?;
        if let Some(place) = self.mp.clone().filter(|p| p.size() > 1) {
            return self.save_split_checkpoint(dir, name, state, schedule, scaler, &place);
        }
        let primary = self.dp.is_primary();
        let shards = self.dp.is_sharded() && !self.args.save_only_model;
        let staging = if primary {
            let bytes = self.save_sizes().checkpoint;
            disk::check_save(self.space.as_ref(), &self.args.output_dir, name, bytes)
                .and_then(|()| checkpoint::prepare_staging(dir))
                .map(Some)
        } else {
            Ok(None)
        };
        if !shards {
            return Ok(match staging {
                Ok(Some(staging)) => self.finish_checkpoint(dir, &staging, state, schedule, scaler),
                other => other.map(|_| ()),
            });
        }
        if self.dp.any(staging.is_err())? {
            return Ok(staging.map(|_| ()));
        }
        let (rank, world) = (self.dp.rank(), self.dp.world_size());
        let staging = staging?.unwrap_or_else(|| tmp_path(dir));
        let shard = self
            .backend
            .save_optimizer(&staging.join(shard_file_name(rank, world)));
        let any_shard_failed = self.dp.any(shard.is_err())?;
        if !primary {
            return Ok(shard);
        }
        let finished = match (shard, any_shard_failed) {
            (Err(e), _) => Err(e),
            (Ok(()), true) => Err(EngineError::InvalidArgument {
                argument: "--output-dir".into(),
                message: "another rank could not write its optimizer shard (see its message)"
                    .into(),
            }),
            (Ok(()), false) => {
                return Ok(self.finish_checkpoint(dir, &staging, state, schedule, scaler));
            }
        };
        checkpoint::discard_staging(&staging);
        Ok(finished)
    }

    /// Rank 0's part of a checkpoint: writes everything but the ZeRO shards into `staging` and
    /// renames it to `dir`; on failure the staging directory is removed.
    fn finish_checkpoint(
        &mut self,
        dir: &Path,
        staging: &Path,
        state: &TrainerState,
        schedule: &LrSchedule,
        scaler: &GradScaler,
    ) -> Result<()> {
        let written = self.write_checkpoint_files(staging, state, schedule, scaler);
        match written {
            Ok(()) => checkpoint::commit_staging(staging, dir),
            Err(e) => {
                checkpoint::discard_staging(staging);
                Err(e)
            }
        }
    }

    /// The dtype of a checkpoint's weights: resumable checkpoints hold the f32 master weights
    /// so a resume continues bit for bit; --save-only-model ones hold the model as the final
    /// save does.
    pub(super) fn checkpoint_weights_dtype(&self) -> DType {
        if self.args.save_only_model {
            self.model_dtype()
        } else {
            DType::F32
        }
    }

    fn write_checkpoint_files(
        &mut self,
        staging: &Path,
        state: &TrainerState,
        schedule: &LrSchedule,
        scaler: &GradScaler,
    ) -> Result<()> {
        self.backend.save_model(
            staging,
            &self.config,
            self.checkpoint_weights_dtype(),
            Some(DEFAULT_MAX_SHARD_BYTES),
        )?;
        if !self.args.save_only_model {
            if self.dp.is_sharded() {
                let layout = self.dp.layout();
                let manifest = ShardManifest::new(
                    layout.numel,
                    layout.world,
                    self.dp.zero_stage().number(),
                    |rank| layout.owned(rank),
                );
                state::write_json(&staging.join(MANIFEST_FILE), &manifest)?;
            } else {
                self.backend
                    .save_optimizer(&staging.join(state::OPTIMIZER_FILE))?;
            }
        }
        self.write_state_files(staging, state, schedule, scaler)
    }

    /// The small files of a checkpoint (scheduler, scaler, precision policy; the trainer state
    /// last), written by the rank that commits it.
    pub(super) fn write_state_files(
        &mut self,
        staging: &Path,
        state: &TrainerState,
        schedule: &LrSchedule,
        scaler: &GradScaler,
    ) -> Result<()> {
        let a = &self.args;
        if a.debug_fail_checkpoint_write.contains(&state.global_step) {
            return Err(EngineError::io(
                staging.join(state::OPTIMIZER_FILE),
                "write",
                std::io::Error::new(
                    std::io::ErrorKind::StorageFull,
                    "no space left on device (simulated by --debug-fail-checkpoint-write)",
                ),
            ));
        }
        if !a.save_only_model {
            state::write_json(
                &staging.join(state::SCHEDULER_FILE),
                &SchedulerState {
                    lr_scheduler_type: a.lr_scheduler_type.clone(),
                    base_lr: schedule.base_lr,
                    warmup_steps: schedule.warmup_steps,
                    total_steps: schedule.total_steps,
                    last_step: state.global_step,
                },
            )?;
            if scaler.is_enabled() {
                state::write_json(&staging.join(state::SCALER_FILE), &scaler.state_dict_json())?;
            }
            if let AmpPlan::Adaptive(policy) = &self.amp {
                state::write_json(&staging.join(state::AMP_POLICY_FILE), &policy.state_json()?)?;
            }
        }
        state::write_json(&staging.join(state::TRAINER_STATE_FILE), state)
    }

    /// Loads a checkpoint written by [`Trainer::save_checkpoint`] into the backend, scaler and
    /// policy, and returns its trainer state.
    pub(super) fn restore(&mut self, dir: &Path, scaler: &mut GradScaler) -> Result<TrainerState> {
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
        let saved = LlamaConfig::from_file(dir.join(CONFIG_FILE))?;
        // The dtype field records how the weights were stored, not the model, and
        // generation_config.json is not part of the model either.
        let same_model = LlamaConfig {
            dtype: None,
            generation: None,
            ..saved
        } == LlamaConfig {
            dtype: None,
            generation: None,
            ..self.config.clone()
        };
        if !same_model {
            return Err(EngineError::InvalidArgument {
                argument: "--resume-from-checkpoint".into(),
                message: format!(
                    "{} holds a different model (its config.json differs) from the one this run \
                     builds; resume with the same --config/--model",
                    dir.display(),
                ),
            });
        }
        // The whole model's tensors (a tensor/pipeline-parallel rank holds slices of them).
        let specs = self.backend.saved_specs().to_vec();
        let Some(optimizer) = OptimizerCheckpoint::open(dir, &specs)? else {
            return Err(EngineError::InvalidArgument {
                argument: "--resume-from-checkpoint".into(),
                message: format!(
                    "{} has no {} (saved with --save-only-model?), so training cannot resume \
                     from it; start a new run from its weights with --model {}",
                    dir.display(),
                    state::OPTIMIZER_FILE,
                    dir.display()
                ),
            });
        };
        self.backend.restore(dir, &optimizer)?;
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
