//! tilearn-optim: optimizers over flat parameter buffers, gradient clipping and LR schedules.
//! Usable alone: it takes flat `&mut [f32]` buffers and index ranges, not model types.
//!
//! * [`group`]: [`ParamGroup`] — named index ranges of one flat buffer with their own weight
//!   decay and learning-rate scale.
//! * [`adam`]: [`Adam`], one Adam with a [`WeightDecayMode`] picked by its config type:
//!   [`AdamConfig`] gives `torch.optim.Adam` (L2 decay), [`AdamWConfig`] gives
//!   `torch.optim.AdamW` (decoupled decay; [`adamw`]: the alias [`AdamW`]).
//! * [`sgd`]: [`Sgd`] (`torch.optim.SGD`), [`lamb`]: [`Lamb`] (Apex `FusedLAMB`), [`lion`]:
//!   [`Lion`] (lion-pytorch).
//! * [`optimizer`]: the [`Optimizer`] trait all five implement, and [`OptimizerConfig`].
//!   Every optimizer saves and loads its state in one safetensors format (`state_file.rs`).
//! * [`clip`]: deterministic global L2 gradient norm and `clip_grad_norm_`.
//! * [`bf16_copy`]: the bf16 working copy of fp32 weights, rounded as the fused kernels do.
//! * [`schedule`]: Hugging Face `get_scheduler` learning-rate curves.

pub mod adam;
mod adam_config;
mod adam_update;
pub mod adamw;
pub mod bf16_copy;
mod bookkeeping;
pub mod clip;
mod common;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
pub mod group;
pub mod lamb;
pub mod lion;
pub mod optimizer;
pub mod schedule;
pub mod sgd;
mod state_file;

pub use adam::{Adam, AdamConfig, AdamStepScalars, AdamVariant, WeightDecayMode};
pub use adamw::{AdamW, AdamWConfig, AdamWStepScalars};
pub use clip::{clip_grad_norm, global_grad_norm};
pub use common::decimal_f64;
pub use error::{OptimError, Result};
pub use group::{ParamGroup, Segment, validate_groups};
pub use lamb::{Lamb, LambConfig, LambStepScalars, lamb_clip_divisor, lamb_trust_ratio};
pub use lion::{Lion, LionConfig, LionStepScalars};
pub use optimizer::{Optimizer, OptimizerConfig};
pub use schedule::{LrSchedule, SchedulerType};
pub use sgd::{Sgd, SgdConfig, SgdStepScalars};
