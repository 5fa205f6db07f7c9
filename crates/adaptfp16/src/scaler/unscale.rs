//! The device side of unscaling: one fused pass that multiplies every gradient by `inv_scale`
//! and raises a found-inf flag, behind a trait so `tilearn-ops` can implement it for CUDA
//! buffers while this crate stays free of CUDA.
//!
//! # Contract (what every backend must do, bit for bit)
//!
//! This is `torch._amp_foreach_non_finite_check_and_unscale_`:
//!
//! * for every element `g` of every gradient tensor of the step: if `g` is not finite (±inf or
//!   NaN) *before* the multiply, raise the flag; then write `g * inv_scale`, one IEEE f32
//!   multiply rounded to nearest (no FMA, no fast-math reciprocal). When `inv_scale == 1.0` the
//!   gradient is left untouched, which lets a backend skip the writes (the check-only pass of the
//!   fused-optimizer path, see [`crate::GradScaler::check_for_fused_step`]).
//! * Every element is multiplied even when a non-finite value was found: torch does the same,
//!   and the step is skipped anyway.
//! * A finite `g` whose product overflows is *not* flagged (torch checks the input only).
//! * `unscale_and_check` starts a new step: it clears the flag before the pass (torch allocates
//!   a fresh zero `found_inf` tensor per `unscale_`).
//!
//! # Where the flag lives
//!
//! On the GPU the flag is a device word that the pass writes and the fused optimizer reads
//! (skip the update when it is set), so the step itself needs no host synchronisation.
//! `unscale_and_check` returns nothing to the host. The host learns the flag once per step, in
//! [`crate::GradScaler::update`], through [`UnscaleTarget::found_inf`] (one 4-byte device-to-host
//! copy on the stream, after the optimizer kernel has been enqueued). A CPU backend just keeps a
//! `bool`.

use crate::error::{BackendError, Result};

/// A set of gradient tensors that can be unscaled in one fused pass. See the module docs for the
/// exact element-wise contract.
pub trait UnscaleTarget {
    /// Clear the step's found-inf flag, then for every element: flag non-finite inputs and write
    /// `g * inv_scale` (f32 multiply; untouched when `inv_scale == 1.0`). Device backends enqueue
    /// the work and return without synchronising.
    fn unscale_and_check(&mut self, inv_scale: f32) -> Result<(), BackendError>;

    /// Whether the last `unscale_and_check` saw a non-finite input. On a device this is the one
    /// host synchronisation of an fp16 step; [`crate::GradScaler`] calls it at most once per step.
    fn found_inf(&mut self) -> Result<bool, BackendError>;
}

/// The reference element-wise pass over one f32 slice: multiplies in place and returns whether
/// any input element was non-finite. CPU backends and the CUDA tests' oracle both use it.
pub fn unscale_and_check_slice(grads: &mut [f32], inv_scale: f32) -> bool {
    // `!is_finite` is checked on the input, before the multiply, like torch. The flag is OR-ed
    // with no early exit, so the loop stays branch-free and every element is still unscaled.
    let mut found = false;
    if inv_scale == 1.0 {
        for &g in grads.iter() {
            found |= !g.is_finite();
        }
    } else {
        for g in grads.iter_mut() {
            found |= !g.is_finite();
            *g *= inv_scale;
        }
    }
    found
}

/// CPU gradients: any number of `&mut [f32]` tensors and a host-side flag.
#[derive(Debug, Default)]
pub struct CpuGrads<'a> {
    tensors: Vec<&'a mut [f32]>,
    found_inf: bool,
}

impl<'a> CpuGrads<'a> {
    pub fn new(tensors: Vec<&'a mut [f32]>) -> Self {
        CpuGrads {
            tensors,
            found_inf: false,
        }
    }

    /// One flat gradient buffer (how the engine keeps its gradients).
    pub fn flat(grads: &'a mut [f32]) -> Self {
        CpuGrads::new(vec![grads])
    }

    pub fn tensors(&self) -> &[&'a mut [f32]] {
        &self.tensors
    }
}

impl UnscaleTarget for CpuGrads<'_> {
    fn unscale_and_check(&mut self, inv_scale: f32) -> Result<(), BackendError> {
        self.found_inf = false;
        for t in self.tensors.iter_mut() {
            self.found_inf |= unscale_and_check_slice(t, inv_scale);
        }
        Ok(())
    }

    fn found_inf(&mut self) -> Result<bool, BackendError> {
        Ok(self.found_inf)
    }
}
