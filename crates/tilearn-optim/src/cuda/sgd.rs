//! Fused SGD step (`crates/tilearn-kernels/kernels/optim_sgd.cu`).

use std::sync::Arc;

use cudarc::driver::{CudaStream, CudaViewMut};
use tilearn_kernels::ffi;

use super::error::{FusedError, Result};
use super::io::{StepIo, bind, check_status, finite, prepare};
use super::plan::SegmentPlan;
use crate::sgd::SgdStepScalars;

fn to_ffi(s: &SgdStepScalars) -> Result<ffi::tilearn_optim_sgd_group> {
    finite("weight_decay", s.weight_decay)?;
    finite("momentum", s.momentum)?;
    finite("one_minus_dampening", s.one_minus_dampening)?;
    finite("neg_lr", s.neg_lr)?;
    Ok(ffi::tilearn_optim_sgd_group {
        weight_decay: s.weight_decay,
        momentum: s.momentum,
        one_minus_dampening: s.one_minus_dampening,
        neg_lr: s.neg_lr,
        nesterov: u32::from(s.nesterov),
        first_step: u32::from(s.first_step),
    })
}

/// One fused SGD step with the CPU [`Sgd`](crate::Sgd)'s scalars (one per group, e.g. from
/// `Sgd::step_scalars`): one launch for every group and tensor of `plan`. `momentum_buffer` is
/// `None` when the optimizer keeps no buffer (momentum 0; refused if a group has momentum).
/// Every check runs before the launch; on an `Err` nothing was modified.
pub fn sgd_step(
    stream: &Arc<CudaStream>,
    plan: &SegmentPlan,
    groups: &[SgdStepScalars],
    mut params: CudaViewMut<'_, f32>,
    mut momentum_buffer: Option<CudaViewMut<'_, f32>>,
    mut io: StepIo<'_>,
) -> Result<()> {
    const OP: &str = "tilearn_optim_sgd";
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
    if momentum_buffer.is_none() && groups.iter().any(|g| g.momentum != 0.0) {
        return Err(FusedError::InvalidArgument {
            op: OP,
            message: "momentum != 0 needs a momentum buffer".into(),
        });
    }
    let ffi_groups = groups.iter().map(to_ffi).collect::<Result<Vec<_>>>()?;
    let mut prep = prepare(OP, stream, plan, &mut io)?;
    let p = prep.state(OP, "params", stream, plan, &mut params)?;
    let buf = match &mut momentum_buffer {
        Some(b) => prep.state(OP, "momentum_buffer", stream, plan, b)?,
        None => std::ptr::null_mut(),
    };
    if plan.n_chunks() == 0 {
        return Ok(());
    }
    bind(OP, stream)?;
    // SAFETY: as in `adam_step`: every pointer is a live allocation of the stream's device with
    // `plan.len()` elements (checked), or NULL where allowed; mutable buffers are distinct
    // borrows; host structs are read before the launcher returns; the guards in `prep` keep
    // the buffers ordered after the launch, which only enqueues work.
    let status = unsafe {
        ffi::tilearn_optim_sgd(
            &prep.launch,
            ffi_groups.as_ptr(),
            ffi_groups.len() as u32,
            p,
            buf,
            stream.cu_stream() as ffi::cudaStream_t,
        )
    };
    drop(prep);
    check_status(OP, status)
}
