//! Wrappers of tilearn-kernels' `reduce.cu`: the global L2 norm of a flat gradient buffer (same
//! result as [`crate::cpu::global_norm`], every square and sum in f64, deterministic) and the
//! GradScaler's fused unscale + non-finite check (same as [`crate::cpu::unscale_and_check`],
//! with the scale and the flag in device memory so the step needs no host round trip). Both are
//! generic over the buffer's [`DeviceFloat`] type (f32, bf16, f16).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use tilearn_kernels::ffi;

use super::DeviceFloat;
use super::launch::{Launch, same_device};
use crate::{OpsError, Result};

/// Scratch and results of [`global_norm`], allocated once (for any buffer length and element
/// type) and reused every step: the per-block partial sums, the f64 sum of squares and the f32
/// norm, all in device memory.
#[derive(Debug)]
pub struct NormWorkspace {
    partials: CudaSlice<f64>,
    sum_sq: CudaSlice<f64>,
    norm: CudaSlice<f32>,
}

impl NormWorkspace {
    /// Allocates the workspace on `stream`'s device. Until a launch writes them, the results
    /// read as NaN.
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        let alloc_err = |e: cudarc::driver::DriverError| OpsError::Cuda {
            context: "NormWorkspace::new",
            message: format!("cannot allocate the norm workspace: {e}"),
        };
        // SAFETY: a pure function of its argument (no device access). usize::MAX gives the
        // largest count any length can need.
        let partials_len = unsafe { ffi::tilearn_global_norm_partials_len(usize::MAX) };
        // SAFETY: the partials kernel writes each partial it uses before the finishing kernel
        // reads it; unused entries are never read, so the uninitialised contents are never
        // observed.
        let partials = unsafe { stream.alloc::<f64>(partials_len) }.map_err(alloc_err)?;
        let sum_sq = stream.clone_htod(&[f64::NAN]).map_err(alloc_err)?;
        let norm = stream.clone_htod(&[f32::NAN]).map_err(alloc_err)?;
        Ok(NormWorkspace {
            partials,
            sum_sq,
            norm,
        })
    }

    /// The last launch's `sqrt(sum x²)` as a one-element f32 device buffer (for a device-side
    /// clip coefficient).
    pub fn norm(&self) -> &CudaSlice<f32> {
        &self.norm
    }

    /// The last launch's `sum x²` as a one-element f64 device buffer (what a data- or
    /// tensor-parallel run all-reduces before taking the square root).
    pub fn sum_sq(&self) -> &CudaSlice<f64> {
        &self.sum_sq
    }

    /// Copies the last launch's sum of squares to the host. Cost: an 8-byte device-to-host copy
    /// and a synchronisation of `stream` (the host waits for all work queued on it so far).
    pub fn read_sum_sq(&self, stream: &Arc<CudaStream>) -> Result<f64> {
        read_one(stream, "NormWorkspace::read_sum_sq", &self.sum_sq)
    }

    /// Copies the last launch's norm (f32) to the host; same cost as
    /// [`read_sum_sq`](Self::read_sum_sq).
    pub fn read_norm(&self, stream: &Arc<CudaStream>) -> Result<f32> {
        read_one(stream, "NormWorkspace::read_norm", &self.norm)
    }
}

fn read_one<T: cudarc::driver::DeviceRepr + Copy>(
    stream: &Arc<CudaStream>,
    op: &'static str,
    buf: &CudaSlice<T>,
) -> Result<T> {
    same_device(stream, op, "workspace", buf)?;
    let host = stream.clone_dtoh(buf).map_err(|e| OpsError::Cuda {
        context: op,
        message: format!("device-to-host copy failed: {e}"),
    })?;
    stream.synchronize().map_err(|e| OpsError::Cuda {
        context: op,
        message: e.to_string(),
    })?;
    host.first().copied().ok_or(OpsError::ShapeMismatch {
        op,
        expected: 1,
        actual: 0,
    })
}

/// Global L2 norm of a flat buffer of any [`DeviceFloat`] type: writes (`=`) `sum x²` (f64)
/// and its square root (f32) into `ws` (see [`NormWorkspace::norm`] /
/// [`NormWorkspace::sum_sq`]). Each element is widened exactly, and every square and sum is
/// formed in f64 in a fixed order: deterministic, no error growing with the length and no
/// overflow of the squares. An empty buffer gives 0; an inf/NaN element gives inf/NaN.
pub fn global_norm<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    x: &impl DevicePtr<T>,
    ws: &mut NormWorkspace,
) -> Result<()> {
    let n = x.len();
    // The workspace's three buffers were allocated together on one stream.
    let partials_len = ws.partials.len();
    Launch::new("tilearn_global_norm", stream)
        .input("x", x, n)
        .workspace("workspace", &mut ws.partials)
        .output("workspace", &mut ws.sum_sq, 1)
        .output("workspace", &mut ws.norm, 1)
        .run(|[x], [partials, sum_sq, norm], stream| {
            // SAFETY: the launcher reads `n` elements of T (`T::DTYPE`) from x, writes one f64
            // to sum_sq and one f32 to norm, and uses at most `partials_len` f64 of partials (it
            // returns an error rather than overrun when `n` needs more).
            unsafe {
                ffi::tilearn_global_norm(
                    T::DTYPE,
                    x,
                    n,
                    partials.cast(),
                    partials_len,
                    sum_sq.cast(),
                    norm.cast(),
                    stream,
                )
            }
        })
}

/// GradScaler unscale of gradients of any [`DeviceFloat`] type, in place (`=`):
/// `grads[i] *= inv_scale[0]`, the product formed in f32 and rounded once (to nearest even) to
/// `T` (exact when `inv_scale` is a power of two and the result is normal), and
/// `found_inf[0] = 1.0` if any gradient was inf or NaN before the multiply. `found_inf` is only
/// ever set, never cleared (zero it once per step, before the first buffer), as
/// `torch._amp_foreach_non_finite_check_and_unscale_` does; both scalars are one-element device
/// buffers, so the step needs no host round trip. An empty `grads` launches nothing.
pub fn unscale_check<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    grads: &mut impl DevicePtrMut<T>,
    inv_scale: &impl DevicePtr<f32>,
    found_inf: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    let n = grads.len();
    Launch::new("tilearn_unscale_check", stream)
        .output("grads", grads, n)
        .input("inv_scale", inv_scale, 1)
        .output("found_inf", found_inf, 1)
        .skip_launch_if(n == 0)
        .run(|[inv_scale], [grads, found_inf], stream| {
            // SAFETY: the launcher reads and writes `n` elements of T (`T::DTYPE`) of grads,
            // reads one f32 of inv_scale and may write one f32 of found_inf.
            unsafe {
                ffi::tilearn_unscale_check(
                    T::DTYPE,
                    grads,
                    n,
                    inv_scale.cast(),
                    found_inf.cast(),
                    stream,
                )
            }
        })
}
