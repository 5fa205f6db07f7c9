//! Checkpoints of a tensor- and pipeline-parallel run: the whole model in plain Hugging Face
//! files (gathered over the replica, written by its rank 0), every rank's optimizer slices in
//! its own file (`optimizer-rankI-of-N.safetensors`, each carrying its `layout`), the sliced
//! manifest and the trainer's states.
//!
//! Who writes which optimizer file: without ZeRO the replicas hold the same state, so the ranks
//! of data-parallel rank 0's replica write one file each (`I` = the rank in the replica, `N` =
//! tp · pp); with ZeRO every rank writes its shard (`I` = replica rank · dp + dp rank, `N` =
//! tp · pp · dp). The job's rank 0 stages the directory and commits it once every rank has said
//! (over the whole job) that its part is written, so a checkpoint directory is complete or
//! absent, never partial.

use std::path::Path;

use adaptfp16::GradScaler;
use tilearn_ops::fs::tmp_path;
use tilearn_optim::LrSchedule;
use tilearn_parallel::scalars;

use super::optimizer_shards::{MANIFEST_FILE, SlicedManifest, shard_file_name};
use super::{ModelParallelPlace, Trainer, TrainerState, checkpoint, disk, state};
use crate::checkpoint::DEFAULT_MAX_SHARD_BYTES;
use crate::params::ParamSpec;
use crate::{EngineError, Result};

impl Trainer {
    /// [`Trainer::save_checkpoint`] for a run split by tensor/pipeline parallelism (module
    /// docs). Collective over the whole job; the inner result is the job's outcome on its rank 0
    /// and only this rank's part elsewhere.
    pub(super) fn save_split_checkpoint(
        &mut self,
        dir: &Path,
        name: &str,
        state: &TrainerState,
        schedule: &LrSchedule,
        scaler: &GradScaler,
        place: &ModelParallelPlace,
    ) -> Result<Result<()>> {
        let world = place.world.clone();
        let commits = self.writes_files();
        let staging = if commits {
            let bytes = self.save_sizes().checkpoint;
            disk::check_save(self.space.as_ref(), &self.args.output_dir, name, bytes)
                .and_then(|()| checkpoint::prepare_staging(dir))
                .map(Some)
        } else {
            Ok(None)
        };
        if scalars::any(world.as_ref(), staging.is_err())? {
            return Ok(staging.map(|_| ()));
        }
        let staging = staging?.unwrap_or_else(|| tmp_path(dir));
        let resumable = !self.args.save_only_model;
        let sharded = self.dp.is_sharded();
        let dp_files = if sharded { self.dp.world_size() } else { 1 };
        let files = place.size() * dp_files;
        let mut part = Ok(());
        if resumable && (sharded || self.dp.is_primary()) {
            let index = place.rank * dp_files + if sharded { self.dp.rank() } else { 0 };
            part = self
                .backend
                .save_optimizer(&staging.join(shard_file_name(index, files)));
        }
        if self.dp.is_primary() {
            // Collective over the replica: every rank's slices are gathered, its rank 0 writes.
            let model = self.backend.save_model(
                &staging,
                &self.config,
                self.checkpoint_weights_dtype(),
                Some(DEFAULT_MAX_SHARD_BYTES),
            );
            part = part.and(model);
        }
        let any_failed = scalars::any(world.as_ref(), part.is_err())?;
        if !commits {
            return Ok(part);
        }
        let finished = match (part, any_failed) {
            (Err(e), _) => Err(e),
            (Ok(()), true) => Err(EngineError::InvalidArgument {
                argument: "--output-dir".into(),
                message: "another rank could not write its part of the checkpoint (see its \
                          message)"
                    .into(),
            }),
            (Ok(()), false) => {
                let numel = self
                    .backend
                    .saved_specs()
                    .iter()
                    .map(ParamSpec::numel)
                    .sum();
                let manifest = SlicedManifest::new(
                    numel,
                    (place.tp, place.pp, self.dp.world_size()),
                    self.dp.zero_stage().number(),
                    (0..files).map(|i| shard_file_name(i, files)).collect(),
                );
                let written = if resumable {
                    state::write_json(&staging.join(MANIFEST_FILE), &manifest)
                } else {
                    Ok(())
                };
                written
                    .and_then(|()| self.write_state_files(&staging, state, schedule, scaler))
                    .and_then(|()| checkpoint::commit_staging(&staging, dir))
            }
        };
        if finished.is_err() {
            checkpoint::discard_staging(&staging);
        }
        Ok(finished)
    }
}
