//! Wrappers of tilearn-kernels' `norm.cu`: RMSNorm (Hugging Face LlamaRMSNorm) and LayerNorm
//! with bias (PyTorch `nn.LayerNorm`, Bloom: [`layernorm_forward`], [`layernorm_backward`],
//! same contract as [`crate::cpu::layernorm_forward`]) forward and backward, generic over the storage type ([`DeviceFloat`]: f32, bf16, f16) with f32
//! arithmetic and accumulation inside. Same contract as [`crate::cpu::rmsnorm_forward`] /
//! [`crate::cpu::rmsnorm_backward`]: `dx` is written (`=`), `dweight` accumulated (`+=`).
//!
//! Residual-fused variants remove the Llama block's separate residual-add launches:
//! [`add_rmsnorm_forward`] updates the residual stream in place (`resid += y`) and normalises it
//! in the same pass; [`rmsnorm_backward_add`] adds the input gradient into the residual-stream
//! gradient (`dresid +=`) instead of writing it.
//!
//! `rstd`, `dweight` and the backward's scratch are f32 whatever the element type. The
//! backward's dweight partials live in a caller-owned [`RmsNormScratch`], allocated once (a
//! training step then allocates nothing).

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use tilearn_kernels::ffi;

use super::DeviceFloat;
use super::launch::Launch;
use crate::shape::rows_of;
use crate::{OpsError, Result};

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
        Ok(RmsNormScratch {
            buf: alloc_scratch("RmsNormScratch::new", stream, len)?,
        })
    }

    /// Bytes of device memory held.
    pub fn bytes(&self) -> usize {
        self.buf.num_bytes()
    }
}

/// Zero-filled device scratch of `len` f32 (at least one element, so an empty problem still
/// has a valid pointer).
fn alloc_scratch(op: &'static str, stream: &Arc<CudaStream>, len: usize) -> Result<CudaSlice<f32>> {
    stream
        .alloc_zeros::<f32>(len.max(1))
        .map_err(|e| OpsError::Cuda {
            context: op,
            message: format!("cannot allocate {len} f32 of scratch: {e}"),
        })
}

/// RMSNorm forward: `x`, `out` are `[rows, dim]` (rows = `x.len() / dim`), `weight` is `[dim]`;
/// `out = weight * x * rstd` (written, `=`) and `rstd` (`[rows]`, f32, written) receives
/// `1 / sqrt(mean(x²) + eps)` for the backward. `eps` must be finite and `>= 0` in f32.
///
/// Precision: f32 arithmetic and accumulation. For bf16 and f16 the output rounds like
/// PyTorch's LlamaRMSNorm in that dtype (`hidden_states.to(input_dtype)`, then times the
/// weight): `out = T(weight * T(x * rstd))`, two roundings; f32 has no inner rounding.
pub fn rmsnorm_forward<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    x: &impl DevicePtr<T>,
    weight: &impl DevicePtr<T>,
    dim: usize,
    eps: f64,
    out: &mut impl DevicePtrMut<T>,
    rstd: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    const OP: &str = "tilearn_rmsnorm_forward";
    let rows = rows_of(OP, x.len(), dim)?;
    let eps = eps_f32(OP, eps)?;
    Launch::new(OP, stream)
        .input("x", x, rows * dim)
        .input("weight", weight, dim)
        .output("out", out, rows * dim)
        .output("rstd", rstd, rows)
        .skip_launch_if(rows == 0)
        .run(|[x, weight], [out, rstd], stream| {
            // SAFETY: the launcher reads rows * dim elements of T (`T::DTYPE`) from x and dim
            // from weight, and writes rows * dim to out and rows f32 to rstd.
            unsafe {
                ffi::tilearn_rmsnorm_forward(
                    T::DTYPE,
                    x,
                    weight,
                    rows,
                    dim,
                    eps,
                    out,
                    rstd.cast(),
                    stream,
                )
            }
        })
}

/// Fused residual update and RMSNorm: `resid += y` in place (the residual stream `h = x + y`,
/// all `[rows, dim]`), then `out = RMSNorm(resid)` (written) and `rstd` (f32, written), in one
/// launch. The norm reads the stored (rounded) `resid`, so the result is bit-identical to
/// [`super::residual_add_inplace`] followed by [`rmsnorm_forward`].
///
/// Precision: f32 arithmetic; for bf16 and f16 `resid = T(resid + y)` (one rounding), then the
/// rounding of [`rmsnorm_forward`].
#[allow(clippy::too_many_arguments)]
pub fn add_rmsnorm_forward<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    resid: &mut impl DevicePtrMut<T>,
    y: &impl DevicePtr<T>,
    weight: &impl DevicePtr<T>,
    dim: usize,
    eps: f64,
    out: &mut impl DevicePtrMut<T>,
    rstd: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    const OP: &str = "tilearn_add_rmsnorm_forward";
    let rows = rows_of(OP, resid.len(), dim)?;
    let eps = eps_f32(OP, eps)?;
    Launch::new(OP, stream)
        .output("resid", resid, rows * dim)
        .input("y", y, rows * dim)
        .input("weight", weight, dim)
        .output("out", out, rows * dim)
        .output("rstd", rstd, rows)
        .skip_launch_if(rows == 0)
        .run(|[y, weight], [resid, out, rstd], stream| {
            // SAFETY: the launcher reads rows * dim elements of T (`T::DTYPE`) from y and resid
            // and dim from weight, writes rows * dim to resid (in place) and out, and rows f32
            // to rstd.
            unsafe {
                ffi::tilearn_add_rmsnorm_forward(
                    T::DTYPE,
                    resid,
                    y,
                    weight,
                    rows,
                    dim,
                    eps,
                    out,
                    rstd.cast(),
                    stream,
                )
            }
        })
}

/// The signature shared by `tilearn_rmsnorm_backward` and `tilearn_rmsnorm_backward_add`.
type BackwardLauncher = unsafe extern "C" fn(
    c_int,
    *const c_void,
    *const c_void,
    *const c_void,
    *const f32,
    usize,
    usize,
    *mut c_void,
    *mut f32,
    *mut f32,
    usize,
    ffi::cudaStream_t,
) -> c_int;

#[allow(clippy::too_many_arguments)]
fn backward<T: DeviceFloat>(
    op: &'static str,
    launcher: BackwardLauncher,
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
    let rows = rows_of(op, x.len(), dim)?;
    // SAFETY: a pure function of its arguments (no device access).
    let scratch_len = unsafe { ffi::tilearn_rmsnorm_backward_scratch_len(rows, dim) };
    let have = scratch.buf.len();
    if rows > 0 && have < scratch_len {
        return Err(OpsError::Cuda {
            context: op,
            message: format!(
                "RmsNormScratch holds {have} f32, {rows} rows x {dim} need {scratch_len}"
            ),
        });
    }
    Launch::new(op, stream)
        .input("dout", dout, rows * dim)
        .input("x", x, rows * dim)
        .output("dx", dx, rows * dim)
        .input("weight", weight, dim)
        .output("dweight", dweight, dim)
        .input("rstd", rstd, rows)
        .workspace("scratch", &mut scratch.buf)
        .skip_launch_if(rows == 0)
        .run(|[dout, x, weight, rstd], [dx, dweight, scratch], stream| {
            // SAFETY: the launcher reads rows * dim elements of T (`T::DTYPE`) from dout and x
            // (and from dx when it accumulates), dim from weight and rows f32 from rstd; it
            // writes rows * dim to dx, dim f32 to dweight, and at most `have` f32 of scratch
            // (checked above to cover its need), every scratch element before reading it.
            unsafe {
                launcher(
                    T::DTYPE,
                    dout,
                    x,
                    weight,
                    rstd.cast(),
                    rows,
                    dim,
                    dx,
                    dweight.cast(),
                    scratch.cast(),
                    have,
                    stream,
                )
            }
        })
}

/// RMSNorm backward: from `dout`, the forward's input `x` (`[rows, dim]`), `weight` (`[dim]`)
/// and the forward's `rstd` (`[rows]`, f32), writes `dx` (`=`, `[rows, dim]`) and accumulates
/// the f32 `dweight` (`+=`, `[dim]`) deterministically: the same inputs give bit-identical
/// results (no atomics). `scratch` must cover `x.len() / dim` rows of width `dim`; its contents
/// are clobbered.
///
/// Precision: f32 arithmetic and accumulation; `dx` is rounded once to `T`.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward<T: DeviceFloat>(
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
    backward(
        "tilearn_rmsnorm_backward",
        ffi::tilearn_rmsnorm_backward,
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

/// [`rmsnorm_backward`] that adds the input gradient into the residual-stream gradient:
/// `dresid += dx` (where [`rmsnorm_backward`] writes `dx =`); `dweight +=` as there, with the
/// same bits.
///
/// Precision: for bf16 and f16 the f32 `dx` is added to the widened `dresid` and rounded once,
/// `dresid = T(dresid + dx)` (one rounding fewer than the backward followed by a residual add);
/// in f32 the result is bit-identical to that unfused pair.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward_add<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    dout: &impl DevicePtr<T>,
    x: &impl DevicePtr<T>,
    weight: &impl DevicePtr<T>,
    rstd: &impl DevicePtr<f32>,
    dim: usize,
    dresid: &mut impl DevicePtrMut<T>,
    dweight: &mut impl DevicePtrMut<f32>,
    scratch: &mut RmsNormScratch,
) -> Result<()> {
    backward(
        "tilearn_rmsnorm_backward_add",
        ffi::tilearn_rmsnorm_backward_add,
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

/// Device scratch of the LayerNorm backward (the dweight and dbias partials), sized once for
/// every call with at most `max_rows` rows of width at most `max_dim`; clobbered by each call.
#[derive(Debug)]
pub struct LayerNormScratch {
    buf: CudaSlice<f32>,
}

impl LayerNormScratch {
    /// f32 elements needed for calls of up to `max_rows` rows of width up to `max_dim`.
    pub fn len_for(max_rows: usize, max_dim: usize) -> usize {
        // SAFETY: a pure function of its arguments (no device access).
        unsafe { ffi::tilearn_layernorm_backward_scratch_len_max(max_rows, max_dim) }
    }

    /// Allocates (zero-filled) scratch for up to `max_rows` rows of width up to `max_dim`.
    pub fn new(stream: &Arc<CudaStream>, max_rows: usize, max_dim: usize) -> Result<Self> {
        const OP: &str = "LayerNormScratch::new";
        let len = Self::len_for(max_rows, max_dim);
        if len == usize::MAX {
            return Err(OpsError::Cuda {
                context: OP,
                message: format!("{max_rows} rows x {max_dim} is too large"),
            });
        }
        Ok(LayerNormScratch {
            buf: alloc_scratch(OP, stream, len)?,
        })
    }
}

/// LayerNorm forward: `x`, `out` `[rows, dim]`, `weight`, `bias` `[dim]`;
/// `out = (x − mean) · rstd · weight + bias` written (`=`), `mean` and `rstd` (`[rows]`, f32)
/// written for the backward. `eps` must be finite and `>= 0` in f32.
///
/// Precision: f32 arithmetic (two-pass variance), `out` rounded once to `T` (as PyTorch's
/// f32-accumulating layer_norm in bf16/f16).
#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    x: &impl DevicePtr<T>,
    weight: &impl DevicePtr<T>,
    bias: &impl DevicePtr<T>,
    dim: usize,
    eps: f64,
    out: &mut impl DevicePtrMut<T>,
    mean: &mut impl DevicePtrMut<f32>,
    rstd: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    const OP: &str = "tilearn_layernorm_forward";
    let rows = rows_of(OP, x.len(), dim)?;
    let eps = eps_f32(OP, eps)?;
    Launch::new(OP, stream)
        .input("x", x, rows * dim)
        .input("weight", weight, dim)
        .input("bias", bias, dim)
        .output("out", out, rows * dim)
        .output("mean", mean, rows)
        .output("rstd", rstd, rows)
        .skip_launch_if(rows == 0)
        .run(|[x, weight, bias], [out, mean, rstd], stream| {
            // SAFETY: the launcher reads rows * dim elements of T (`T::DTYPE`) from x and dim
            // from weight and bias, and writes rows * dim to out and rows f32 to mean and rstd.
            unsafe {
                ffi::tilearn_layernorm_forward(
                    T::DTYPE,
                    x,
                    weight,
                    bias,
                    rows,
                    dim,
                    eps,
                    out,
                    mean.cast(),
                    rstd.cast(),
                    stream,
                )
            }
        })
}

/// LayerNorm backward from the forward's `mean` and `rstd`: `dx` written (`=`), the f32
/// `dweight` and `dbias` accumulated (`+=`) deterministically (no atomics). `scratch` must cover
/// `x.len() / dim` rows of width `dim`.
///
/// Precision: f32 arithmetic and accumulation; `dx` rounded once to `T`.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    dout: &impl DevicePtr<T>,
    x: &impl DevicePtr<T>,
    weight: &impl DevicePtr<T>,
    mean: &impl DevicePtr<f32>,
    rstd: &impl DevicePtr<f32>,
    dim: usize,
    dx: &mut impl DevicePtrMut<T>,
    dweight: &mut impl DevicePtrMut<f32>,
    dbias: &mut impl DevicePtrMut<f32>,
    scratch: &mut LayerNormScratch,
) -> Result<()> {
    const OP: &str = "tilearn_layernorm_backward";
    let rows = rows_of(OP, x.len(), dim)?;
    // SAFETY: a pure function of its arguments (no device access).
    let need = unsafe { ffi::tilearn_layernorm_backward_scratch_len(rows, dim) };
    let have = scratch.buf.len();
    if rows > 0 && have < need {
        return Err(OpsError::Cuda {
            context: OP,
            message: format!(
                "LayerNormScratch holds {have} f32, {rows} rows x {dim} need {need}: build it \
                 with LayerNormScratch::new for at least these rows and width"
            ),
        });
    }
    Launch::new(OP, stream)
        .input("dout", dout, rows * dim)
        .input("x", x, rows * dim)
        .input("weight", weight, dim)
        .input("mean", mean, rows)
        .input("rstd", rstd, rows)
        .output("dx", dx, rows * dim)
        .output("dweight", dweight, dim)
        .output("dbias", dbias, dim)
        .workspace("scratch", &mut scratch.buf)
        .skip_launch_if(rows == 0)
        .run(
            |[dout, x, weight, mean, rstd], [dx, dweight, dbias, scratch], stream| {
                // SAFETY: the launcher reads rows * dim elements of T (`T::DTYPE`) from dout and
                // x, dim from weight and rows f32 from mean and rstd; it writes rows * dim to
                // dx, dim f32 to dweight and dbias, and at most `have` f32 of scratch (checked
                // above to cover its need), every scratch element before reading it.
                unsafe {
                    ffi::tilearn_layernorm_backward(
                        T::DTYPE,
                        dout,
                        x,
                        weight,
                        mean.cast(),
                        rstd.cast(),
                        rows,
                        dim,
                        dx,
                        dweight.cast(),
                        dbias.cast(),
                        scratch.cast(),
                        have,
                        stream,
                    )
                }
            },
        )
}
