//! Device-resident tables and batches, and the safe wrappers of the fused embedding-bag
//! launchers: [`DeviceEmbeddingBag::forward`] and [`DeviceEmbeddingBag::backward_update`] compute
//! what [`crate::embedding_bag_forward`] and [`crate::embedding_bag_backward_update`] compute on
//! the CPU (bit for bit for the forward, SGD and SparseAdam; row-wise Adagrad differs in the
//! rounding of its per-row sum of squares).
//!
//! The kernels trust two invariants they cannot check without a host round trip: the offsets
//! partition the ids and every id is inside its table. Both hold by construction here: a
//! [`DeviceJaggedBatch`] is only made by uploading a checked [`JaggedBatch`], and it remembers the
//! table layout it was checked against, which every launch compares with its own.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use tilearn_kernels::ffi;
use tilearn_ops::OpsError;
use tilearn_ops::cuda::launch::{Launch, bind};

use crate::error::{RecsysError, Result};
use crate::jagged::JaggedBatch;
use crate::sparse_optim::{RowRule, SparseOptimizer, SparseState};
use crate::tables::{EmbeddingTables, TableLayout};

fn driver(context: &'static str) -> impl Fn(cudarc::driver::DriverError) -> RecsysError {
    move |e| {
        RecsysError::Ops(OpsError::Cuda {
            context,
            message: e.to_string(),
        })
    }
}

// The CPU reference sums a row's gradient in the kernel's chunked order.
const _: () = assert!(crate::embedding_bag::GRAD_CHUNK == ffi::TILEARN_BAG_GRAD_CHUNK as usize);

/// The widest table's dim: the row width of the backward's chunk-sum scratch.
fn max_dim(layout: &TableLayout) -> usize {
    layout.specs().iter().map(|s| s.dim).max().unwrap_or(0)
}

/// A checked [`JaggedBatch`] on the device.
#[derive(Debug)]
pub struct DeviceJaggedBatch {
    layout: TableLayout,
    batch: usize,
    entries: usize,
    offsets: CudaSlice<u32>,
    ids: CudaSlice<u32>,
}

impl DeviceJaggedBatch {
    /// Uploads `batch`, whose ids were checked against `layout` when it was built.
    pub fn upload(
        stream: &Arc<CudaStream>,
        layout: &TableLayout,
        batch: &JaggedBatch,
    ) -> Result<Self> {
        batch.check_layout(layout)?;
        let err = driver("DeviceJaggedBatch::upload");
        // The driver refuses empty allocations: an empty batch keeps one id that no offset
        // reaches.
        let ids: &[u32] = if batch.ids().is_empty() {
            &[0]
        } else {
            batch.ids()
        };
        Ok(DeviceJaggedBatch {
            layout: layout.clone(),
            batch: batch.batch(),
            entries: batch.ids().len(),
            offsets: stream.clone_htod(batch.offsets()).map_err(&err)?,
            ids: stream.clone_htod(ids).map_err(&err)?,
        })
    }

    pub fn batch(&self) -> usize {
        self.batch
    }

    pub fn entries(&self) -> usize {
        self.entries
    }
}

/// Fused embedding-bag tables on the device: weights, their sparse-optimizer state and the
/// backward's scratch (grown when a batch needs more, so steady-state steps allocate nothing).
#[derive(Debug)]
pub struct DeviceEmbeddingBag {
    layout: TableLayout,
    optimizer: SparseOptimizer,
    step: u64,
    weights: CudaSlice<f32>,
    /// `TILEARN_BAG_TABLE_WORDS` u32 per table.
    tables: CudaSlice<u32>,
    state1: CudaSlice<f32>,
    state2: CudaSlice<f32>,
    scratch: CudaSlice<u8>,
}

/// The launcher's per-table words (`TILEARN_BAG_TABLE_*` in tilearn_kernels.h).
fn table_words(layout: &TableLayout) -> Vec<u32> {
    let per_table = ffi::TILEARN_BAG_TABLE_WORDS as usize;
    let mut words = vec![0u32; layout.num_tables() * per_table];
    for (t, spec) in layout.specs().iter().enumerate() {
        let w = &mut words[t * per_table..(t + 1) * per_table];
        let offset = layout.weight_offset()[t] as u64;
        // TableLayout keeps rows, stacked rows, dims and columns below 2^32.
        w[ffi::TILEARN_BAG_TABLE_ROWS as usize] = spec.rows as u32;
        w[ffi::TILEARN_BAG_TABLE_DIM as usize] = spec.dim as u32;
        w[ffi::TILEARN_BAG_TABLE_POOLING as usize] = u32::from(spec.pooling.code());
        w[ffi::TILEARN_BAG_TABLE_COL_OFFSET as usize] = layout.col_offset()[t] as u32;
        w[ffi::TILEARN_BAG_TABLE_ROW_BASE as usize] = layout.row_base()[t] as u32;
        w[ffi::TILEARN_BAG_TABLE_WEIGHT_OFFSET_LO as usize] = offset as u32;
        w[ffi::TILEARN_BAG_TABLE_WEIGHT_OFFSET_HI as usize] = (offset >> 32) as u32;
    }
    words
}

/// The launcher's form of a step's rule (fields a rule does not use stay 0).
fn ffi_rule(rule: RowRule) -> ffi::tilearn_sparse_rule {
    let mut r = ffi::tilearn_sparse_rule {
        kind: 0,
        neg_lr: 0.0,
        lr: 0.0,
        eps: 0.0,
        one_minus_beta1: 0.0,
        one_minus_beta2: 0.0,
        neg_step_size: 0.0,
    };
    match rule {
        RowRule::Sgd { neg_lr } => {
            r.kind = ffi::TILEARN_SPARSE_SGD as i32;
            r.neg_lr = neg_lr;
        }
        RowRule::RowWiseAdagrad { lr, eps } => {
            r.kind = ffi::TILEARN_SPARSE_ROWWISE_ADAGRAD as i32;
            r.lr = lr;
            r.eps = eps;
        }
        RowRule::Adam {
            one_minus_beta1,
            one_minus_beta2,
            neg_step_size,
            eps,
        } => {
            r.kind = ffi::TILEARN_SPARSE_ADAM as i32;
            r.one_minus_beta1 = one_minus_beta1;
            r.one_minus_beta2 = one_minus_beta2;
            r.neg_step_size = neg_step_size;
            r.eps = eps;
        }
    }
    r
}

/// A host buffer uploaded, or one unused element when empty (the driver refuses empty
/// allocations; the launcher never reads a state its rule does not use).
fn upload_or_placeholder(stream: &Arc<CudaStream>, values: &[f32]) -> Result<CudaSlice<f32>> {
    let values: &[f32] = if values.is_empty() { &[0.0] } else { values };
    stream
        .clone_htod(values)
        .map_err(driver("DeviceEmbeddingBag::new"))
}

impl DeviceEmbeddingBag {
    /// Uploads `tables` and the optimizer `state` (its step count continues on the device).
    pub fn new(
        stream: &Arc<CudaStream>,
        tables: &EmbeddingTables,
        state: &SparseState,
    ) -> Result<Self> {
        let layout = tables.layout.clone();
        state.check_layout(&layout)?;
        let err = driver("DeviceEmbeddingBag::new");
        Ok(DeviceEmbeddingBag {
            weights: stream.clone_htod(&tables.weights).map_err(&err)?,
            tables: stream.clone_htod(&table_words(&layout)).map_err(&err)?,
            state1: upload_or_placeholder(stream, state.state1())?,
            state2: upload_or_placeholder(stream, state.state2())?,
            scratch: stream.alloc_zeros::<u8>(1).map_err(&err)?,
            optimizer: *state.optimizer(),
            step: state.step(),
            layout,
        })
    }

    pub fn layout(&self) -> &TableLayout {
        &self.layout
    }

    /// Optimizer steps taken.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Changes the learning rate of later steps.
    pub fn set_lr(&mut self, lr: f32) -> Result<()> {
        self.optimizer = self.optimizer.with_lr(lr)?;
        Ok(())
    }

    /// The weights and the state buffers (empty where the optimizer has none), copied to the
    /// host.
    pub fn download(&self, stream: &Arc<CudaStream>) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let err = driver("DeviceEmbeddingBag::download");
        let weights = stream.clone_dtoh(&self.weights).map_err(&err)?;
        let (uses1, uses2) = self.optimizer.state_buffers();
        let state1 = if uses1 {
            stream.clone_dtoh(&self.state1).map_err(&err)?
        } else {
            Vec::new()
        };
        let state2 = if uses2 {
            stream.clone_dtoh(&self.state2).map_err(&err)?
        } else {
            Vec::new()
        };
        Ok((weights, state1, state2))
    }

    /// The weights and both state buffers (placeholders of one element where the rule keeps
    /// none): for a row cache's whole-row copies.
    pub(crate) fn buffers_mut(
        &mut self,
    ) -> (
        &mut CudaSlice<f32>,
        &mut CudaSlice<f32>,
        &mut CudaSlice<f32>,
    ) {
        (&mut self.weights, &mut self.state1, &mut self.state2)
    }

    fn check_batch(&self, batch: &DeviceJaggedBatch) -> Result<()> {
        if batch.layout != self.layout {
            return Err(RecsysError::invalid(
                "device jagged batch",
                "it was checked against another table layout; upload it for these tables",
            ));
        }
        Ok(())
    }

    /// Pools every bag of `batch` into `out` (`[batch, total_dim]` f32, written `=`).
    pub fn forward(
        &self,
        stream: &Arc<CudaStream>,
        batch: &DeviceJaggedBatch,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        self.check_batch(batch)?;
        let layout = &self.layout;
        let (num_tables, total_dim, rows) = (layout.num_tables(), layout.total_dim(), batch.batch);
        Launch::new("tilearn_embedding_bag_forward", stream)
            .input("weights", &self.weights, layout.total_elements())
            .input("tables", &self.tables, self.tables.len())
            .input("offsets", &batch.offsets, num_tables * rows + 1)
            .input("ids", &batch.ids, batch.ids.len())
            .output("out", out, rows * total_dim)
            .skip_launch_if(rows == 0)
            .run(|[weights, tables, offsets, ids], [out], stream| {
                // SAFETY: the launcher reads the weights and the per-table words of num_tables
                // tables, num_tables * rows + 1 offsets and the ids they delimit (every id inside
                // its table: the batch was checked against this layout), and writes rows *
                // total_dim f32 to out.
                unsafe {
                    ffi::tilearn_embedding_bag_forward(
                        weights.cast(),
                        tables.cast(),
                        num_tables,
                        total_dim,
                        offsets.cast(),
                        ids.cast(),
                        rows,
                        out.cast(),
                        stream,
                    )
                }
            })?;
        Ok(())
    }

    /// Bytes of scratch the backward needs for `entries` ids.
    fn scratch_bytes(&self, stream: &Arc<CudaStream>, entries: usize) -> Result<usize> {
        bind(stream, "tilearn_embedding_bag_backward_scratch_bytes")?;
        let max_dim = max_dim(&self.layout);
        // SAFETY: asks CUB for its temporary-storage sizes on the current device (bound above);
        // reads and writes no memory.
        let bytes = unsafe {
            ffi::tilearn_embedding_bag_backward_scratch_bytes(
                entries,
                self.layout.total_rows(),
                max_dim,
            )
        };
        if bytes == usize::MAX {
            return Err(RecsysError::invalid(
                "embedding-bag batch",
                format!(
                    "cannot size the backward's scratch for {entries} ids (at most 2^31 - 1) \
                     over tables at most {max_dim} wide (at most 2^24)"
                ),
            ));
        }
        Ok(bytes)
    }

    /// The backward of [`forward`](Self::forward) fused with one optimizer step: every row that
    /// occurs in `batch` is updated in place from its summed gradient in `dout` (`[batch,
    /// total_dim]`), with its state; nothing else changes.
    pub fn backward_update(
        &mut self,
        stream: &Arc<CudaStream>,
        batch: &DeviceJaggedBatch,
        dout: &impl DevicePtr<f32>,
    ) -> Result<()> {
        self.check_batch(batch)?;
        let need = if batch.entries == 0 {
            0
        } else {
            self.scratch_bytes(stream, batch.entries)?
        };
        if self.scratch.len() < need {
            self.scratch = stream
                .alloc_zeros::<u8>(need)
                .map_err(driver("DeviceEmbeddingBag::backward_update"))?;
        }
        self.step += 1;
        let rule = ffi_rule(RowRule::new(&self.optimizer, self.step));
        let layout = &self.layout;
        let (num_tables, total_rows, total_dim, max_dim) = (
            layout.num_tables(),
            layout.total_rows(),
            layout.total_dim(),
            max_dim(layout),
        );
        let (rows, entries, have) = (batch.batch, batch.entries, self.scratch.len());
        let (len1, len2) = (self.state1.len(), self.state2.len());
        Launch::new("tilearn_embedding_bag_backward_update", stream)
            .input("tables", &self.tables, self.tables.len())
            .input("offsets", &batch.offsets, num_tables * rows + 1)
            .input("ids", &batch.ids, batch.ids.len())
            .input("dout", dout, rows * total_dim)
            .output("weights", &mut self.weights, layout.total_elements())
            .output("state1", &mut self.state1, len1)
            .output("state2", &mut self.state2, len2)
            .workspace("scratch", &mut self.scratch)
            .skip_launch_if(entries == 0)
            .run(
                |[tables, offsets, ids, dout], [weights, state1, state2, scratch], stream| {
                    // SAFETY: the launcher reads the per-table words, the offsets and the
                    // `entries` ids they delimit (each inside its table: the batch was checked
                    // against this layout) and rows * total_dim f32 of dout; it updates in place
                    // only the touched rows of the weights and of the state its rule uses
                    // (state1: one f32 per stacked row or per element, state2: one per element,
                    // as SparseState sized them), and uses at most `have` bytes of scratch, at
                    // least its need (checked above).
                    unsafe {
                        ffi::tilearn_embedding_bag_backward_update(
                            weights.cast(),
                            state1.cast(),
                            state2.cast(),
                            tables.cast(),
                            num_tables,
                            total_rows,
                            total_dim,
                            max_dim,
                            offsets.cast(),
                            ids.cast(),
                            rows,
                            entries,
                            dout.cast(),
                            rule,
                            scratch,
                            have,
                            stream,
                        )
                    }
                },
            )?;
        Ok(())
    }
}
