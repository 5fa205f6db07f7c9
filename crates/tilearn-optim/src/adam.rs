//! Adam over one flat f32 parameter buffer, with `torch.optim.Adam` semantics (L2 weight
//! decay added to the gradient, optional amsgrad).
//!
//! Per element of every group range, one step `t` (1-based) with learning rate `lr` (the value
//! passed to [`Adam::step`] times the group's `lr_scale`) and the group's weight decay `wd` does
//! what torch's single-tensor f32 path does, in the same order:
//!
//! ```text
//! g  = g + wd * p                              (L2 penalty, skipped when wd == 0)
//! m  = m + (1-beta1) * (g - m)                 (torch: exp_avg.lerp_(grad, 1-beta1))
//! v  = v * beta2;  v = v + (1-beta2) * g * g   (torch: mul_ then addcmul_)
//! v̂  = max(v̂, v)                               (amsgrad only; the denominator then uses v̂)
//! denom = sqrt(v) / sqrt(1 - beta2^t) + eps
//! p  = p + (-(lr / (1 - beta1^t)) * m) / denom (torch: addcdiv_(m, denom, value=-step_size))
//! ```
//!
//! The scalars are computed in f64 from the decimal values of the f32 hyper-parameters (the
//! Python floats torch sees) and rounded to f32 once per step ([`AdamStepScalars`]); the
//! elementwise work is f32 in fixed chunks, so a step is bit-identical for any thread count.
//! Elements outside every group are left untouched (parameters and moments).

use std::path::Path;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::common::{
    check_beta, check_len, check_lr, check_non_negative, check_positive, chunks_of_segments,
    decimal_f64, split, split_mut, split_mut_opt,
};
use crate::error::Result;
use crate::group::{ParamGroup, Segment, validate_groups};
use crate::state_file::{self, StateOut};

const STATE_FORMAT: &str = "tilearn-adam";

/// Hyper-parameters of [`Adam`]. `Default` gives torch's defaults (lr 1e-3, betas
/// (0.9, 0.999), eps 1e-8, no weight decay, no amsgrad).
///
/// `lr` is the base learning rate (what a schedule multiplies); [`Adam::step`] takes the
/// learning rate of the current step explicitly. `weight_decay` (the L2 coefficient) is used by
/// [`Adam::with_single_group`]; each [`ParamGroup`] carries its own.
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

/// The per-group scalars of one Adam step, computed in f64 and rounded to f32 once: the whole
/// contract between the bookkeeping here and an elementwise (CPU or CUDA) kernel.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamStepScalars {
    /// L2 coefficient added as `g + weight_decay * p`; the term is skipped when 0 (as torch).
    pub weight_decay: f32,
    /// `1 - beta1`, the `lerp` weight of the first moment.
    pub one_minus_beta1: f32,
    pub beta2: f32,
    /// `1 - beta2`.
    pub one_minus_beta2: f32,
    /// `sqrt(1 - beta2^t)`.
    pub bias_correction2_sqrt: f32,
    /// `-(lr / (1 - beta1^t))`.
    pub neg_step_size: f32,
    pub eps: f32,
}

impl AdamStepScalars {
    /// Scalars for step `step` (1-based), group learning rate `lr` and L2 coefficient
    /// `weight_decay` (both f64, already widened from their decimal values).
    pub fn new(config: &AdamConfig, lr: f64, weight_decay: f64, step: u64) -> Self {
        let beta1 = decimal_f64(config.beta1);
        let beta2 = decimal_f64(config.beta2);
        // torch: `step = _get_value(step_t)` is a Python float; `beta ** step`.
        let t = step as f64;
        let bias_correction1 = 1.0 - beta1.powf(t);
        let bias_correction2 = 1.0 - beta2.powf(t);
        AdamStepScalars {
            weight_decay: weight_decay as f32,
            one_minus_beta1: (1.0 - beta1) as f32,
            beta2: beta2 as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
            bias_correction2_sqrt: bias_correction2.sqrt() as f32,
            neg_step_size: (-(lr / bias_correction1)) as f32,
            eps: decimal_f64(config.eps) as f32,
        }
    }
}

/// torch's `lerp` for a scalar weight, as its scalar CPU kernel writes it.
#[inline(always)]
pub(crate) fn lerp(start: f32, end: f32, weight: f32) -> f32 {
    if weight.abs() < 0.5 {
        start + weight * (end - start)
    } else {
        end - (end - start) * (1.0 - weight)
    }
}

/// `torch.maximum`: NaN in either operand gives NaN.
#[inline(always)]
pub(crate) fn nan_max(a: f32, b: f32) -> f32 {
    if a.is_nan() || a >= b { a } else { b }
}

/// The elementwise Adam update on equal-length slices (one chunk of one range).
fn update_slice(
    s: &AdamStepScalars,
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    vmax: Option<&mut [f32]>,
) {
    let wd = s.weight_decay;
    let decay = wd != 0.0;
    match vmax {
        Some(vmax) => {
            for ((((pi, &gi), mi), vi), xi) in p
                .iter_mut()
                .zip(g)
                .zip(m.iter_mut())
                .zip(v.iter_mut())
                .zip(vmax)
            {
                let gi = if decay { gi + wd * *pi } else { gi };
                *mi = lerp(*mi, gi, s.one_minus_beta1);
                *vi *= s.beta2;
                *vi += s.one_minus_beta2 * gi * gi;
                *xi = nan_max(*xi, *vi);
                let denom = xi.sqrt() / s.bias_correction2_sqrt + s.eps;
                *pi += s.neg_step_size * *mi / denom;
            }
        }
        None => {
            for (((pi, &gi), mi), vi) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
                let gi = if decay { gi + wd * *pi } else { gi };
                *mi = lerp(*mi, gi, s.one_minus_beta1);
                *vi *= s.beta2;
                *vi += s.one_minus_beta2 * gi * gi;
                let denom = vi.sqrt() / s.bias_correction2_sqrt + s.eps;
                *pi += s.neg_step_size * *mi / denom;
            }
        }
    }
}

/// Adam (torch semantics) over one flat f32 buffer of `numel` elements split into groups.
#[derive(Debug, Clone)]
pub struct Adam {
    config: AdamConfig,
    groups: Vec<ParamGroup>,
    segments: Vec<Segment>,
    numel: usize,
    step: u64,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    /// Empty unless `config.amsgrad`.
    max_exp_avg_sq: Vec<f32>,
}

impl Adam {
    /// Validates `config` and `groups` (ranges within `0..numel`, no two overlapping) and
    /// allocates zeroed moments of `numel` elements (plus `max_exp_avg_sq` with amsgrad).
    pub fn new(config: AdamConfig, groups: Vec<ParamGroup>, numel: usize) -> Result<Self> {
        config.validate()?;
        let segments = validate_groups(&groups, numel)?;
        let amsgrad_len = if config.amsgrad { numel } else { 0 };
        Ok(Adam {
            config,
            groups,
            segments,
            numel,
            step: 0,
            exp_avg: vec![0.0; numel],
            exp_avg_sq: vec![0.0; numel],
            max_exp_avg_sq: vec![0.0; amsgrad_len],
        })
    }

    /// One group `"default"` covering `0..numel` with `config.weight_decay`.
    pub fn with_single_group(config: AdamConfig, numel: usize) -> Result<Self> {
        let group = ParamGroup::whole("default", numel, config.weight_decay);
        Self::new(config, vec![group], numel)
    }

    pub fn config(&self) -> &AdamConfig {
        &self.config
    }

    pub fn groups(&self) -> &[ParamGroup] {
        &self.groups
    }

    /// The non-empty ranges of all groups sorted by start (what a multi-tensor kernel walks).
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// Length of the parameter, gradient and moment buffers.
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// Number of completed steps (torch's `state["step"]`).
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// First moments (`exp_avg`), `numel` elements.
    pub fn exp_avg(&self) -> &[f32] {
        &self.exp_avg
    }

    /// Second moments (`exp_avg_sq`), `numel` elements.
    pub fn exp_avg_sq(&self) -> &[f32] {
        &self.exp_avg_sq
    }

    /// Running maxima of the second moments; `Some` only with amsgrad.
    pub fn max_exp_avg_sq(&self) -> Option<&[f32]> {
        self.config.amsgrad.then_some(&self.max_exp_avg_sq[..])
    }

    /// Mutable moments `(exp_avg, exp_avg_sq, max_exp_avg_sq)` for a device path that keeps
    /// the host copy in sync (the last is `None` without amsgrad).
    pub fn state_mut(&mut self) -> (&mut [f32], &mut [f32], Option<&mut [f32]>) {
        let amsgrad = self.config.amsgrad;
        (
            &mut self.exp_avg,
            &mut self.exp_avg_sq,
            amsgrad.then_some(&mut self.max_exp_avg_sq[..]),
        )
    }

    /// The scalars the next step (`step_count() + 1`) would use for group `group` at `lr`.
    /// `None` if `group` is out of range.
    pub fn step_scalars(&self, group: usize, lr: f32) -> Option<AdamStepScalars> {
        let g = self.groups.get(group)?;
        Some(self.scalars_for(g, lr, self.step + 1))
    }

    fn scalars_for(&self, g: &ParamGroup, lr: f32, step: u64) -> AdamStepScalars {
        let lr_group = decimal_f64(lr) * decimal_f64(g.lr_scale);
        AdamStepScalars::new(&self.config, lr_group, decimal_f64(g.weight_decay), step)
    }

    /// One Adam step with learning rate `lr` (times each group's `lr_scale`) on `params`
    /// using `grads`; both must have `numel` elements. Increments the step counter.
    ///
    /// Errors (nothing is modified): `LengthMismatch` for wrong buffer lengths,
    /// `InvalidHyperParameter` for a non-finite or negative `lr`. Non-finite gradients are not
    /// checked (the caller — e.g. a GradScaler — decides whether to step).
    pub fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f32) -> Result<()> {
        check_len("Adam::step params", self.numel, params.len())?;
        check_len("Adam::step grads", self.numel, grads.len())?;
        check_lr(lr)?;
        let step = self.step + 1;
        let scalars: Vec<AdamStepScalars> = self
            .groups
            .iter()
            .map(|g| self.scalars_for(g, lr, step))
            .collect();
        let chunks = chunks_of_segments(&self.segments);
        let p = split_mut(params, &chunks);
        let g = split(grads, &chunks);
        let m = split_mut(&mut self.exp_avg, &chunks);
        let v = split_mut(&mut self.exp_avg_sq, &chunks);
        let x = split_mut_opt(&mut self.max_exp_avg_sq, self.config.amsgrad, &chunks);
        chunks
            .par_iter()
            .zip(p)
            .zip(g)
            .zip(m)
            .zip(v)
            .zip(x)
            .for_each(|(((((c, p), g), m), v), x)| {
                update_slice(&scalars[c.group], p, g, m, v, x);
            });
        self.step = step;
        Ok(())
    }

    /// Writes the state atomically to a safetensors file (format `tilearn-adam`): tensors
    /// `exp_avg`, `exp_avg_sq` (and `max_exp_avg_sq` with amsgrad); metadata `step`, `numel`,
    /// `config`, `groups`.
    pub fn save_state(&self, path: &Path) -> Result<()> {
        let mut tensors = vec![
            ("exp_avg", &self.exp_avg[..]),
            ("exp_avg_sq", &self.exp_avg_sq[..]),
        ];
        if self.config.amsgrad {
            tensors.push(("max_exp_avg_sq", &self.max_exp_avg_sq[..]));
        }
        state_file::save(
            path,
            StateOut {
                format: STATE_FORMAT,
                step: self.step,
                numel: self.numel,
                config: &self.config,
                groups: &self.groups,
                tensors,
            },
        )
    }

    /// Reads a state written by [`Adam::save_state`]: moments and step counter. The
    /// hyper-parameters and groups of `self` are kept; the file must match `numel` and have
    /// been saved with the same `amsgrad`. Any problem gives `OptimError::State` and leaves
    /// `self` unchanged.
    pub fn load_state(&mut self, path: &Path) -> Result<()> {
        let amsgrad = self.config.amsgrad;
        let loaded = state_file::load(path, STATE_FORMAT, self.numel, |c: &AdamConfig| {
            if c.amsgrad != amsgrad {
                return Err(format!(
                    "state was saved with amsgrad = {}, this optimizer has amsgrad = {amsgrad}",
                    c.amsgrad
                ));
            }
            let mut names = vec!["exp_avg", "exp_avg_sq"];
            if amsgrad {
                names.push("max_exp_avg_sq");
            }
            Ok(names)
        })?;
        let mut t = loaded.tensors.into_iter();
        let (Some(m), Some(v)) = (t.next(), t.next()) else {
            return Err(crate::error::OptimError::State {
                file: path.to_path_buf(),
                message: "moments missing".to_string(),
            });
        };
        self.step = loaded.step;
        self.exp_avg = m;
        self.exp_avg_sq = v;
        self.max_exp_avg_sq = t.next().unwrap_or_default();
        Ok(())
    }
}
