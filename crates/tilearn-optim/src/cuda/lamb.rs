//! Fused LAMB step (`crates/tilearn-kernels/kernels/optim_lamb.cu`): three launches per step
//! for all tensors.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaViewMut, DevicePtrMut};
use tilearn_kernels::ffi;

use super::error::{FusedError, Result};
use super::io::{StepIo, bind, check_status, finite, prepare, same_device, unit_interval};
use super::plan::SegmentPlan;
use crate::common::decimal_f64;
use crate::group::Segment;
use crate::lamb::{Lamb, LambStepScalars};

/// One group's LAMB scalars plus its learning rate in f64 (the trust ratio `lr * ‖p‖/‖u‖` is
/// computed in f64, as the CPU [`Lamb`] does).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LambGroup {
    pub scalars: LambStepScalars,
    pub lr: f64,
}

/// The groups of `lamb`'s next step at learning rate `lr`, exactly as [`Lamb::step`] computes
/// them (`clip_divisor` from `global_grad_norm`, used only when the step gets no device
/// [`Clip`](super::Clip)).
pub fn lamb_groups(lamb: &Lamb, lr: f32, global_grad_norm: f64) -> Vec<LambGroup> {
    lamb.groups()
        .iter()
        .enumerate()
        .filter_map(|(gi, g)| {
            let scalars = lamb.step_scalars(gi, lr, global_grad_norm)?;
            Some(LambGroup {
                scalars,
                lr: decimal_f64(lr) * decimal_f64(g.lr_scale),
            })
        })
        .collect()
}

/// Apex's `max_grad_norm` as the device clip compares it (the Python float it was written
/// as), for [`Clip::max_norm`](super::Clip) of a LAMB step; `None` without clipping.
pub fn lamb_max_norm(lamb: &Lamb) -> Option<f64> {
    lamb.config().max_grad_norm.map(decimal_f64)
}

/// The trust-ratio tensors of `lamb` as plan segments (one segment per tensor), for
/// [`SegmentPlan::whole`].
pub fn lamb_segments(lamb: &Lamb) -> Vec<Segment> {
    lamb.tensors()
        .iter()
        .map(|(range, group): &(Range<usize>, usize)| Segment {
            group: *group,
            range: range.clone(),
        })
        .collect()
}

/// Device scratch of a LAMB step for one plan: per-chunk partial norms and per-tensor ratios.
#[derive(Debug)]
pub struct LambScratch {
    partials: CudaSlice<f64>,
    ratios: CudaSlice<f32>,
}

impl LambScratch {
    pub fn new(stream: &Arc<CudaStream>, plan: &SegmentPlan) -> Result<Self> {
        let alloc_err = |e: cudarc::driver::DriverError| FusedError::Cuda {
            op: "LambScratch::new",
            message: e.to_string(),
        };
        Ok(LambScratch {
            partials: stream
                .alloc_zeros::<f64>((2 * plan.n_chunks()).max(1))
                .map_err(alloc_err)?,
            ratios: stream
                .alloc_zeros::<f32>(plan.segments().len().max(1))
                .map_err(alloc_err)?,
        })
    }

    /// The learning rate applied to each tensor (plan segment) by the last step, on the device.
    pub fn ratios(&self) -> &CudaSlice<f32> {
        &self.ratios
    }
}

/// The f32 buffers a LAMB step updates in place, each `plan.len()` elements.
pub struct LambState<'a> {
    pub params: CudaViewMut<'a, f32>,
    pub exp_avg: CudaViewMut<'a, f32>,
    pub exp_avg_sq: CudaViewMut<'a, f32>,
}

fn to_ffi(g: &LambGroup) -> Result<ffi::tilearn_optim_lamb_group> {
    let s = &g.scalars;
    finite("clip_divisor", s.clip_divisor)?;
    finite("beta3", s.beta3)?;
    finite("eps", s.eps)?;
    finite("weight_decay", s.weight_decay)?;
    unit_interval("beta1", s.beta1)?;
    unit_interval("beta2", s.beta2)?;
    for (name, bc) in [
        ("bias_correction1", s.bias_correction1),
        ("bias_correction2", s.bias_correction2),
    ] {
        if !(bc.is_finite() && bc > 0.0) {
            return Err(crate::OptimError::InvalidHyperParameter {
                name,
                value: f64::from(bc),
                message: "must be finite and > 0 (step count starts at 1)",
            }
            .into());
        }
    }
    if !(g.lr.is_finite() && g.lr >= 0.0) {
        return Err(crate::OptimError::InvalidHyperParameter {
            name: "lr",
            value: g.lr,
            message: "must be finite and >= 0",
        }
        .into());
    }
    Ok(ffi::tilearn_optim_lamb_group {
        clip_divisor: s.clip_divisor,
        beta1: s.beta1,
        beta3: s.beta3,
        beta2: s.beta2,
        one_minus_beta2: s.one_minus_beta2,
        bias_correction1: s.bias_correction1,
        bias_correction2: s.bias_correction2,
        eps: s.eps,
        weight_decay: s.weight_decay,
        use_trust_ratio: u32::from(s.use_trust_ratio),
        lr: g.lr,
    })
}

/// One fused LAMB step (Apex `FusedLAMB` semantics). `plan` must be a whole-buffer plan whose
/// segments are the trust-ratio tensors ([`lamb_segments`]): a ZeRO shard would cut tensors
/// and need their partial norms all-reduced, which this step does not do. With `io.clip`, the
/// clip divisor is computed on the device from the sum of squares (`max_norm` = Apex's
/// `max_grad_norm`, see [`lamb_max_norm`]); otherwise each group's `clip_divisor` is used.
/// Every check runs before the launch; on an `Err` nothing was modified.
pub fn lamb_step(
    stream: &Arc<CudaStream>,
    plan: &SegmentPlan,
    groups: &[LambGroup],
    scratch: &mut LambScratch,
    mut state: LambState<'_>,
    mut io: StepIo<'_>,
) -> Result<()> {
    const OP: &str = "tilearn_optim_lamb";
    if groups.len() != plan.n_groups() {
        return Err(FusedError::InvalidArgument {
            op: OP,
            message: format!(
                "{} group scalars for a plan of {} groups",
                groups.len(),
                plan.n_groups()
            ),
        });
    }
    if plan.shard().start != 0 {
        return Err(FusedError::InvalidArgument {
            op: OP,
            message: "LAMB needs whole tensors: use a whole-buffer plan".into(),
        });
    }
    if scratch.partials.len() < 2 * plan.n_chunks() || scratch.ratios.len() < plan.segments().len()
    {
        return Err(FusedError::InvalidArgument {
            op: OP,
            message: "scratch was made for a smaller plan".into(),
        });
    }
    if let Some(c) = &io.clip
        && !(c.max_norm.is_finite() && c.max_norm > 0.0)
    {
        return Err(crate::OptimError::InvalidHyperParameter {
            name: "max_grad_norm",
            value: c.max_norm,
            message: "must be finite and > 0",
        }
        .into());
    }
    let ffi_groups = groups.iter().map(to_ffi).collect::<Result<Vec<_>>>()?;
    same_device(OP, "scratch", stream, scratch.partials.stream())?;
    let mut prep = prepare(OP, stream, plan, &mut io)?;
    let p = prep.state(OP, "params", stream, plan, &mut state.params)?;
    let m = prep.state(OP, "exp_avg", stream, plan, &mut state.exp_avg)?;
    let v = prep.state(OP, "exp_avg_sq", stream, plan, &mut state.exp_avg_sq)?;
    if plan.n_chunks() == 0 {
        return Ok(());
    }
    bind(OP, stream)?;
    let partials_len = scratch.partials.len();
    let ratios_len = scratch.ratios.len();
    let (partials, _pg) = scratch.partials.device_ptr_mut(stream);
    let (ratios, _rg) = scratch.ratios.device_ptr_mut(stream);
    // SAFETY: as in `adam_step`: every pointer is a live allocation of the stream's device with
    // `plan.len()` elements (checked), the scratch holds at least 2 f64 per chunk and 1 f32 per
    // segment (checked above); mutable buffers are distinct borrows; host structs are read
    // before the launcher returns; the guards keep the buffers ordered after the launches,
    // which only enqueue work.
    let status = unsafe {
        ffi::tilearn_optim_lamb(
            &prep.launch,
            ffi_groups.as_ptr(),
            ffi_groups.len() as u32,
            p,
            m,
            v,
            partials as *mut f64,
            partials_len,
            ratios as *mut f32,
            ratios_len,
            stream.cu_stream() as ffi::cudaStream_t,
        )
    };
    drop(prep);
    check_status(OP, status)
}
