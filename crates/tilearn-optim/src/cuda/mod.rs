//! Fused multi-tensor CUDA optimizers (feature `cuda`): one launch per step for every parameter
//! group and tensor of a flat buffer, at memory-bandwidth speed.
//!
//! * [`SegmentPlan`]: the optimizer's [`Segment`](crate::Segment)s (optionally restricted to a
//!   ZeRO-1 shard) as a device table, built once.
//! * [`StepIo`]: gradients (f32 or bf16), the bf16/f16 working copy written by the same kernel
//!   (round to nearest or stochastic), the GradScaler's device `inv_scale` / `found_inf` (read
//!   inside the kernel: a step with `found_inf != 0` changes nothing, no host sync) and the
//!   global-norm [`Clip`] input from [`GradNorm`].
//! * Steps: [`adamw_step`] / [`adam_l2_step`] / [`adam_step`], [`sgd_step`], [`lion_step`],
//!   [`lamb_step`] (three launches: moments and partial norms, per-tensor trust ratios, apply).
//! * [`mod@bench`]: the bandwidth benchmark shared by `benches/fused_optim.rs` and `optim-bench`.
//!
//! The kernels perform the CPU reference's f32 operations in the same order (no FMA
//! contraction), so a fused step matches the CPU optimizer to the last bit or within an ulp.

mod adam;
pub mod bench;
mod error;
mod io;
mod lamb;
mod lion;
mod norm;
mod plan;
mod sgd;

pub use adam::{
    ADAM_GROUP_WORDS, AdamGroupScalars, AdamState, adam_l2_step, adam_step,
    adam_step_device_groups, adamw_step,
};
pub use error::{FusedError, Result};
pub use io::{Clip, Grads, ParamCopy, Rounding, StepIo};
pub use lamb::{
    LambGroup, LambScratch, LambState, lamb_groups, lamb_max_norm, lamb_segments, lamb_step,
};
pub use lion::lion_step;
pub use norm::GradNorm;
pub use plan::{CHUNK, LocalSegment, MAX_GROUPS, SegmentPlan, local_segments};
pub use sgd::sgd_step;
