//! Fused Adam / AdamW step (`crates/tilearn-kernels/kernels/optim_adam.cu`).

use std::sync::Arc;

use cudarc::driver::{CudaStream, CudaViewMut, DevicePtr};
use tilearn_kernels::ffi;

use super::error::{FusedError, Result};
use super::io::{
    Prepared, StepIo, bind, check_len, check_status, finite, prepare, same_device, unit_interval,
};
use super::plan::SegmentPlan;
use crate::adam::AdamStepScalars;
use crate::adamw::AdamWStepScalars;

/// One group's scalars of a fused Adam-family step (`tilearn_optim_adam_group`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamGroupScalars {
    /// AdamW's decoupled decay `p *= decay_factor` (`1 - lr * wd`), when `decoupled_decay`.
    pub decoupled_decay: bool,
    pub decay_factor: f32,
    /// Adam's L2 decay `g += l2_weight_decay * p`, when `l2_decay`.
    pub l2_decay: bool,
    pub l2_weight_decay: f32,
    pub one_minus_beta1: f32,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    pub bias_correction2_sqrt: f32,
    pub neg_step_size: f32,
    pub eps: f32,
}

impl From<&AdamWStepScalars> for AdamGroupScalars {
    fn from(s: &AdamWStepScalars) -> Self {
        AdamGroupScalars {
            decoupled_decay: s.apply_decay,
            decay_factor: s.decay_factor,
            l2_decay: false,
            l2_weight_decay: 0.0,
            one_minus_beta1: s.one_minus_beta1,
            beta2: s.beta2,
            one_minus_beta2: s.one_minus_beta2,
            bias_correction2_sqrt: s.bias_correction2_sqrt,
            neg_step_size: s.neg_step_size,
            eps: s.eps,
        }
    }
}

impl From<&AdamStepScalars> for AdamGroupScalars {
    fn from(s: &AdamStepScalars) -> Self {
        AdamGroupScalars {
            decoupled_decay: false,
            decay_factor: 1.0,
            // torch skips the L2 term when weight_decay == 0 (adam.rs does the same).
            l2_decay: s.weight_decay != 0.0,
            l2_weight_decay: s.weight_decay,
            one_minus_beta1: s.one_minus_beta1,
            beta2: s.beta2,
            one_minus_beta2: s.one_minus_beta2,
            bias_correction2_sqrt: s.bias_correction2_sqrt,
            neg_step_size: s.neg_step_size,
            eps: s.eps,
        }
    }
}

impl AdamGroupScalars {
    fn validate(&self) -> Result<()> {
        finite("decay_factor", self.decay_factor)?;
        finite("l2_weight_decay", self.l2_weight_decay)?;
        finite("neg_step_size", self.neg_step_size)?;
        finite("eps", self.eps)?;
        finite("bias_correction2_sqrt", self.bias_correction2_sqrt)?;
        unit_interval("beta2", self.beta2)?;
        // 1 - beta1 in (0, 1] <=> beta1 in [0, 1).
        unit_interval("beta1", 1.0 - self.one_minus_beta1)?;
        if self.bias_correction2_sqrt <= 0.0 {
            return Err(crate::OptimError::InvalidHyperParameter {
                name: "bias_correction2_sqrt",
                value: f64::from(self.bias_correction2_sqrt),
                message: "must be > 0 (step count starts at 1)",
            }
            .into());
        }
        Ok(())
    }

    /// The group as the device reads it (`tilearn_optim_adam_group`, ten 4-byte fields in
    /// declaration order), for a table in device memory ([`adam_step_device_groups`]).
    /// Validated as a launch validates it.
    pub fn to_words(self) -> Result<[u32; ADAM_GROUP_WORDS]> {
        self.validate()?;
        let f = self.to_ffi();
        Ok([
            f.decay_factor.to_bits(),
            f.l2_weight_decay.to_bits(),
            f.one_minus_beta1.to_bits(),
            f.beta2.to_bits(),
            f.one_minus_beta2.to_bits(),
            f.bias_correction2_sqrt.to_bits(),
            f.neg_step_size.to_bits(),
            f.eps.to_bits(),
            f.decoupled_decay,
            f.l2_decay,
        ])
    }

    fn to_ffi(self) -> ffi::tilearn_optim_adam_group {
        ffi::tilearn_optim_adam_group {
            decay_factor: self.decay_factor,
            l2_weight_decay: self.l2_weight_decay,
            one_minus_beta1: self.one_minus_beta1,
            beta2: self.beta2,
            one_minus_beta2: self.one_minus_beta2,
            bias_correction2_sqrt: self.bias_correction2_sqrt,
            neg_step_size: self.neg_step_size,
            eps: self.eps,
            decoupled_decay: u32::from(self.decoupled_decay),
            l2_decay: u32::from(self.l2_decay),
        }
    }
}

/// 4-byte words of one group's scalars in device memory (the C struct's size).
pub const ADAM_GROUP_WORDS: usize = 10;
const _: () = assert!(
    std::mem::size_of::<ffi::tilearn_optim_adam_group>() == 4 * ADAM_GROUP_WORDS,
    "tilearn_optim_adam_group changed: update AdamGroupScalars::to_words"
);

/// The f32 buffers an Adam-family step updates in place, each `plan.len()` elements.
pub struct AdamState<'a> {
    /// fp32 master weights.
    pub params: CudaViewMut<'a, f32>,
    pub exp_avg: CudaViewMut<'a, f32>,
    pub exp_avg_sq: CudaViewMut<'a, f32>,
    /// Running maximum of `exp_avg_sq`; `Some` enables amsgrad.
    pub max_exp_avg_sq: Option<CudaViewMut<'a, f32>>,
}

/// One fused Adam (L2) step with the CPU [`Adam`](crate::Adam)'s scalars (one per group, e.g.
/// from `Adam::step_scalars`).
pub fn adam_l2_step(
    stream: &Arc<CudaStream>,
    plan: &SegmentPlan,
    groups: &[AdamStepScalars],
    state: AdamState<'_>,
    io: StepIo<'_>,
) -> Result<()> {
    let groups: Vec<AdamGroupScalars> = groups.iter().map(AdamGroupScalars::from).collect();
    adam_step(stream, plan, &groups, state, io)
}

/// One fused AdamW step with the CPU [`AdamW`](crate::AdamW)'s scalars (one per group, e.g.
/// from `AdamW::step_scalars`): one launch for every group and tensor of `plan`.
pub fn adamw_step(
    stream: &Arc<CudaStream>,
    plan: &SegmentPlan,
    groups: &[AdamWStepScalars],
    state: AdamState<'_>,
    io: StepIo<'_>,
) -> Result<()> {
    let groups: Vec<AdamGroupScalars> = groups.iter().map(AdamGroupScalars::from).collect();
    adam_step(stream, plan, &groups, state, io)
}

/// One fused Adam-family step (Adam with L2 decay, AdamW with decoupled decay, optional
/// amsgrad): one launch for every group and tensor of `plan`. `groups[i]` are the scalars of
/// group `i` (`groups.len() == plan.n_groups()`). Every check runs before the launch; on an
/// `Err` nothing was modified.
pub fn adam_step(
    stream: &Arc<CudaStream>,
    plan: &SegmentPlan,
    groups: &[AdamGroupScalars],
    state: AdamState<'_>,
    io: StepIo<'_>,
) -> Result<()> {
    const OP: &str = "tilearn_optim_adam";
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
    for g in groups {
        g.validate()?;
    }
    let ffi_groups: Vec<ffi::tilearn_optim_adam_group> =
        groups.iter().map(|g| g.to_ffi()).collect();
    launch_adam(
        OP,
        stream,
        plan,
        GroupSource::<cudarc::driver::CudaView<u32>>::Host(&ffi_groups),
        state,
        io,
    )
}

/// [`adam_step`] with the groups' scalars in a device table (`plan.n_groups()` groups of
/// [`ADAM_GROUP_WORDS`] words from [`AdamGroupScalars::to_words`]) that the kernel reads when
/// it runs, not when it is queued: a captured CUDA graph replays the launch with each step's
/// learning rate and bias corrections, written into the table before the replay. The same
/// scalars give the same bits as [`adam_step`]. The table's values are validated by
/// `to_words` on the host, not here.
pub fn adam_step_device_groups(
    stream: &Arc<CudaStream>,
    plan: &SegmentPlan,
    groups: &impl DevicePtr<u32>,
    state: AdamState<'_>,
    io: StepIo<'_>,
) -> Result<()> {
    const OP: &str = "tilearn_optim_adam_device_groups";
    check_len(
        OP,
        "groups",
        plan.n_groups() * ADAM_GROUP_WORDS,
        groups.len(),
    )?;
    same_device(OP, "groups", stream, groups.stream())?;
    launch_adam(OP, stream, plan, GroupSource::Device(groups), state, io)
}

/// Where a launch takes its groups' scalars from.
enum GroupSource<'a, D: ?Sized> {
    /// Host memory, copied into the kernel's argument by the launcher.
    Host(&'a [ffi::tilearn_optim_adam_group]),
    /// A device table the kernel reads.
    Device(&'a D),
}

fn launch_adam<D: DevicePtr<u32> + ?Sized>(
    op: &'static str,
    stream: &Arc<CudaStream>,
    plan: &SegmentPlan,
    groups: GroupSource<'_, D>,
    mut state: AdamState<'_>,
    mut io: StepIo<'_>,
) -> Result<()> {
    let mut prep: Prepared<'_> = prepare(op, stream, plan, &mut io)?;
    let p = prep.state(op, "params", stream, plan, &mut state.params)?;
    let m = prep.state(op, "exp_avg", stream, plan, &mut state.exp_avg)?;
    let v = prep.state(op, "exp_avg_sq", stream, plan, &mut state.exp_avg_sq)?;
    let vmax = match &mut state.max_exp_avg_sq {
        Some(x) => prep.state(op, "max_exp_avg_sq", stream, plan, x)?,
        None => std::ptr::null_mut(),
    };
    if plan.n_chunks() == 0 {
        return Ok(());
    }
    bind(op, stream)?;
    let n_groups = plan.n_groups() as u32;
    let raw = stream.cu_stream() as ffi::cudaStream_t;
    // SAFETY: every pointer in `prep.launch` and p/m/v/vmax is a live device allocation of the
    // stream's context holding `plan.len()` elements of its type (lengths and devices checked
    // by `prepare` / `Prepared::state`), or NULL where the launcher allows it; the segment
    // table lies within `0..plan.len()` with groups `< n_groups` (checked when the plan was
    // built). The mutable buffers are distinct `&mut` borrows, so they do not alias each other
    // or the read-only inputs. Host groups are read by the launcher before it returns; a device
    // table holds `n_groups` structs (length checked by the caller) and its guard, like the
    // others, is held until the launch is queued. The buffers stay borrowed until the guards in
    // `prep` record the launch (cudarc frees device memory stream-ordered), and the launcher
    // only enqueues work.
    let status = match groups {
        GroupSource::Host(g) => unsafe {
            ffi::tilearn_optim_adam(&prep.launch, g.as_ptr(), n_groups, p, m, v, vmax, raw)
        },
        GroupSource::Device(table) => {
            let (ptr, _guard) = table.device_ptr(stream);
            unsafe {
                ffi::tilearn_optim_adam_device_groups(
                    &prep.launch,
                    ptr as *const ffi::tilearn_optim_adam_group,
                    n_groups,
                    p,
                    m,
                    v,
                    vmax,
                    raw,
                )
            }
        }
    };
    drop(prep);
    check_status(op, status)
}
