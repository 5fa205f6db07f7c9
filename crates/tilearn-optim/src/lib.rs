//! tilearn-optim: optimizers over flat parameter buffers, gradient clipping and LR schedules.
//! Usable alone: it takes flat `&mut [f32]` buffers and index ranges, not model types.
//!
//! * [`group`]: [`ParamGroup`] — named index ranges of one flat buffer with their own weight
//!   decay and learning-rate scale.
//! * [`adamw`]: [`AdamW`] with `torch.optim.AdamW` semantics, state save/load as safetensors.
//! * [`clip`]: deterministic global L2 gradient norm and `clip_grad_norm_`.
//! * [`schedule`]: Hugging Face `get_scheduler` learning-rate curves.

pub mod adamw;
pub mod clip;
pub mod error;
pub mod group;
pub mod schedule;

pub use adamw::{AdamW, AdamWConfig, AdamWStepScalars};
pub use clip::{clip_grad_norm, global_grad_norm};
pub use error::{OptimError, Result};
pub use group::{ParamGroup, Segment, validate_groups};
pub use schedule::{LrSchedule, SchedulerType};
