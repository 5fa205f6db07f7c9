//! Where a device model's embedding rows live: all on the GPU ([`DeviceEmbeddingBag`]), or in
//! pinned host memory behind a GPU cache of hot rows for the tables over a memory budget
//! ([`DeviceCachedEmbeddingBag`]; `tilearn ctr train --gpu-embedding-budget`). The training
//! step is the same either way: a batch is uploaded (through the cache's slot map when there
//! is one), pooled, and its rows updated inside the backward.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};

use super::cached_bag::DeviceCachedEmbeddingBag;
use super::embedding_bag::{DeviceEmbeddingBag, DeviceJaggedBatch};
use crate::cache::RowCacheReport;
use crate::error::Result;
use crate::jagged::JaggedBatch;
use crate::sparse_optim::SparseState;
use crate::tables::EmbeddingTables;

/// A device model's embedding rows.
// One per model, never moved in a hot loop: the variants' size difference costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum DeviceRows {
    /// Every row on the GPU.
    Whole(DeviceEmbeddingBag),
    /// Rows in pinned host memory, hot ones cached on the GPU.
    Cached(DeviceCachedEmbeddingBag),
}

impl DeviceRows {
    /// Every row of `tables` on the device of `stream`.
    pub fn whole(
        stream: &Arc<CudaStream>,
        tables: &EmbeddingTables,
        state: &SparseState,
    ) -> Result<Self> {
        Ok(DeviceRows::Whole(DeviceEmbeddingBag::new(
            stream, tables, state,
        )?))
    }

    /// `tables` in pinned host memory behind a device cache of `slots[t]` rows of table `t`
    /// (a table given all its rows lives on the device whole).
    pub fn cached(
        stream: &Arc<CudaStream>,
        tables: EmbeddingTables,
        state: SparseState,
        slots: &[usize],
    ) -> Result<Self> {
        Ok(DeviceRows::Cached(DeviceCachedEmbeddingBag::new(
            stream, tables, state, slots,
        )?))
    }

    /// Columns of the pooled output (the sum of the tables' dims).
    pub fn width(&self) -> usize {
        match self {
            DeviceRows::Whole(bag) => bag.layout().total_dim(),
            DeviceRows::Cached(bag) => bag.layout().total_dim(),
        }
    }

    /// Optimizer steps taken.
    pub fn step(&self) -> u64 {
        match self {
            DeviceRows::Whole(bag) => bag.step(),
            DeviceRows::Cached(bag) => bag.step(),
        }
    }

    /// Uploads `jagged` (ids of the model's tables); with a cache, its rows are brought in
    /// first and, when `training`, marked as changed by the step that follows.
    pub fn upload(
        &mut self,
        stream: &Arc<CudaStream>,
        jagged: &JaggedBatch,
        training: bool,
    ) -> Result<DeviceJaggedBatch> {
        match self {
            DeviceRows::Whole(bag) => DeviceJaggedBatch::upload(stream, bag.layout(), jagged),
            DeviceRows::Cached(bag) => bag.map_batch(stream, jagged, training),
        }
    }

    pub fn forward(
        &self,
        stream: &Arc<CudaStream>,
        batch: &DeviceJaggedBatch,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        match self {
            DeviceRows::Whole(bag) => bag.forward(stream, batch, out),
            DeviceRows::Cached(bag) => bag.forward(stream, batch, out),
        }
    }

    pub fn backward_update(
        &mut self,
        stream: &Arc<CudaStream>,
        batch: &DeviceJaggedBatch,
        dout: &impl DevicePtr<f32>,
    ) -> Result<()> {
        match self {
            DeviceRows::Whole(bag) => bag.backward_update(stream, batch, dout),
            DeviceRows::Cached(bag) => bag.backward_update(stream, batch, dout),
        }
    }

    /// Every table's weights and state buffers on the host (a cache writes its changed rows
    /// back first).
    pub fn download(&mut self, stream: &Arc<CudaStream>) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        match self {
            DeviceRows::Whole(bag) => bag.download(stream),
            DeviceRows::Cached(bag) => bag.download(stream),
        }
    }

    /// The cache's counts and traffic so far (`None` without a cache).
    pub fn cache_report(&mut self) -> Result<Option<RowCacheReport>> {
        match self {
            DeviceRows::Whole(_) => Ok(None),
            DeviceRows::Cached(bag) => bag.report().map(Some),
        }
    }
}
