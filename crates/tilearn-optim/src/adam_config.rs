//! The two configs of the Adam family and what tells them apart: [`AdamConfig`]
//! (`torch.optim.Adam`, L2 weight decay) and [`AdamWConfig`] (`torch.optim.AdamW`, decoupled
//! weight decay) have the same fields and differ in their defaults and in the
//! [`WeightDecayMode`] their [`AdamVariant`] impl fixes.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::common::{check_beta, check_lr, check_non_negative, check_positive};
use crate::error::Result;

/// How an Adam step applies a group's weight decay `wd` (skipped when `wd == 0`, as torch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightDecayMode {
    /// `torch.optim.Adam`: an L2 penalty added to the gradient, `g = g + wd * p`, before the
    /// moments see it.
    L2,
    /// `torch.optim.AdamW`: decoupled decay of the parameter, `p = p * (1 - lr * wd)`, before
    /// the Adam update; the moments never see it.
    Decoupled,
}

/// A config type of the Adam family. The type fixes the weight-decay mode, the optimizer's name
/// and its state-file format, so `Adam<AdamConfig>` and `Adam<AdamWConfig>` (alias
/// [`AdamW`](crate::AdamW)) are one optimizer that cannot be mixed up at compile time: their
/// step scalars ([`AdamStepScalars`](crate::AdamStepScalars)) carry the variant too.
pub trait AdamVariant:
    Copy + std::fmt::Debug + PartialEq + Serialize + DeserializeOwned + Send + Sync + 'static
{
    /// How the weight decay enters the step.
    const DECAY: WeightDecayMode;
    /// The optimizer's short name ([`Optimizer::name`](crate::Optimizer::name)).
    const NAME: &'static str;
    /// The `format` tag of its state files.
    const STATE_FORMAT: &'static str;

    /// The hyper-parameters (both configs have these fields).
    fn hyper(&self) -> AdamConfig;
}

/// Hyper-parameters of [`Adam`](crate::Adam). `Default` gives torch's defaults (lr 1e-3, betas
/// (0.9, 0.999), eps 1e-8, no weight decay, no amsgrad).
///
/// `lr` is the base learning rate (what a schedule multiplies); `step` takes the learning rate
/// of the current step explicitly. `weight_decay` (the L2 coefficient) is used by
/// `with_single_group`; each [`ParamGroup`](crate::ParamGroup) carries its own.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamConfig {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    pub amsgrad: bool,
}

impl Default for AdamConfig {
    fn default() -> Self {
        AdamConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            amsgrad: false,
        }
    }
}

impl AdamConfig {
    /// Checks the hyper-parameters: `lr` finite and >= 0, betas in `[0, 1)`, `eps` finite and
    /// > 0, `weight_decay` finite and >= 0.
    pub fn validate(&self) -> Result<()> {
        check_lr(self.lr)?;
        check_beta("beta1", self.beta1)?;
        check_beta("beta2", self.beta2)?;
        check_positive("eps", self.eps)?;
        check_non_negative("weight_decay", self.weight_decay)
    }
}

impl AdamVariant for AdamConfig {
    const DECAY: WeightDecayMode = WeightDecayMode::L2;
    const NAME: &'static str = "adam";
    const STATE_FORMAT: &'static str = "tilearn-adam";

    fn hyper(&self) -> AdamConfig {
        *self
    }
}

/// Hyper-parameters of [`AdamW`](crate::AdamW), the fields of [`AdamConfig`]. `Default` gives
/// Hugging Face Trainer's defaults (`learning_rate` 5e-5, `adam_beta1` 0.9, `adam_beta2` 0.999,
/// `adam_epsilon` 1e-8, `weight_decay` 0.0, no amsgrad).
///
/// `weight_decay` is the default decoupled decay for groups built with `with_single_group`;
/// each [`ParamGroup`](crate::ParamGroup) carries its own.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    pub amsgrad: bool,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        // Hugging Face's defaults are torch's Adam defaults apart from the learning rate.
        let AdamConfig {
            beta1,
            beta2,
            eps,
            weight_decay,
            amsgrad,
            ..
        } = AdamConfig::default();
        AdamWConfig {
            lr: 5e-5,
            beta1,
            beta2,
            eps,
            weight_decay,
            amsgrad,
        }
    }
}

impl AdamWConfig {
    /// Checks the hyper-parameters as [`AdamConfig::validate`] does.
    pub fn validate(&self) -> Result<()> {
        self.hyper().validate()
    }
}

impl AdamVariant for AdamWConfig {
    const DECAY: WeightDecayMode = WeightDecayMode::Decoupled;
    const NAME: &'static str = "adamw";
    const STATE_FORMAT: &'static str = "tilearn-adamw";

    fn hyper(&self) -> AdamConfig {
        let AdamWConfig {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            amsgrad,
        } = *self;
        AdamConfig {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            amsgrad,
        }
    }
}
