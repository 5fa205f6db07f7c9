//! Fused Lion step (`crates/tilearn-kernels/kernels/optim_lion.cu`).

use std::sync::Arc;

use cudarc::driver::{CudaStream, CudaViewMut};
use tilearn_kernels::ffi;

use super::error::{FusedError, Result};
use super::io::{StepIo, bind, check_status, finite, prepare, unit_interval};
use super::plan::SegmentPlan;
use crate::lion::LionStepScalars;

fn to_ffi(s: &LionStepScalars) -> Result<ffi::tilearn_optim_lion_group> {
    finite("decay_factor", s.decay_factor)?;
    finite("neg_lr", s.neg_lr)?;
    unit_interval("beta1", s.beta1)?;
    unit_interval("beta2", s.beta2)?;
    finite("one_minus_beta1", s.one_minus_beta1)?;
    finite("one_minus_beta2", s.one_minus_beta2)?;
    Ok(ffi::tilearn_optim_lion_group {
        decay_factor: s.decay_factor,
        beta1: s.beta1,
        one_minus_beta1: s.one_minus_beta1,
        beta2: s.beta2,
        one_minus_beta2: s.one_minus_beta2,
        neg_lr: s.neg_lr,
        apply_decay: u32::from(s.apply_decay),
    })
}

/// One fused Lion step with the CPU [`Lion`](crate::Lion)'s scalars (one per group, e.g. from
/// `Lion::step_scalars`): one launch for every group and tensor of `plan`. Every check runs
/// before the launch; on an `Err` nothing was modified.
pub fn lion_step(
    stream: &Arc<CudaStream>,
    plan: &SegmentPlan,
    groups: &[LionStepScalars],
    mut params: CudaViewMut<'_, f32>,
    mut exp_avg: CudaViewMut<'_, f32>,
    mut io: StepIo<'_>,
) -> Result<()> {
    const OP: &str = "tilearn_optim_lion";
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
    let ffi_groups = groups.iter().map(to_ffi).collect::<Result<Vec<_>>>()?;
    let mut prep = prepare(OP, stream, plan, &mut io)?;
    let p = prep.state(OP, "params", stream, plan, &mut params)?;
    let m = prep.state(OP, "exp_avg", stream, plan, &mut exp_avg)?;
    if plan.n_chunks() == 0 {
        return Ok(());
    }
    bind(OP, stream)?;
    // SAFETY: as in `adam_step`: every pointer is a live allocation of the stream's device with
    // `plan.len()` elements (checked); mutable buffers are distinct borrows; host structs are
    // read before the launcher returns; the guards in `prep` keep the buffers ordered after the
    // launch, which only enqueues work.
    let status = unsafe {
        ffi::tilearn_optim_lion(
            &prep.launch,
            ffi_groups.as_ptr(),
            ffi_groups.len() as u32,
            p,
            m,
            stream.cu_stream() as ffi::cudaStream_t,
        )
    };
    drop(prep);
    check_status(OP, status)
}
