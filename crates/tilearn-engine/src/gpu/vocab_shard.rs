//! A vocabulary-parallel rank's slice of the vocabulary and the per-row statistics of its
//! cross entropy on the device (see `vocab_parallel.rs` for the whole scheme): f32 buffers of a
//! chunk's rows allocated when the slice is set — the local and the global row maxima, and
//! `[sum of exp | target logit]` adjacent, so that one all-reduce completes both — and the two
//! statistics steps with their all-reduces.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use tilearn_ops::cpu::VocabSlice;
use tilearn_ops::cuda::{self as k, CudaStream, DeviceFloat};

use super::tensor_parallel::{DeviceSums, complete, complete_max};
use super::{cuda_err, invalid};
use crate::error::Result;

/// A rank's rows of the vocabulary and the per-row statistics of its cross entropy.
#[derive(Debug)]
pub(crate) struct VocabShard {
    pub slice: VocabSlice,
    /// Chunks of up to this many tokens.
    rows: usize,
    local_max: CudaSlice<f32>,
    global_max: CudaSlice<f32>,
    /// `[2 × rows]`: the sums of exponentials, then the target logits.
    sums: CudaSlice<f32>,
}

/// The statistics of a chunk of `rows` tokens, carved from the shard's buffers.
pub(super) struct ChunkStats<'b> {
    rows: usize,
    local_max: CudaViewMut<'b, f32>,
    global_max: CudaViewMut<'b, f32>,
    sums: CudaViewMut<'b, f32>,
}

impl VocabShard {
    pub(super) fn new(stream: &Arc<CudaStream>, slice: VocabSlice, rows: usize) -> Result<Self> {
        let alloc = |n: usize| {
            stream
                .alloc_zeros::<f32>(n)
                .map_err(|e| cuda_err("allocating the vocabulary-parallel statistics", e))
        };
        Ok(VocabShard {
            slice,
            rows,
            local_max: alloc(rows)?,
            global_max: alloc(rows)?,
            sums: alloc(2 * rows)?,
        })
    }

    pub(super) fn bytes(&self) -> usize {
        4 * self.rows * std::mem::size_of::<f32>()
    }

    pub(super) fn carve(&mut self, rows: usize) -> Result<ChunkStats<'_>> {
        if rows > self.rows {
            return Err(invalid(
                "vocabulary-parallel loss head",
                format!(
                    "internal: a chunk of {rows} tokens exceeds the {} the statistics hold",
                    self.rows
                ),
            ));
        }
        Ok(ChunkStats {
            rows,
            local_max: self.local_max.slice_mut(..rows),
            global_max: self.global_max.slice_mut(..rows),
            sums: self.sums.slice_mut(..2 * rows),
        })
    }
}

impl ChunkStats<'_> {
    /// Steps 1–2 with their all-reduces: every rank ends with the same global max, sum of
    /// exponentials and target logit per row.
    pub(super) fn complete<T: DeviceFloat>(
        &mut self,
        stream: &Arc<CudaStream>,
        tp: Option<&dyn DeviceSums>,
        logits: &CudaView<'_, T>,
        targets: &CudaView<'_, i32>,
        slice: VocabSlice,
    ) -> Result<()> {
        let rows = self.rows;
        {
            let (mut sumexp, mut target) = self.sums.split_at_mut(rows);
            k::vocab_ce_partials(
                stream,
                logits,
                targets,
                slice,
                &mut self.local_max,
                &mut sumexp,
                &mut target,
            )?;
        }
        stream
            .memcpy_dtod(&self.local_max, &mut self.global_max)
            .map_err(|e| cuda_err("copying the row maxima", e))?;
        complete_max(tp, &mut self.global_max)?;
        {
            let mut sumexp = self.sums.slice_mut(..rows);
            k::vocab_ce_rescale(stream, &self.local_max, &self.global_max, &mut sumexp)?;
        }
        complete(tp, &mut self.sums)
    }

    /// The completed statistics: global max, sums of exponentials, target logits.
    pub(super) fn completed(&self) -> (CudaView<'_, f32>, CudaView<'_, f32>, CudaView<'_, f32>) {
        let rows = self.rows;
        (
            self.global_max.slice(..),
            self.sums.slice(..rows),
            self.sums.slice(rows..2 * rows),
        )
    }
}
