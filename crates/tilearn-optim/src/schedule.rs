//! Learning-rate schedules: the curves of Hugging Face's `transformers.get_scheduler`.
//!
//! Each schedule is `lr(step) = base_lr * lambda(step)` where `lambda` is transformers' lr
//! lambda for that type, evaluated in f64 like the Python code (integer differences exact,
//! then float division). As with torch's `LambdaLR`, the optimizer's k-th step (1-based) uses
//! `lr_at(k - 1)`: the scheduler is stepped after the optimizer.

use std::f64::consts::PI;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{OptimError, Result};

/// The scheduler types of transformers' `SchedulerType` that we reproduce. Parameters default
/// (in [`FromStr`]) to transformers' defaults.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum SchedulerType {
    /// `"constant"`: lambda = 1. Ignores warmup, as in transformers.
    Constant,
    /// `"constant_with_warmup"`: linear warmup, then 1.
    ConstantWithWarmup,
    /// `"linear"`: linear warmup, then linear decay to 0 at `total_steps`.
    Linear,
    /// `"cosine"`: linear warmup, then half a cosine wave (num_cycles = 0.5) to 0.
    Cosine,
    /// `"cosine_with_restarts"`: linear warmup, then `num_cycles` hard-restarted cosine
    /// decays (transformers' default `num_cycles` is 1).
    CosineWithRestarts { num_cycles: f64 },
    /// `"polynomial"`: linear warmup, then `(base_lr - lr_end) * remaining^power + lr_end`;
    /// `lr_end` after `total_steps` (defaults: power 1, lr_end 1e-7).
    Polynomial { power: f64, lr_end: f64 },
    /// `"inverse_sqrt"`: linear warmup, then `1 / sqrt((step + shift) / timescale)` with
    /// `timescale = warmup_steps` (10 000 when warmup is 0) and `shift = timescale - warmup`.
    InverseSqrt,
    /// `"warmup_stable_decay"`: linear warmup from `min_lr_ratio` to 1, `num_stable_steps` at
    /// 1, then a cosine decay (num_cycles 0.5) over `num_decay_steps` from 1 to
    /// `min_lr_ratio`, then `min_lr_ratio` (transformers' defaults: linear warmup, cosine
    /// decay). transformers requires `num_decay_steps`; [`FromStr`] sets both step counts to 0,
    /// so fill them in (see [`SchedulerType::warmup_stable_decay`]).
    WarmupStableDecay {
        num_stable_steps: u64,
        num_decay_steps: u64,
        min_lr_ratio: f64,
    },
}

impl SchedulerType {
    /// Hugging Face's name of the type.
    pub fn hf_name(&self) -> &'static str {
        match self {
            SchedulerType::Constant => "constant",
            SchedulerType::ConstantWithWarmup => "constant_with_warmup",
            SchedulerType::Linear => "linear",
            SchedulerType::Cosine => "cosine",
            SchedulerType::CosineWithRestarts { .. } => "cosine_with_restarts",
            SchedulerType::Polynomial { .. } => "polynomial",
            SchedulerType::InverseSqrt => "inverse_sqrt",
            SchedulerType::WarmupStableDecay { .. } => "warmup_stable_decay",
        }
    }

    /// `WarmupStableDecay` with the stable phase filling the rest of training, as transformers'
    /// `get_wsd_schedule` does when `num_stable_steps` is not given:
    /// `num_stable_steps = total_steps - warmup_steps - num_decay_steps` (saturating at 0).
    pub fn warmup_stable_decay(
        total_steps: u64,
        warmup_steps: u64,
        num_decay_steps: u64,
        min_lr_ratio: f64,
    ) -> Self {
        SchedulerType::WarmupStableDecay {
            num_stable_steps: total_steps
                .saturating_sub(warmup_steps)
                .saturating_sub(num_decay_steps),
            num_decay_steps,
            min_lr_ratio,
        }
    }
}

impl fmt::Display for SchedulerType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.hf_name())
    }
}

impl FromStr for SchedulerType {
    type Err = OptimError;

    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "constant" => SchedulerType::Constant,
            "constant_with_warmup" => SchedulerType::ConstantWithWarmup,
            "linear" => SchedulerType::Linear,
            "cosine" => SchedulerType::Cosine,
            "cosine_with_restarts" => SchedulerType::CosineWithRestarts { num_cycles: 1.0 },
            "polynomial" => SchedulerType::Polynomial {
                power: 1.0,
                lr_end: 1e-7,
            },
            "inverse_sqrt" => SchedulerType::InverseSqrt,
            "warmup_stable_decay" => SchedulerType::WarmupStableDecay {
                num_stable_steps: 0,
                num_decay_steps: 0,
                min_lr_ratio: 0.0,
            },
            other => return Err(OptimError::UnknownScheduler(other.to_string())),
        })
    }
}

/// A learning-rate schedule: `lr_at(step) = base_lr * lambda(step)`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    pub kind: SchedulerType,
    pub base_lr: f32,
    pub warmup_steps: u64,
    pub total_steps: u64,
}

/// transformers' shared warmup: `step / max(1, warmup)`.
fn warmup_ratio(step: u64, warmup: u64) -> f64 {
    step as f64 / warmup.max(1) as f64
}

impl LrSchedule {
    /// A validated schedule: `base_lr` finite and >= 0; for `Polynomial`, `base_lr > lr_end`
    /// (transformers raises otherwise) and a finite `power`; finite `num_cycles`/`min_lr_ratio`.
    pub fn new(
        kind: SchedulerType,
        base_lr: f32,
        warmup_steps: u64,
        total_steps: u64,
    ) -> Result<Self> {
        let s = LrSchedule {
            kind,
            base_lr,
            warmup_steps,
            total_steps,
        };
        s.validate()?;
        Ok(s)
    }

    /// See [`LrSchedule::new`].
    pub fn validate(&self) -> Result<()> {
        let invalid = |name, value: f64, message| {
            Err(OptimError::InvalidHyperParameter {
                name,
                value,
                message,
            })
        };
        if !(self.base_lr.is_finite() && self.base_lr >= 0.0) {
            return invalid("lr", f64::from(self.base_lr), "must be finite and >= 0");
        }
        match self.kind {
            SchedulerType::Polynomial { power, lr_end } => {
                if !power.is_finite() {
                    return invalid("power", power, "must be finite");
                }
                if lr_end.is_nan() || f64::from(self.base_lr) <= lr_end {
                    return invalid(
                        "lr_end",
                        lr_end,
                        "must be smaller than the initial learning rate",
                    );
                }
            }
            SchedulerType::CosineWithRestarts { num_cycles } if !num_cycles.is_finite() => {
                return invalid("num_cycles", num_cycles, "must be finite");
            }
            SchedulerType::WarmupStableDecay { min_lr_ratio, .. } if !min_lr_ratio.is_finite() => {
                return invalid("min_lr_ratio", min_lr_ratio, "must be finite");
            }
            _ => {}
        }
        Ok(())
    }

    /// The learning rate of step `step` (0-based: the first optimizer step uses `lr_at(0)`).
    pub fn lr_at(&self, step: u64) -> f32 {
        (f64::from(self.base_lr) * self.lambda(step)) as f32
    }

    /// transformers' lr lambda (the multiplier of `base_lr`) at `step`.
    pub fn lambda(&self, step: u64) -> f64 {
        let warmup = self.warmup_steps;
        let total = self.total_steps;
        // Integer differences as Python computes them (may be negative).
        let diff = |a: u64, b: u64| a as i128 - b as i128;
        // `float(step - warmup) / float(max(1, total - warmup))`
        let progress = || diff(step, warmup) as f64 / diff(total, warmup).max(1) as f64;
        match self.kind {
            SchedulerType::Constant => 1.0,
            SchedulerType::ConstantWithWarmup => {
                if step < warmup {
                    warmup_ratio(step, warmup)
                } else {
                    1.0
                }
            }
            SchedulerType::Linear => {
                if step < warmup {
                    return warmup_ratio(step, warmup);
                }
                let remaining = diff(total, step) as f64 / diff(total, warmup).max(1) as f64;
                remaining.max(0.0)
            }
            SchedulerType::Cosine => {
                if step < warmup {
                    return warmup_ratio(step, warmup);
                }
                // num_cycles = 0.5; not clamped after total_steps (transformers neither).
                let num_cycles = 0.5;
                (0.5 * (1.0 + (PI * num_cycles * 2.0 * progress()).cos())).max(0.0)
            }
            SchedulerType::CosineWithRestarts { num_cycles } => {
                if step < warmup {
                    return warmup_ratio(step, warmup);
                }
                let p = progress();
                if p >= 1.0 {
                    return 0.0;
                }
                (0.5 * (1.0 + (PI * ((num_cycles * p) % 1.0)).cos())).max(0.0)
            }
            SchedulerType::Polynomial { power, lr_end } => {
                let lr_init = f64::from(self.base_lr);
                if step < warmup {
                    return warmup_ratio(step, warmup);
                }
                if step > total {
                    return lr_end / lr_init;
                }
                let decay_steps = diff(total, warmup);
                if decay_steps <= 0 {
                    // transformers divides by zero here (step == total == warmup); the decay
                    // is over, so give its end value.
                    return lr_end / lr_init;
                }
                let lr_range = lr_init - lr_end;
                let pct_remaining = 1.0 - diff(step, warmup) as f64 / decay_steps as f64;
                let decay = lr_range * pct_remaining.powf(power) + lr_end;
                decay / lr_init
            }
            SchedulerType::InverseSqrt => {
                if step < warmup {
                    return warmup_ratio(step, warmup);
                }
                // transformers: `timescale = num_warmup_steps or 10_000`.
                let timescale: u64 = if warmup == 0 { 10_000 } else { warmup };
                let shift = diff(timescale, warmup);
                1.0 / ((step as i128 + shift) as f64 / timescale as f64).sqrt()
            }
            SchedulerType::WarmupStableDecay {
                num_stable_steps,
                num_decay_steps,
                min_lr_ratio,
            } => {
                if step < warmup {
                    let factor = warmup_ratio(step, warmup);
                    return (factor * (1.0 - min_lr_ratio) + min_lr_ratio).max(0.0);
                }
                let stable_end = warmup as u128 + num_stable_steps as u128;
                if (step as u128) < stable_end {
                    return 1.0;
                }
                if (step as u128) < stable_end + num_decay_steps as u128 {
                    let into_decay = (step as u128 - stable_end) as f64;
                    let progress = into_decay / num_decay_steps.max(1) as f64;
                    let num_cycles = 0.5;
                    let factor = 0.5 * (1.0 + (PI * num_cycles * 2.0 * progress).cos());
                    return (factor * (1.0 - min_lr_ratio) + min_lr_ratio).max(0.0);
                }
                min_lr_ratio
            }
        }
    }
}
