//! AdamW (`torch.optim.AdamW`, decoupled weight decay): the Adam of [`crate::adam`] with an
//! [`AdamWConfig`]. These names keep the AdamW vocabulary the trainer and the fused kernels use.

use crate::adam::{Adam, AdamStepScalars};
pub use crate::adam_config::AdamWConfig;

/// AdamW over one flat f32 buffer split into groups (see [`Adam`] for the step and the state).
pub type AdamW = Adam<AdamWConfig>;

/// The per-group scalars of one AdamW step (decoupled decay: `decay_factor = 1 - lr * wd`).
pub type AdamWStepScalars = AdamStepScalars<AdamWConfig>;
