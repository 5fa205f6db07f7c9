//! The reductions that complete a tensor-parallel rank's partial results.
//!
//! Under Megatron-style tensor parallelism a rank holds a slice of every large matrix, so some
//! results are partial sums over the group (a row-parallel product's output, a column-parallel
//! product's input gradient, a vocabulary slice's embedding lookup) and the cross entropy needs
//! the row maxima and sums over all vocabulary slices. The model code calls these at exactly
//! those points; [`Whole`], the model in one piece, makes them no-ops, so the single-process path
//! computes exactly what it did before tensor parallelism existed.

use crate::error::{EngineError, Result};

/// Completes partial results across the ranks that share one model replica's layers.
pub trait PartialSums<R> {
    /// Number of ranks the model is split over (1 for [`Whole`]).
    fn parts(&self) -> usize;
    /// Sums `buf` elementwise over the ranks, in place; every rank gets the same bits.
    fn sum(&self, buf: &mut [R]) -> Result<()>;
    /// Elementwise maximum over the ranks, in place.
    fn max(&self, buf: &mut [R]) -> Result<()>;
    /// This rank's place among the [`parts`](Self::parts).
    fn rank(&self) -> usize {
        0
    }
    /// Sequence parallelism's reduce-scatter, in place: `buf` holds `parts()` equal chunks of
    /// rows, partial on every rank; afterwards the front chunk of `buf` is this rank's chunk of
    /// the sum over the ranks (the rest is left unspecified).
    fn reduce_scatter_front(&self, buf: &mut [R]) -> Result<()> {
        let _ = buf;
        one_part_only(self.parts(), "reduce-scatter")
    }
    /// Sequence parallelism's all-gather, in place: the front chunk of `buf` is this rank's;
    /// afterwards `buf` holds every rank's chunk, in rank order.
    fn all_gather_front(&self, buf: &mut [R]) -> Result<()> {
        let _ = buf;
        one_part_only(self.parts(), "all-gather")
    }
}

/// The default row collectives: the identity for one part, else an error (the implementation
/// has none).
fn one_part_only(parts: usize, what: &str) -> Result<()> {
    if parts == 1 {
        return Ok(());
    }
    Err(EngineError::InvalidArgument {
        argument: "--sequence-parallel".into(),
        message: format!("internal: these partial sums cannot {what} rows"),
    })
}

/// How a layer's row activations are held over the tensor-parallel ranks: all rows on every
/// rank (row-parallel outputs completed by an all-reduce), or with sequence parallelism
/// (Megatron-SP) each rank's chunk of the rows — the norms' inputs and outputs and the residual
/// stream — kept at the front of the row buffers, all-gathered before the column-parallel
/// products and reduce-scattered after the row-parallel ones.
pub(crate) struct RowSplit<'a, R> {
    pub sums: &'a dyn PartialSums<R>,
    pub sequence: bool,
}

impl<R> Clone for RowSplit<'_, R> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<R> Copy for RowSplit<'_, R> {}

impl<R: Copy> RowSplit<'_, R> {
    /// The rows this rank holds of `n`.
    pub fn local_rows(&self, n: usize) -> Result<usize> {
        let parts = self.sums.parts();
        if !self.sequence || parts == 1 {
            return Ok(n);
        }
        if !n.is_multiple_of(parts) {
            return Err(EngineError::InvalidArgument {
                argument: "--sequence-parallel".into(),
                message: format!(
                    "splits a batch's {n} token rows (batch × sequence length) over {parts} \
                     tensor-parallel ranks, which needs them to divide; choose a batch size or \
                     --seq-len with batch × seq divisible by {parts}"
                ),
            });
        }
        Ok(n / parts)
    }

    /// A row-parallel product's output `buf` (all rows, partial on each rank) completed: every
    /// row (all-reduce), or this rank's rows at the front (reduce-scatter).
    pub fn complete(&self, buf: &mut [R]) -> Result<()> {
        if self.sequence {
            self.sums.reduce_scatter_front(buf)
        } else {
            self.sums.sum(buf)
        }
    }

    /// Before a column-parallel product: every row of `buf` (this rank's at the front).
    pub fn gather(&self, buf: &mut [R]) -> Result<()> {
        if self.sequence {
            self.sums.all_gather_front(buf)
        } else {
            Ok(())
        }
    }

    /// Every row of `rows` (this rank's at the front under sequence parallelism): `rows`
    /// itself, or gathered into `scratch` (as long as `rows`).
    pub fn gathered<'b>(&self, rows: &'b [R], scratch: &'b mut [R]) -> Result<&'b [R]> {
        if !self.sequence {
            return Ok(rows);
        }
        let local = rows.len() / self.sums.parts();
        scratch[..local].copy_from_slice(&rows[..local]);
        self.sums.all_gather_front(&mut scratch[..rows.len()])?;
        let scratch: &'b [R] = scratch;
        Ok(&scratch[..rows.len()])
    }
}

/// The model in one piece: nothing to complete.
#[derive(Clone, Copy, Debug, Default)]
pub struct Whole;

impl<R> PartialSums<R> for Whole {
    fn parts(&self) -> usize {
        1
    }

    fn sum(&self, _: &mut [R]) -> Result<()> {
        Ok(())
    }

    fn max(&self, _: &mut [R]) -> Result<()> {
        Ok(())
    }
}
