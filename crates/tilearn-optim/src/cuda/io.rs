//! What every fused step takes besides the optimizer state: gradients, the working copy of the
//! parameters, the GradScaler's device scalars and the clip input; and the shared preparation
//! of a launch (length, device and argument checks, raw pointers, stream-order guards).

use std::sync::Arc;

use cudarc::driver::{
    CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};
use half::{bf16, f16};
use tilearn_kernels::ffi;

use super::error::{FusedError, Result};
use super::plan::{CHUNK, SegmentPlan};
use crate::error::OptimError;

/// The gradient buffer of a step (same length as the parameters).
pub enum Grads<'a> {
    F32(CudaView<'a, f32>),
    Bf16(CudaView<'a, bf16>),
}

impl Grads<'_> {
    pub fn len(&self) -> usize {
        match self {
            Grads::F32(g) => g.len(),
            Grads::Bf16(g) => g.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// How the bf16 working copy is rounded from the new f32 master weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rounding {
    /// Round to nearest even (`bf16(master)` exactly).
    Nearest,
    /// Stochastic rounding: up or down with probability proportional to the distance, decided by
    /// a hash of `(seed, StepIo::step, global element index)` (reproducible, shard-independent).
    Stochastic { seed: u64 },
}

/// The 16-bit working copy of the parameters written by the step (or none).
pub enum ParamCopy<'a> {
    None,
    Bf16(CudaViewMut<'a, bf16>, Rounding),
    /// f16, round to nearest even (overflow to ±inf).
    F16(CudaViewMut<'a, f16>),
}

/// Global gradient-norm clipping: `grad_sumsq[0]` is the sum of squares of the unscaled
/// gradients (from [`GradNorm`](super::GradNorm), all-reduced across shards for ZeRO); the kernel
/// multiplies gradients by `max_norm / (norm + 1e-6)` when `norm = sqrt(sum) > max_norm`
/// (`clip_grad_norm_`; a non-finite norm never clips).
pub struct Clip<'a> {
    pub grad_sumsq: CudaView<'a, f64>,
    pub max_norm: f64,
}

/// The per-step inputs shared by every optimizer.
pub struct StepIo<'a> {
    pub grads: Grads<'a>,
    pub param_copy: ParamCopy<'a>,
    /// GradScaler: one f32 on the device; gradients are multiplied by it inside the kernel.
    pub inv_scale: Option<CudaView<'a, f32>>,
    /// GradScaler: one f32 on the device; when it is non-zero the kernel changes nothing.
    pub found_inf: Option<CudaView<'a, f32>>,
    pub clip: Option<Clip<'a>>,
    /// Step number fed to the stochastic-rounding hash (use the optimizer's step count).
    pub step: u64,
}

impl<'a> StepIo<'a> {
    /// Gradients only: no copy, no scaler, no clipping.
    pub fn new(grads: Grads<'a>) -> Self {
        StepIo {
            grads,
            param_copy: ParamCopy::None,
            inv_scale: None,
            found_inf: None,
            clip: None,
            step: 0,
        }
    }
}

/// A launch ready to go: the common launch struct plus the guards that order the buffers'
/// later users after the launch (dropped after the launcher returns).
pub(super) struct Prepared<'g> {
    pub launch: ffi::tilearn_optim_launch,
    guards: Vec<SyncOnDrop<'g>>,
}

impl<'g> Prepared<'g> {
    /// Device pointer of an optimizer state buffer (checked length and device).
    pub fn state(
        &mut self,
        op: &'static str,
        what: &'static str,
        stream: &'g CudaStream,
        plan: &SegmentPlan,
        buf: &'g mut CudaViewMut<'_, f32>,
    ) -> Result<*mut f32> {
        check_len(op, what, plan.len(), buf.len())?;
        same_device(op, what, stream, buf.stream())?;
        let (ptr, guard) = buf.device_ptr_mut(stream);
        self.guards.push(guard);
        Ok(ptr as *mut f32)
    }
}

pub(super) fn check_len(
    op: &'static str,
    what: &'static str,
    expected: usize,
    actual: usize,
) -> Result<()> {
    if expected == actual {
        return Ok(());
    }
    let _ = op;
    Err(OptimError::LengthMismatch {
        what,
        expected,
        actual,
    }
    .into())
}

pub(super) fn same_device(
    op: &'static str,
    what: &'static str,
    stream: &CudaStream,
    buf_stream: &Arc<CudaStream>,
) -> Result<()> {
    if **buf_stream.context() == **stream.context() {
        Ok(())
    } else {
        Err(FusedError::WrongDevice {
            op,
            what,
            buffer_device: buf_stream.context().ordinal(),
            stream_device: stream.context().ordinal(),
        })
    }
}

/// Validates `io` against `plan` and fills the common launch struct. The returned guards
/// borrow `io`'s buffers; the optimizer adds its state buffers with [`Prepared::state`].
pub(super) fn prepare<'g>(
    op: &'static str,
    stream: &'g CudaStream,
    plan: &'g SegmentPlan,
    io: &'g mut StepIo<'_>,
) -> Result<Prepared<'g>> {
    let n = plan.len();
    let mut guards = Vec::new();
    let (grad_dtype, grads) = match &io.grads {
        Grads::F32(g) => {
            check_len(op, "grads", n, g.len())?;
            same_device(op, "grads", stream, g.stream())?;
            let (p, guard) = g.device_ptr(stream);
            guards.push(guard);
            (ffi_dtype::F32, p as *const std::ffi::c_void)
        }
        Grads::Bf16(g) => {
            check_len(op, "grads", n, g.len())?;
            same_device(op, "grads", stream, g.stream())?;
            let (p, guard) = g.device_ptr(stream);
            guards.push(guard);
            (ffi_dtype::BF16, p as *const std::ffi::c_void)
        }
    };
    let (copy_dtype, param_copy, stochastic, seed) = match &mut io.param_copy {
        ParamCopy::None => (ffi_dtype::NONE, std::ptr::null_mut(), 0, 0),
        ParamCopy::Bf16(c, rounding) => {
            check_len(op, "param_copy", n, c.len())?;
            same_device(op, "param_copy", stream, c.stream())?;
            let (p, guard) = c.device_ptr_mut(stream);
            guards.push(guard);
            let (sr, seed) = match *rounding {
                Rounding::Nearest => (0, 0),
                Rounding::Stochastic { seed } => (1, seed),
            };
            (ffi_dtype::BF16, p as *mut std::ffi::c_void, sr, seed)
        }
        ParamCopy::F16(c) => {
            check_len(op, "param_copy", n, c.len())?;
            same_device(op, "param_copy", stream, c.stream())?;
            let (p, guard) = c.device_ptr_mut(stream);
            guards.push(guard);
            (ffi_dtype::F16, p as *mut std::ffi::c_void, 0, 0)
        }
    };
    let mut scalar = |what: &'static str, v: &'g Option<CudaView<'_, f32>>| -> Result<*const f32> {
        match v {
            None => Ok(std::ptr::null()),
            Some(v) => {
                check_len(op, what, 1, v.len())?;
                same_device(op, what, stream, v.stream())?;
                let (p, guard) = v.device_ptr(stream);
                guards.push(guard);
                Ok(p as *const f32)
            }
        }
    };
    let inv_scale = scalar("inv_scale", &io.inv_scale)?;
    let found_inf = scalar("found_inf", &io.found_inf)?;
    let (grad_sumsq, max_norm) = match &io.clip {
        None => (std::ptr::null(), 0.0),
        Some(c) => {
            if c.grad_sumsq.is_empty() {
                return Err(FusedError::InvalidArgument {
                    op,
                    message: "clip.grad_sumsq is empty (needs the sum of squares at index 0)"
                        .into(),
                });
            }
            same_device(op, "clip.grad_sumsq", stream, c.grad_sumsq.stream())?;
            let (p, guard) = c.grad_sumsq.device_ptr(stream);
            guards.push(guard);
            (p as *const f64, c.max_norm)
        }
    };
    let (table, guard) = plan.table().device_ptr(stream);
    guards.push(guard);
    let launch = ffi::tilearn_optim_launch {
        segments: table as *const ffi::tilearn_optim_segment,
        n_segments: plan.segments().len() as u64,
        n_chunks: plan.n_chunks() as u64,
        chunk: CHUNK as u64,
        grad_dtype,
        grads,
        copy_dtype,
        param_copy,
        inv_scale,
        found_inf,
        grad_sumsq,
        max_norm,
        stochastic_rounding: stochastic,
        seed,
        step: io.step,
        index_offset: plan.shard().start as u64,
    };
    Ok(Prepared { launch, guards })
}

/// The header's `TILEARN_OPTIM_DTYPE_*` codes (bindgen does not emit the macros).
mod ffi_dtype {
    use std::ffi::c_int;
    pub const NONE: c_int = 0;
    pub const F32: c_int = 1;
    pub const BF16: c_int = 2;
    pub const F16: c_int = 3;
}

/// Makes the stream's context current for the runtime API inside the launchers.
pub(super) fn bind(op: &'static str, stream: &CudaStream) -> Result<()> {
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| FusedError::Cuda {
            op,
            message: format!("cannot make the device context current: {e}"),
        })
}

/// Turns a launcher's `cudaError_t` into a result.
pub(super) fn check_status(op: &'static str, status: std::ffi::c_int) -> Result<()> {
    match tilearn_kernels::status_message(status) {
        None => Ok(()),
        Some(message) => Err(FusedError::Cuda { op, message }),
    }
}

/// Fails unless `x` is finite.
pub(super) fn finite(name: &'static str, x: f32) -> Result<()> {
    if x.is_finite() {
        Ok(())
    } else {
        Err(OptimError::InvalidHyperParameter {
            name,
            value: f64::from(x),
            message: "step scalar must be finite (non-finite learning rate or hyper-parameter?)",
        }
        .into())
    }
}

/// Fails unless `x` lies in `[0, 1)` (a beta) — `what` names it.
pub(super) fn unit_interval(name: &'static str, x: f32) -> Result<()> {
    if (0.0..1.0).contains(&x) {
        Ok(())
    } else {
        Err(OptimError::InvalidHyperParameter {
            name,
            value: f64::from(x),
            message: "must lie in [0, 1)",
        }
        .into())
    }
}
