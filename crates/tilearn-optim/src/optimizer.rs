//! The [`Optimizer`] trait shared by the five optimizers, so a trainer can hold a
//! `Box<dyn Optimizer>`, and [`OptimizerConfig`] to build one from a tagged config.

use std::ops::Range;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::adam::{Adam, AdamConfig, AdamVariant};
use crate::adamw::{AdamW, AdamWConfig};
use crate::error::Result;
use crate::group::ParamGroup;
use crate::lamb::{Lamb, LambConfig};
use crate::lion::{Lion, LionConfig};
use crate::sgd::{Sgd, SgdConfig};

/// An optimizer over one flat f32 parameter buffer (see each implementation for its exact
/// semantics). All methods behave like the inherent methods of the same name.
pub trait Optimizer: Send + std::fmt::Debug {
    /// Short name: `"adamw"`, `"adam"`, `"sgd"`, `"lamb"` or `"lion"`.
    fn name(&self) -> &'static str;
    /// Length of the parameter and gradient buffers `step` takes.
    fn numel(&self) -> usize;
    /// The parameter groups (ranges, weight decay, lr scale).
    fn groups(&self) -> &[ParamGroup];
    /// The base learning rate of the config (what a schedule multiplies).
    fn base_lr(&self) -> f32;
    /// One step with learning rate `lr` (times each group's `lr_scale`).
    fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f32) -> Result<()>;
    /// Number of completed steps.
    fn step_count(&self) -> u64;
    /// Writes the optimizer state to a safetensors file atomically.
    fn save_state(&self, path: &Path) -> Result<()>;
    /// Reads a state written by `save_state` of the same optimizer kind.
    fn load_state(&mut self, path: &Path) -> Result<()>;
}

/// Implements [`Optimizer`] for `$ty` (generic over `$param: $bound` when given) by its
/// inherent methods; `|config| lr` reads the base learning rate from its config.
macro_rules! impl_optimizer {
    ($ty:ty, $name:expr, |$config:ident| $lr:expr $(, $param:ident: $bound:path)?) => {
        impl $(<$param: $bound>)? Optimizer for $ty {
            fn name(&self) -> &'static str {
                $name
            }
            fn numel(&self) -> usize {
                <$ty>::numel(self)
            }
            fn groups(&self) -> &[ParamGroup] {
                <$ty>::groups(self)
            }
            fn base_lr(&self) -> f32 {
                let $config = self.config();
                $lr
            }
            fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f32) -> Result<()> {
                <$ty>::step(self, params, grads, lr)
            }
            fn step_count(&self) -> u64 {
                <$ty>::step_count(self)
            }
            fn save_state(&self, path: &Path) -> Result<()> {
                <$ty>::save_state(self, path)
            }
            fn load_state(&mut self, path: &Path) -> Result<()> {
                <$ty>::load_state(self, path)
            }
        }
    };
}

// `Adam<AdamConfig>` is "adam", `Adam<AdamWConfig>` (AdamW) is "adamw".
impl_optimizer!(Adam<C>, C::NAME, |c| c.hyper().lr, C: AdamVariant);
impl_optimizer!(Sgd, "sgd", |c| c.lr);
impl_optimizer!(Lamb, "lamb", |c| c.lr);
impl_optimizer!(Lion, "lion", |c| c.lr);

/// The config of any of the five optimizers, tagged by name (JSON: `{"optimizer": "sgd",
/// "lr": 0.1, ...}`), e.g. for a trainer's config file.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "optimizer", rename_all = "lowercase")]
pub enum OptimizerConfig {
    AdamW(AdamWConfig),
    Adam(AdamConfig),
    Sgd(SgdConfig),
    Lamb(LambConfig),
    Lion(LionConfig),
}

impl OptimizerConfig {
    /// The optimizer's short name (as [`Optimizer::name`]).
    pub fn name(&self) -> &'static str {
        match self {
            OptimizerConfig::AdamW(_) => "adamw",
            OptimizerConfig::Adam(_) => "adam",
            OptimizerConfig::Sgd(_) => "sgd",
            OptimizerConfig::Lamb(_) => "lamb",
            OptimizerConfig::Lion(_) => "lion",
        }
    }

    /// The base learning rate.
    pub fn lr(&self) -> f32 {
        match self {
            OptimizerConfig::AdamW(c) => c.lr,
            OptimizerConfig::Adam(c) => c.lr,
            OptimizerConfig::Sgd(c) => c.lr,
            OptimizerConfig::Lamb(c) => c.lr,
            OptimizerConfig::Lion(c) => c.lr,
        }
    }

    /// The default weight decay (for groups built from it, e.g. the decay group).
    pub fn weight_decay(&self) -> f32 {
        match self {
            OptimizerConfig::AdamW(c) => c.weight_decay,
            OptimizerConfig::Adam(c) => c.weight_decay,
            OptimizerConfig::Sgd(c) => c.weight_decay,
            OptimizerConfig::Lamb(c) => c.weight_decay,
            OptimizerConfig::Lion(c) => c.weight_decay,
        }
    }

    /// Builds the optimizer over `numel` elements with `groups`. `tensor_ranges` (the model's
    /// per-tensor views) are used by LAMB's trust ratio and ignored by the others.
    pub fn build(
        self,
        groups: Vec<ParamGroup>,
        numel: usize,
        tensor_ranges: Vec<Range<usize>>,
    ) -> Result<Box<dyn Optimizer>> {
        Ok(match self {
            OptimizerConfig::AdamW(c) => Box::new(AdamW::new(c, groups, numel)?),
            OptimizerConfig::Adam(c) => Box::new(Adam::new(c, groups, numel)?),
            OptimizerConfig::Sgd(c) => Box::new(Sgd::new(c, groups, numel)?),
            OptimizerConfig::Lamb(c) => Box::new(Lamb::new(c, groups, numel, tensor_ranges)?),
            OptimizerConfig::Lion(c) => Box::new(Lion::new(c, groups, numel)?),
        })
    }
}
