//! The reductions that complete a tensor-parallel rank's partial results.
//!
//! Under Megatron-style tensor parallelism a rank holds a slice of every large matrix, so some
//! results are partial sums over the group (a row-parallel product's output, a column-parallel
//! product's input gradient, a vocabulary slice's embedding lookup) and the cross entropy needs
//! the row maxima and sums over all vocabulary slices. The model code calls these at exactly
//! those points; [`Whole`], the model in one piece, makes them no-ops, so the single-process path
//! computes exactly what it did before tensor parallelism existed.

use crate::error::Result;

/// Completes partial results across the ranks that share one model replica's layers.
pub trait PartialSums<R> {
    /// Number of ranks the model is split over (1 for [`Whole`]).
    fn parts(&self) -> usize;
    /// Sums `buf` elementwise over the ranks, in place; every rank gets the same bits.
    fn sum(&self, buf: &mut [R]) -> Result<()>;
    /// Elementwise maximum over the ranks, in place.
    fn max(&self, buf: &mut [R]) -> Result<()>;
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
