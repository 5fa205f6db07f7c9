//! Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") over one flat f32
//! parameter buffer, as the widely used lion-pytorch package writes it.
//!
//! Per element of every group range, one step with learning rate `lr` (the value passed to
//! [`Lion::step`] times the group's `lr_scale`) and the group's weight decay `wd`:
//!
//! ```text
//! p = p * (1 - lr*wd)                      (decoupled decay, skipped when wd == 0)
//! c = m * beta1 + (1-beta1) * g            (each product and the sum rounded to f32)
//! p = p + (-lr) * sign(c)                  (sign(0) = 0; sign(NaN) = 0 as torch.sign)
//! m = m * beta2 + (1-beta2) * g
//! ```
//!
//! The scalars are computed in f64 from the decimal values of the f32 hyper-parameters and
//! rounded to f32 once per step ([`LionStepScalars`]). Since the update is a sign, the
//! interpolation `c` must be rounded exactly as above for results to match bit for bit.

use std::path::Path;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::bookkeeping::{Bookkeeping, bookkeeping_accessors, group_lr};
use crate::common::{
    check_beta, check_lr, check_non_negative, chunks_of_segments, decimal_f64, split, split_mut,
};
use crate::error::Result;
use crate::group::ParamGroup;

const STATE_FORMAT: &str = "tilearn-lion";

/// Hyper-parameters of [`Lion`]. `Default` gives lion-pytorch's defaults (lr 1e-4, betas
/// (0.9, 0.99), no weight decay).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LionConfig {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub weight_decay: f32,
}

impl Default for LionConfig {
    fn default() -> Self {
        LionConfig {
            lr: 1e-4,
            beta1: 0.9,
            beta2: 0.99,
            weight_decay: 0.0,
        }
    }
}

impl LionConfig {
    /// `lr` finite and >= 0, betas in `[0, 1)`, `weight_decay` finite and >= 0.
    pub fn validate(&self) -> Result<()> {
        check_lr(self.lr)?;
        check_beta("beta1", self.beta1)?;
        check_beta("beta2", self.beta2)?;
        check_non_negative("weight_decay", self.weight_decay)
    }
}

/// The per-group scalars of one Lion step, rounded to f32 once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LionStepScalars {
    /// Whether decoupled weight decay runs (skipped when `weight_decay == 0`).
    pub apply_decay: bool,
    /// `1 - lr * weight_decay`.
    pub decay_factor: f32,
    pub beta1: f32,
    /// `1 - beta1`.
    pub one_minus_beta1: f32,
    pub beta2: f32,
    /// `1 - beta2`.
    pub one_minus_beta2: f32,
    /// `-lr` (group-scaled).
    pub neg_lr: f32,
}

impl LionStepScalars {
    /// Scalars for group learning rate `lr` and weight decay `weight_decay` (f64, widened from
    /// their decimal values).
    pub fn new(config: &LionConfig, lr: f64, weight_decay: f64) -> Self {
        let beta1 = decimal_f64(config.beta1);
        let beta2 = decimal_f64(config.beta2);
        LionStepScalars {
            apply_decay: weight_decay != 0.0,
            decay_factor: (1.0 - lr * weight_decay) as f32,
            beta1: beta1 as f32,
            one_minus_beta1: (1.0 - beta1) as f32,
            beta2: beta2 as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
            neg_lr: (-lr) as f32,
        }
    }
}

/// `torch.sign` for f32: -1, 0 or 1; NaN gives 0 (torch's CPU and CUDA kernels compute
/// `(0 < x) - (x < 0)`).
#[inline(always)]
pub fn torch_sign(x: f32) -> f32 {
    f32::from(u8::from(0.0 < x)) - f32::from(u8::from(x < 0.0))
}

/// The elementwise Lion update on equal-length slices (one chunk of one range).
fn update_slice(s: &LionStepScalars, p: &mut [f32], g: &[f32], m: &mut [f32]) {
    for ((pi, &gi), mi) in p.iter_mut().zip(g).zip(m.iter_mut()) {
        if s.apply_decay {
            *pi *= s.decay_factor;
        }
        let c = *mi * s.beta1 + s.one_minus_beta1 * gi;
        *pi += s.neg_lr * torch_sign(c);
        *mi = *mi * s.beta2 + s.one_minus_beta2 * gi;
    }
}

/// Lion over one flat f32 buffer of `numel` elements split into groups.
#[derive(Debug, Clone)]
pub struct Lion {
    base: Bookkeeping<LionConfig>,
    exp_avg: Vec<f32>,
}

impl Lion {
    /// Validates `config` and `groups` and allocates the zeroed momentum (`exp_avg`).
    pub fn new(config: LionConfig, groups: Vec<ParamGroup>, numel: usize) -> Result<Self> {
        config.validate()?;
        Ok(Lion {
            base: Bookkeeping::new(config, groups, numel)?,
            exp_avg: vec![0.0; numel],
        })
    }

    /// One group `"default"` covering `0..numel` with `config.weight_decay`.
    pub fn with_single_group(config: LionConfig, numel: usize) -> Result<Self> {
        let group = ParamGroup::whole("default", numel, config.weight_decay);
        Self::new(config, vec![group], numel)
    }

    bookkeeping_accessors!(LionConfig);

    /// The momentum (lion-pytorch's `exp_avg`), `numel` elements.
    pub fn exp_avg(&self) -> &[f32] {
        &self.exp_avg
    }

    /// Mutable momentum (for a device path that keeps the host copy in sync).
    pub fn exp_avg_mut(&mut self) -> &mut [f32] {
        &mut self.exp_avg
    }

    /// The scalars the next step would use for group `group` at `lr`; `None` if `group` is out
    /// of range.
    pub fn step_scalars(&self, group: usize, lr: f32) -> Option<LionStepScalars> {
        let g = self.base.groups.get(group)?;
        Some(self.scalars_for(g, lr))
    }

    fn scalars_for(&self, g: &ParamGroup, lr: f32) -> LionStepScalars {
        LionStepScalars::new(
            &self.base.config,
            group_lr(g, lr),
            decimal_f64(g.weight_decay),
        )
    }

    /// One Lion step with learning rate `lr` (times each group's `lr_scale`); `params` and
    /// `grads` must have `numel` elements. Increments the step counter.
    ///
    /// Errors (nothing is modified): `LengthMismatch`, or `InvalidHyperParameter` for a
    /// non-finite or negative `lr`.
    pub fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f32) -> Result<()> {
        let what = ["Lion::step params", "Lion::step grads"];
        self.base.check_step(what, params, grads, lr)?;
        let scalars: Vec<LionStepScalars> = self
            .base
            .groups
            .iter()
            .map(|g| self.scalars_for(g, lr))
            .collect();
        let chunks = chunks_of_segments(&self.base.segments);
        let p = split_mut(params, &chunks);
        let g = split(grads, &chunks);
        let m = split_mut(&mut self.exp_avg, &chunks);
        chunks
            .par_iter()
            .zip(p)
            .zip(g)
            .zip(m)
            .for_each(|(((c, p), g), m)| update_slice(&scalars[c.group], p, g, m));
        self.base.step += 1;
        Ok(())
    }

    /// Writes the state atomically (format `tilearn-lion`, see `state_file`): tensor
    /// `exp_avg`; metadata `step`, `numel`, `config`, `groups`.
    pub fn save_state(&self, path: &Path) -> Result<()> {
        self.base
            .save_state(path, STATE_FORMAT, vec![("exp_avg", &self.exp_avg[..])])
    }

    /// Reads a state written by [`Lion::save_state`] (must match `numel`). Any problem gives
    /// `OptimError::State` and leaves `self` unchanged.
    pub fn load_state(&mut self, path: &Path) -> Result<()> {
        let mut loaded = self
            .base
            .load_state(path, STATE_FORMAT, |_| Ok(vec!["exp_avg"]))?;
        self.base.step = loaded.step;
        self.exp_avg = loaded.next_buffer();
        Ok(())
    }
}
