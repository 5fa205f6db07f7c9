//! Wrappers of `kernels/norm.cu`: RMSNorm (Hugging Face LlamaRMSNorm) forward and backward, in
//! f32 and in bf16 with f32 accumulation. Same contract as [`crate::cpu::rmsnorm_forward`] /
//! [`crate::cpu::rmsnorm_backward`]: `dx` is written (`=`), `dweight` accumulated (`+=`).

use std::ffi::c_int;
use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use super::ffi;
use super::launch::{bind, check, expect_len, raw_stream, same_device};
use crate::{OpsError, Result};

type ForwardLauncher<R> = unsafe extern "C" fn(
    *const R,
    *const R,
    usize,
    usize,
    f32,
    *mut R,
    *mut f32,
    ffi::cudaStream_t,
) -> c_int;
type BackwardLauncher<R> = unsafe extern "C" fn(
    *const R,
    *const R,
    *const R,
    *const f32,
    usize,
    usize,
    *mut R,
    *mut f32,
    *mut f32,
    usize,
    ffi::cudaStream_t,
) -> c_int;

/// Rows of `[rows, dim]` data of `len` elements, checking `dim > 0` and divisibility.
fn rows_of(op: &'static str, len: usize, dim: usize) -> Result<usize> {
    if dim == 0 {
        return Err(OpsError::ShapeMismatch {
            op,
            expected: 1,
            actual: 0,
        });
    }
    if !len.is_multiple_of(dim) {
        return Err(OpsError::ShapeMismatch {
            op,
            expected: len.div_ceil(dim) * dim,
            actual: len,
        });
    }
    Ok(len / dim)
}

fn eps_f32(op: &'static str, eps: f64) -> Result<f32> {
    let e = eps as f32;
    if e.is_finite() && e >= 0.0 {
        Ok(e)
    } else {
        Err(OpsError::Cuda {
            context: op,
            message: format!("eps must be finite and >= 0, got {eps}"),
        })
    }
}

#[allow(clippy::too_many_arguments)]
fn forward<T, R>(
    op: &'static str,
    launcher: ForwardLauncher<R>,
    stream: &Arc<CudaStream>,
    x: &impl DevicePtr<T>,
    weight: &impl DevicePtr<T>,
    dim: usize,
    eps: f64,
    out: &mut impl DevicePtrMut<T>,
    rstd: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    const { assert!(size_of::<T>() == size_of::<R>()) };
    let rows = rows_of(op, x.len(), dim)?;
    expect_len(op, dim, weight.len())?;
    expect_len(op, x.len(), out.len())?;
    expect_len(op, rows, rstd.len())?;
    let eps = eps_f32(op, eps)?;
    same_device(stream, op, "x", x)?;
    same_device(stream, op, "weight", weight)?;
    same_device(stream, op, "out", out)?;
    same_device(stream, op, "rstd", rstd)?;
    if rows == 0 {
        return Ok(());
    }
    bind(stream, op)?;
    let (x_ptr, _x) = x.device_ptr(stream);
    let (w_ptr, _w) = weight.device_ptr(stream);
    let (out_ptr, _out) = out.device_ptr_mut(stream);
    let (rstd_ptr, _rstd) = rstd.device_ptr_mut(stream);
    // SAFETY: every pointer is a live allocation of the stream's context (checked above) with
    // the length the launcher reads or writes: x and out hold rows * dim elements, weight dim,
    // rstd rows (all checked above; the FFI element type has the Rust type's size). out and rstd
    // are borrowed mutably, so they overlap neither each other nor the inputs. The launcher only
    // enqueues work on `stream`; the `device_ptr*` guards order it after earlier writers and
    // before later users of these buffers, which outlive the call.
    let status = unsafe {
        launcher(
            x_ptr as *const R,
            w_ptr as *const R,
            rows,
            dim,
            eps,
            out_ptr as *mut R,
            rstd_ptr as *mut f32,
            raw_stream(stream),
        )
    };
    check(op, status)
}

#[allow(clippy::too_many_arguments)]
fn backward<T, R>(
    op: &'static str,
    launcher: BackwardLauncher<R>,
    stream: &Arc<CudaStream>,
    dout: &impl DevicePtr<T>,
    x: &impl DevicePtr<T>,
    weight: &impl DevicePtr<T>,
    rstd: &impl DevicePtr<f32>,
    dim: usize,
    dx: &mut impl DevicePtrMut<T>,
    dweight: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    const { assert!(size_of::<T>() == size_of::<R>()) };
    let rows = rows_of(op, x.len(), dim)?;
    expect_len(op, x.len(), dout.len())?;
    expect_len(op, x.len(), dx.len())?;
    expect_len(op, dim, weight.len())?;
    expect_len(op, dim, dweight.len())?;
    expect_len(op, rows, rstd.len())?;
    same_device(stream, op, "dout", dout)?;
    same_device(stream, op, "x", x)?;
    same_device(stream, op, "weight", weight)?;
    same_device(stream, op, "rstd", rstd)?;
    same_device(stream, op, "dx", dx)?;
    same_device(stream, op, "dweight", dweight)?;
    if rows == 0 {
        return Ok(());
    }
    bind(stream, op)?;
    // SAFETY: a pure function of its arguments (no device access).
    let scratch_len = unsafe { ffi::tilearn_rmsnorm_backward_scratch_len(rows, dim) };
    // SAFETY: the kernel writes every one of the `scratch_len` elements (each block its own
    // `dim`-wide row of partials) before the reduction kernel reads them, so the uninitialised
    // contents are never observed.
    let mut scratch = unsafe { stream.alloc::<f32>(scratch_len) }.map_err(|e| OpsError::Cuda {
        context: op,
        message: format!("cannot allocate {scratch_len} f32 of scratch: {e}"),
    })?;
    let (dout_ptr, _dout) = dout.device_ptr(stream);
    let (x_ptr, _x) = x.device_ptr(stream);
    let (w_ptr, _w) = weight.device_ptr(stream);
    let (rstd_ptr, _rstd) = rstd.device_ptr(stream);
    let (dx_ptr, _dx) = dx.device_ptr_mut(stream);
    let (dw_ptr, _dw) = dweight.device_ptr_mut(stream);
    let (scratch_ptr, _scratch) = scratch.device_ptr_mut(stream);
    // SAFETY: every pointer is a live allocation of the stream's context (checked above, and
    // `scratch` was just allocated on `stream`) with the length the launcher uses: dout, x, dx
    // rows * dim; weight and dweight dim; rstd rows; scratch exactly the length the launcher
    // asked for (all checked above). dx, dweight and scratch are borrowed mutably, so the
    // outputs overlap no other buffer. The work is enqueued on `stream` only; the guards order it
    // after earlier writers and before later users; `scratch` is freed stream-ordered on drop.
    let status = unsafe {
        launcher(
            dout_ptr as *const R,
            x_ptr as *const R,
            w_ptr as *const R,
            rstd_ptr as *const f32,
            rows,
            dim,
            dx_ptr as *mut R,
            dw_ptr as *mut f32,
            scratch_ptr as *mut f32,
            scratch_len,
            raw_stream(stream),
        )
    };
    check(op, status)
}

/// RMSNorm forward in f32: `x`, `out` are `[rows, dim]` (rows = `x.len() / dim`), `weight` is
/// `[dim]`; `rstd` (`[rows]`) receives `1 / sqrt(mean(x²) + eps)` for the backward.
pub fn rmsnorm_forward_f32(
    stream: &Arc<CudaStream>,
    x: &impl DevicePtr<f32>,
    weight: &impl DevicePtr<f32>,
    dim: usize,
    eps: f64,
    out: &mut impl DevicePtrMut<f32>,
    rstd: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    forward::<f32, f32>(
        "tilearn_rmsnorm_forward_f32",
        ffi::tilearn_rmsnorm_forward_f32,
        stream,
        x,
        weight,
        dim,
        eps,
        out,
        rstd,
    )
}

/// RMSNorm forward with bf16 `x`, `weight`, `out` and f32 arithmetic; rounds like PyTorch's
/// LlamaRMSNorm in bf16: `out = bf16(weight * bf16(x * rstd))`. `rstd` is f32.
pub fn rmsnorm_forward_bf16(
    stream: &Arc<CudaStream>,
    x: &impl DevicePtr<bf16>,
    weight: &impl DevicePtr<bf16>,
    dim: usize,
    eps: f64,
    out: &mut impl DevicePtrMut<bf16>,
    rstd: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    forward::<bf16, ffi::tilearn_bf16>(
        "tilearn_rmsnorm_forward_bf16",
        ffi::tilearn_rmsnorm_forward_bf16,
        stream,
        x,
        weight,
        dim,
        eps,
        out,
        rstd,
    )
}

/// RMSNorm backward in f32: writes `dx` (`=`), accumulates `dweight` (`+=`, deterministic: the
/// same inputs give bit-identical results). `rstd` is the forward's.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward_f32(
    stream: &Arc<CudaStream>,
    dout: &impl DevicePtr<f32>,
    x: &impl DevicePtr<f32>,
    weight: &impl DevicePtr<f32>,
    rstd: &impl DevicePtr<f32>,
    dim: usize,
    dx: &mut impl DevicePtrMut<f32>,
    dweight: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    backward::<f32, f32>(
        "tilearn_rmsnorm_backward_f32",
        ffi::tilearn_rmsnorm_backward_f32,
        stream,
        dout,
        x,
        weight,
        rstd,
        dim,
        dx,
        dweight,
    )
}

/// RMSNorm backward with bf16 `dout`, `x`, `weight`, `dx` and f32 arithmetic: writes `dx`
/// (`=`, rounded to bf16), accumulates the f32 `dweight` (`+=`, deterministic).
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward_bf16(
    stream: &Arc<CudaStream>,
    dout: &impl DevicePtr<bf16>,
    x: &impl DevicePtr<bf16>,
    weight: &impl DevicePtr<bf16>,
    rstd: &impl DevicePtr<f32>,
    dim: usize,
    dx: &mut impl DevicePtrMut<bf16>,
    dweight: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    backward::<bf16, ffi::tilearn_bf16>(
        "tilearn_rmsnorm_backward_bf16",
        ffi::tilearn_rmsnorm_backward_bf16,
        stream,
        dout,
        x,
        weight,
        rstd,
        dim,
        dx,
        dweight,
    )
}
