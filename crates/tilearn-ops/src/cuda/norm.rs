//! Wrappers of `kernels/norm.cu`: RMSNorm (Hugging Face LlamaRMSNorm) forward and backward, in
//! f32 and in bf16 with f32 accumulation. Same contract as [`crate::cpu::rmsnorm_forward`] /
//! [`crate::cpu::rmsnorm_backward`]: `dx` is written (`=`), `dweight` accumulated (`+=`).
//!
//! Residual-fused variants remove the Llama block's separate residual-add launches:
//! [`add_rmsnorm_forward_f32`] updates the residual stream in place (`resid += y`) and
//! normalises it in the same pass; [`rmsnorm_backward_add_f32`] adds the input gradient into the
//! residual-stream gradient (`dresid +=`) instead of writing it.
//!
//! The backward's dweight partials live in a caller-owned [`RmsNormScratch`], allocated once
//! (a training step then allocates nothing).

use std::ffi::c_int;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
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
type AddForwardLauncher<R> = unsafe extern "C" fn(
    *mut R,
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

/// Device scratch for the dweight partials of the RMSNorm backward, sized once for every call
/// with at most `max_rows` rows of width at most `max_dim`, so the backward allocates nothing.
/// Its contents are clobbered by each backward (one stream: calls on it are ordered).
#[derive(Debug)]
pub struct RmsNormScratch {
    buf: CudaSlice<f32>,
}

impl RmsNormScratch {
    /// f32 elements needed for calls of up to `max_rows` rows of width up to `max_dim`.
    pub fn len_for(max_rows: usize, max_dim: usize) -> usize {
        // SAFETY: a pure function of its arguments (no device access).
        unsafe { ffi::tilearn_rmsnorm_backward_scratch_len_max(max_rows, max_dim) }
    }

    /// Bytes of device memory [`RmsNormScratch::new`] allocates for these bounds.
    pub fn bytes_for(max_rows: usize, max_dim: usize) -> usize {
        Self::len_for(max_rows, max_dim).saturating_mul(size_of::<f32>())
    }

    /// Allocates (zero-filled) scratch for up to `max_rows` rows of width up to `max_dim`.
    pub fn new(stream: &Arc<CudaStream>, max_rows: usize, max_dim: usize) -> Result<Self> {
        let len = Self::len_for(max_rows, max_dim);
        if len == usize::MAX {
            return Err(OpsError::Cuda {
                context: "RmsNormScratch::new",
                message: format!("{max_rows} rows x {max_dim} is too large"),
            });
        }
        let buf = stream
            .alloc_zeros::<f32>(len.max(1))
            .map_err(|e| OpsError::Cuda {
                context: "RmsNormScratch::new",
                message: format!("cannot allocate {len} f32 of scratch: {e}"),
            })?;
        Ok(RmsNormScratch { buf })
    }

    /// Bytes of device memory held.
    pub fn bytes(&self) -> usize {
        self.buf.num_bytes()
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
fn add_forward<T, R>(
    op: &'static str,
    launcher: AddForwardLauncher<R>,
    stream: &Arc<CudaStream>,
    resid: &mut impl DevicePtrMut<T>,
    y: &impl DevicePtr<T>,
    weight: &impl DevicePtr<T>,
    dim: usize,
    eps: f64,
    out: &mut impl DevicePtrMut<T>,
    rstd: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    const { assert!(size_of::<T>() == size_of::<R>()) };
    let rows = rows_of(op, resid.len(), dim)?;
    expect_len(op, resid.len(), y.len())?;
    expect_len(op, dim, weight.len())?;
    expect_len(op, resid.len(), out.len())?;
    expect_len(op, rows, rstd.len())?;
    let eps = eps_f32(op, eps)?;
    same_device(stream, op, "resid", resid)?;
    same_device(stream, op, "y", y)?;
    same_device(stream, op, "weight", weight)?;
    same_device(stream, op, "out", out)?;
    same_device(stream, op, "rstd", rstd)?;
    if rows == 0 {
        return Ok(());
    }
    bind(stream, op)?;
    let (resid_ptr, _resid) = resid.device_ptr_mut(stream);
    let (y_ptr, _y) = y.device_ptr(stream);
    let (w_ptr, _w) = weight.device_ptr(stream);
    let (out_ptr, _out) = out.device_ptr_mut(stream);
    let (rstd_ptr, _rstd) = rstd.device_ptr_mut(stream);
    // SAFETY: every pointer is a live allocation of the stream's context (checked above) with
    // the length the launcher reads or writes: resid, y and out hold rows * dim elements, weight
    // dim, rstd rows (all checked above; the FFI element type has the Rust type's size). resid,
    // out and rstd are borrowed mutably, so none of them overlaps another buffer (the kernel's
    // in-place update touches resid only). The launcher only enqueues work on `stream`; the
    // guards order it after earlier writers and before later users of these buffers.
    let status = unsafe {
        launcher(
            resid_ptr as *mut R,
            y_ptr as *const R,
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
    scratch: &mut RmsNormScratch,
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
    let have = scratch.buf.len();
    if have < scratch_len {
        return Err(OpsError::Cuda {
            context: op,
            message: format!(
                "RmsNormScratch holds {have} f32, {rows} rows x {dim} need {scratch_len}"
            ),
        });
    }
    same_device(stream, op, "scratch", &scratch.buf)?;
    let (dout_ptr, _dout) = dout.device_ptr(stream);
    let (x_ptr, _x) = x.device_ptr(stream);
    let (w_ptr, _w) = weight.device_ptr(stream);
    let (rstd_ptr, _rstd) = rstd.device_ptr(stream);
    let (dx_ptr, _dx) = dx.device_ptr_mut(stream);
    let (dw_ptr, _dw) = dweight.device_ptr_mut(stream);
    let (scratch_ptr, _scratch) = scratch.buf.device_ptr_mut(stream);
    // SAFETY: every pointer is a live allocation of the stream's context (checked above) with
    // the length the launcher uses: dout, x, dx rows * dim; weight and dweight dim; rstd rows;
    // scratch at least the length the launcher asks for (all checked above; the kernel writes
    // every scratch element it later reads, so stale contents are never observed). dx, dweight
    // and scratch are borrowed mutably, so the outputs overlap no other buffer (dx is read as
    // well as written by the accumulating launchers, still only by itself). The work is enqueued
    // on `stream` only; the guards order it after earlier writers and before later users.
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
            have,
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
/// same inputs give bit-identical results). `rstd` is the forward's; `scratch` must cover
/// `x.len() / dim` rows of width `dim`.
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
    scratch: &mut RmsNormScratch,
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
        scratch,
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
    scratch: &mut RmsNormScratch,
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
        scratch,
    )
}

/// Fused residual update and RMSNorm in f32: `resid += y` in place (the residual stream
/// `h = x + y`), then `out = RMSNorm(resid)` and `rstd`, bit-identical to
/// [`super::residual_add_inplace_f32`] followed by [`rmsnorm_forward_f32`], in one launch.
#[allow(clippy::too_many_arguments)]
pub fn add_rmsnorm_forward_f32(
    stream: &Arc<CudaStream>,
    resid: &mut impl DevicePtrMut<f32>,
    y: &impl DevicePtr<f32>,
    weight: &impl DevicePtr<f32>,
    dim: usize,
    eps: f64,
    out: &mut impl DevicePtrMut<f32>,
    rstd: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    add_forward::<f32, f32>(
        "tilearn_add_rmsnorm_forward_f32",
        ffi::tilearn_add_rmsnorm_forward_f32,
        stream,
        resid,
        y,
        weight,
        dim,
        eps,
        out,
        rstd,
    )
}

/// [`add_rmsnorm_forward_f32`] in bf16: `resid = bf16(resid + y)` (f32 add, one rounding), then
/// the bf16 RMSNorm of the stored `resid` (rounding as [`rmsnorm_forward_bf16`]).
#[allow(clippy::too_many_arguments)]
pub fn add_rmsnorm_forward_bf16(
    stream: &Arc<CudaStream>,
    resid: &mut impl DevicePtrMut<bf16>,
    y: &impl DevicePtr<bf16>,
    weight: &impl DevicePtr<bf16>,
    dim: usize,
    eps: f64,
    out: &mut impl DevicePtrMut<bf16>,
    rstd: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    add_forward::<bf16, ffi::tilearn_bf16>(
        "tilearn_add_rmsnorm_forward_bf16",
        ffi::tilearn_add_rmsnorm_forward_bf16,
        stream,
        resid,
        y,
        weight,
        dim,
        eps,
        out,
        rstd,
    )
}

/// RMSNorm backward in f32 that adds the input gradient into the residual-stream gradient:
/// `dresid += dx` (where [`rmsnorm_backward_f32`] writes `dx =`), `dweight +=` deterministic.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward_add_f32(
    stream: &Arc<CudaStream>,
    dout: &impl DevicePtr<f32>,
    x: &impl DevicePtr<f32>,
    weight: &impl DevicePtr<f32>,
    rstd: &impl DevicePtr<f32>,
    dim: usize,
    dresid: &mut impl DevicePtrMut<f32>,
    dweight: &mut impl DevicePtrMut<f32>,
    scratch: &mut RmsNormScratch,
) -> Result<()> {
    backward::<f32, f32>(
        "tilearn_rmsnorm_backward_add_f32",
        ffi::tilearn_rmsnorm_backward_add_f32,
        stream,
        dout,
        x,
        weight,
        rstd,
        dim,
        dresid,
        dweight,
        scratch,
    )
}

/// [`rmsnorm_backward_add_f32`] in bf16: `dresid = bf16(dresid + dx)` with the f32 `dx` (one
/// rounding), f32 `dweight +=`.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward_add_bf16(
    stream: &Arc<CudaStream>,
    dout: &impl DevicePtr<bf16>,
    x: &impl DevicePtr<bf16>,
    weight: &impl DevicePtr<bf16>,
    rstd: &impl DevicePtr<f32>,
    dim: usize,
    dresid: &mut impl DevicePtrMut<bf16>,
    dweight: &mut impl DevicePtrMut<f32>,
    scratch: &mut RmsNormScratch,
) -> Result<()> {
    backward::<bf16, ffi::tilearn_bf16>(
        "tilearn_rmsnorm_backward_add_bf16",
        ffi::tilearn_rmsnorm_backward_add_bf16,
        stream,
        dout,
        x,
        weight,
        rstd,
        dim,
        dresid,
        dweight,
        scratch,
    )
}
