//! Wrappers of `kernels/reduce.cu`: the global L2 norm of a flat gradient buffer (same result
//! as [`crate::cpu::global_norm`], every square and sum in f64, deterministic) and the
//! GradScaler's fused unscale + non-finite check (same as [`crate::cpu::unscale_and_check`],
//! with the scale and the flag in device memory so the step needs no host round trip).

use std::ffi::c_int;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::{bf16, f16};

use super::ffi;
use super::launch::{bind, check, expect_len, raw_stream, same_device};
use crate::{OpsError, Result};

/// Scratch and results of [`global_norm_f32`] / [`global_norm_bf16`], allocated once (for any
/// buffer length) and reused every step: the per-block partial sums, the f64 sum of squares
/// and the f32 norm, all in device memory.
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

type NormLauncher<R> = unsafe extern "C" fn(
    *const R,
    usize,
    *mut f64,
    usize,
    *mut f64,
    *mut f32,
    ffi::cudaStream_t,
) -> c_int;
type UnscaleLauncher<R> =
    unsafe extern "C" fn(*mut R, usize, *const f32, *mut f32, ffi::cudaStream_t) -> c_int;

fn global_norm<T, R>(
    op: &'static str,
    launcher: NormLauncher<R>,
    stream: &Arc<CudaStream>,
    x: &impl DevicePtr<T>,
    ws: &mut NormWorkspace,
) -> Result<()> {
    const { assert!(size_of::<T>() == size_of::<R>()) };
    same_device(stream, op, "x", x)?;
    same_device(stream, op, "workspace", &ws.partials)?;
    let n = x.len();
    bind(stream, op)?;
    let (x_ptr, _x) = x.device_ptr(stream);
    let partials_len = ws.partials.len();
    let (partials_ptr, _partials) = ws.partials.device_ptr_mut(stream);
    let (sum_sq_ptr, _sum_sq) = ws.sum_sq.device_ptr_mut(stream);
    let (norm_ptr, _norm) = ws.norm.device_ptr_mut(stream);
    // SAFETY: every pointer is a live allocation of the stream's context (checked above; the
    // workspace's three buffers were allocated together on one stream). x holds n elements of
    // the FFI type's size; partials holds partials_len f64, which the launcher checks against
    // what n needs (it returns an error rather than overrun); sum_sq and norm hold one element
    // each. The workspace is borrowed mutably, so its buffers overlap neither x nor each other.
    // Work is enqueued on `stream` only; the guards order it after earlier writers and before
    // later users of these buffers.
    let status = unsafe {
        launcher(
            x_ptr as *const R,
            n,
            partials_ptr as *mut f64,
            partials_len,
            sum_sq_ptr as *mut f64,
            norm_ptr as *mut f32,
            raw_stream(stream),
        )
    };
    check(op, status)
}

fn unscale_check<T, R>(
    op: &'static str,
    launcher: UnscaleLauncher<R>,
    stream: &Arc<CudaStream>,
    grads: &mut impl DevicePtrMut<T>,
    inv_scale: &impl DevicePtr<f32>,
    found_inf: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    const { assert!(size_of::<T>() == size_of::<R>()) };
    expect_len(op, 1, inv_scale.len())?;
    expect_len(op, 1, found_inf.len())?;
    same_device(stream, op, "grads", grads)?;
    same_device(stream, op, "inv_scale", inv_scale)?;
    same_device(stream, op, "found_inf", found_inf)?;
    if grads.is_empty() {
        return Ok(());
    }
    bind(stream, op)?;
    let n = grads.len();
    let (grads_ptr, _grads) = grads.device_ptr_mut(stream);
    let (scale_ptr, _scale) = inv_scale.device_ptr(stream);
    let (found_ptr, _found) = found_inf.device_ptr_mut(stream);
    // SAFETY: every pointer is a live allocation of the stream's context (checked above): grads
    // holds n elements of the FFI type's size, inv_scale and found_inf one f32 each (checked
    // above). grads and found_inf are borrowed mutably, so they overlap neither each other nor
    // inv_scale. Work is enqueued on `stream` only and ordered by the guards.
    let status = unsafe {
        launcher(
            grads_ptr as *mut R,
            n,
            scale_ptr as *const f32,
            found_ptr as *mut f32,
            raw_stream(stream),
        )
    };
    check(op, status)
}

/// Global L2 norm of a flat f32 buffer: writes `sum x²` (f64) and `sqrt` of it (f32) into
/// `ws` (see [`NormWorkspace::norm`] / [`NormWorkspace::sum_sq`]); deterministic, f64
/// accumulation throughout. An empty buffer gives 0; an inf/NaN element gives inf/NaN.
pub fn global_norm_f32(
    stream: &Arc<CudaStream>,
    x: &impl DevicePtr<f32>,
    ws: &mut NormWorkspace,
) -> Result<()> {
    global_norm::<f32, f32>(
        "tilearn_global_norm_f32",
        ffi::tilearn_global_norm_f32,
        stream,
        x,
        ws,
    )
}

/// [`global_norm_f32`] of a bf16 buffer (each element widened exactly to f64).
pub fn global_norm_bf16(
    stream: &Arc<CudaStream>,
    x: &impl DevicePtr<bf16>,
    ws: &mut NormWorkspace,
) -> Result<()> {
    global_norm::<bf16, ffi::tilearn_bf16>(
        "tilearn_global_norm_bf16",
        ffi::tilearn_global_norm_bf16,
        stream,
        x,
        ws,
    )
}

/// GradScaler unscale of f32 gradients, in place: `grads[i] *= inv_scale[0]`, and
/// `found_inf[0] = 1.0` if any gradient was inf or NaN. `found_inf` is never cleared (zero it
/// once per step, before the first buffer); both scalars are one-element device buffers.
pub fn unscale_check_f32(
    stream: &Arc<CudaStream>,
    grads: &mut impl DevicePtrMut<f32>,
    inv_scale: &impl DevicePtr<f32>,
    found_inf: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    unscale_check::<f32, f32>(
        "tilearn_unscale_check_f32",
        ffi::tilearn_unscale_check_f32,
        stream,
        grads,
        inv_scale,
        found_inf,
    )
}

/// [`unscale_check_f32`] for bf16 gradients (f32 product, rounded to nearest even bf16).
pub fn unscale_check_bf16(
    stream: &Arc<CudaStream>,
    grads: &mut impl DevicePtrMut<bf16>,
    inv_scale: &impl DevicePtr<f32>,
    found_inf: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    unscale_check::<bf16, ffi::tilearn_bf16>(
        "tilearn_unscale_check_bf16",
        ffi::tilearn_unscale_check_bf16,
        stream,
        grads,
        inv_scale,
        found_inf,
    )
}

/// [`unscale_check_f32`] for f16 gradients (f32 product, rounded to nearest even f16).
pub fn unscale_check_f16(
    stream: &Arc<CudaStream>,
    grads: &mut impl DevicePtrMut<f16>,
    inv_scale: &impl DevicePtr<f32>,
    found_inf: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    unscale_check::<f16, ffi::tilearn_f16>(
        "tilearn_unscale_check_f16",
        ffi::tilearn_unscale_check_f16,
        stream,
        grads,
        inv_scale,
        found_inf,
    )
}
