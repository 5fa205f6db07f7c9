//! What the training loop needs of a model, whichever device it trains on: a step on a batch
//! (whose jagged ids the loop builds ahead on its loader thread), logits for evaluation, and
//! the model on the host for checkpoints. [`CtrModel`] is the CPU one; the GPU one is
//! `cuda::GpuCtrTrainer` (feature `cuda`).

use crate::cache::RowCacheReport;
use crate::data::CtrBatch;
use crate::error::Result;
use crate::jagged::JaggedBatch;
use crate::model::{CtrConfig, CtrModel, StepStats};

/// A CTR model the training loop can drive.
pub trait CtrStepper {
    /// The model's shape (the loop builds each batch's jagged ids with `config().jagged`).
    fn config(&self) -> &CtrConfig;

    /// One training step on `batch`, whose jagged ids are `config().jagged(batch)`.
    fn step(&mut self, batch: &CtrBatch, jagged: &JaggedBatch, dense_lr: f32) -> Result<StepStats>;

    /// Logits of every sample of `batch`.
    fn predict(&mut self, batch: &CtrBatch) -> Result<Vec<f32>>;

    /// A row cache's counts and traffic so far (`None`: every row lives where the step runs).
    fn row_cache(&mut self) -> Result<Option<RowCacheReport>> {
        Ok(None)
    }

    /// Whether this process writes the checkpoints the training loop asks for (every process
    /// still calls [`host`](Self::host), which may be collective): all but the non-zero ranks
    /// of a sharded run.
    fn writes_checkpoints(&self) -> bool {
        true
    }

    /// The model and its optimizers' state on the host, current (a device model copies its
    /// state back first).
    fn host(&mut self) -> Result<&CtrModel>;
}

impl CtrStepper for CtrModel {
    fn config(&self) -> &CtrConfig {
        &self.config
    }

    fn step(&mut self, batch: &CtrBatch, jagged: &JaggedBatch, dense_lr: f32) -> Result<StepStats> {
        self.train_step_jagged(batch, jagged, dense_lr)
    }

    fn predict(&mut self, batch: &CtrBatch) -> Result<Vec<f32>> {
        CtrModel::predict(self, batch)
    }

    fn host(&mut self) -> Result<&CtrModel> {
        Ok(self)
    }
}
