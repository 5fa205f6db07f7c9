//! The row cache of tables larger than the GPU (`crate::cache`) with the cache on the device:
//! the rows and their optimizer state stay in host memory, the cached rows in a
//! [`DeviceEmbeddingBag`] over the cache's tables, and each batch's moves (write-backs of
//! dirty evicted rows, then loads) are row copies between the two before the batch is
//! uploaded with slot ids. The planning is the host cache's ([`RowCachePlanner`]); so is the
//! result, bit for bit (`tests/embedding_bag_gpu.rs`).
//!
//! Copies are one small transfer per row (and per state buffer) from pageable memory: correct
//! and simple, not yet fast; batching them through pinned staging with a gather/scatter kernel
//! is the next step.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};

use super::embedding_bag::{DeviceEmbeddingBag, DeviceJaggedBatch};
use crate::cache::{CacheStats, RowCachePlanner, RowMove};
use crate::error::Result;
use crate::jagged::JaggedBatch;
use crate::sparse_optim::SparseState;
use crate::tables::EmbeddingTables;

/// Embedding tables in host memory with a GPU cache of hot rows.
#[derive(Debug)]
pub struct DeviceCachedEmbeddingBag {
    backing: EmbeddingTables,
    backing_state: SparseState,
    device: DeviceEmbeddingBag,
    planner: RowCachePlanner,
}

impl DeviceCachedEmbeddingBag {
    /// A device cache of `slots[t]` rows of table `t` in front of `backing` and its optimizer
    /// `state` (kept on the host).
    pub fn new(
        stream: &Arc<CudaStream>,
        backing: EmbeddingTables,
        state: SparseState,
        slots: &[usize],
    ) -> Result<Self> {
        state.check_layout(&backing.layout)?;
        let planner = RowCachePlanner::new(&backing.layout, slots)?;
        let layout = planner.cache_layout().clone();
        let mut cache_state = SparseState::new(*state.optimizer(), &layout)?;
        cache_state.set_step(state.step());
        let cache = EmbeddingTables {
            weights: vec![0.0; layout.total_elements()],
            layout,
        };
        Ok(DeviceCachedEmbeddingBag {
            device: DeviceEmbeddingBag::new(stream, &cache, &cache_state)?,
            backing,
            backing_state: state,
            planner,
        })
    }

    pub fn stats(&self) -> CacheStats {
        self.planner.stats()
    }

    fn apply(&mut self, stream: &Arc<CudaStream>, moves: &[RowMove]) -> Result<()> {
        for &m in moves {
            let (t, row, slot, to_backing) = match m {
                RowMove::WriteBack { table, row, slot } => (table, row, slot, true),
                RowMove::Load { table, row, slot } => (table, row, slot, false),
            };
            let layout = &self.backing.layout;
            let range = layout.row_range(t, row as usize);
            let stacked = layout.row_base()[t] + row as usize;
            let state = self.backing_state.row_mut(stacked, range.clone());
            let weights = &mut self.backing.weights[range];
            if to_backing {
                self.device
                    .read_row(stream, t, slot as usize, weights, state)?;
            } else {
                self.device
                    .write_row(stream, t, slot as usize, weights, state)?;
            }
        }
        Ok(())
    }

    /// Brings the rows of `batch` (ids of the backing tables) into the device cache and
    /// uploads the batch with slot ids; with `training` its rows become dirty.
    pub fn map_batch(
        &mut self,
        stream: &Arc<CudaStream>,
        batch: &JaggedBatch,
        training: bool,
    ) -> Result<DeviceJaggedBatch> {
        let (moves, mapped) = self.planner.map_batch(batch, training)?;
        self.apply(stream, &moves)?;
        DeviceJaggedBatch::upload(stream, self.planner.cache_layout(), &mapped)
    }

    /// The pooled forward of a mapped batch (`[batch, total_dim]`).
    pub fn forward(
        &self,
        stream: &Arc<CudaStream>,
        batch: &DeviceJaggedBatch,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        self.device.forward(stream, batch, out)
    }

    /// The fused backward + sparse update of a batch mapped with `training`.
    pub fn backward_update(
        &mut self,
        stream: &Arc<CudaStream>,
        batch: &DeviceJaggedBatch,
        dout: &impl DevicePtr<f32>,
    ) -> Result<()> {
        self.device.backward_update(stream, batch, dout)
    }

    /// Writes every dirty cached row back and returns the host tables and state, current.
    pub fn flush(&mut self, stream: &Arc<CudaStream>) -> Result<(&EmbeddingTables, &SparseState)> {
        let moves = self.planner.flush();
        self.apply(stream, &moves)?;
        self.backing_state.set_step(self.device.step());
        Ok((&self.backing, &self.backing_state))
    }
}
