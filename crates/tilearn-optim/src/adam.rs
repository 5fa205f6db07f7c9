//! The Adam family over one flat f32 parameter buffer: [`Adam`] with `torch.optim.Adam`
//! semantics (L2 weight decay) and, as `Adam<AdamWConfig>` (alias [`AdamW`](crate::AdamW)),
//! `torch.optim.AdamW` semantics (decoupled weight decay); optional amsgrad for both. The config
//! type picks the [`WeightDecayMode`]; everything else is shared.
//!
//! Per element of every group range, one step `t` (1-based) with learning rate `lr` (the value
//! passed to [`Adam::step`] times the group's `lr_scale`) and the group's weight decay `wd` does
//! what torch's single-tensor f32 path does, in the same order:
//!
//! ```text
//! g  = g + wd * p                             (L2 mode: Adam; skipped when wd == 0)
//! p  = p * (1 - lr*wd)                        (decoupled mode: AdamW; skipped when wd == 0)
//! m  = m + (1-beta1) * (g - m)                (torch: exp_avg.lerp_(grad, 1-beta1))
//! v  = v * beta2;  v = v + (1-beta2) * g * g  (torch: mul_ then addcmul_)
//! v̂  = max(v̂, v)                              (amsgrad only; the denominator then uses v̂)
//! denom = sqrt(v) / sqrt(1 - beta2^t) + eps
//! p  = p + (-(lr / (1 - beta1^t)) * m) / denom (torch: addcdiv_(m, denom, value=-step_size))
//! ```
//!
//! The scalars (`1 - lr*wd`, bias corrections, step size) are computed in f64 as Python does and
//! rounded to f32 once per step ([`AdamStepScalars`]); the elementwise work is f32 in fixed
//! chunks run by rayon, so a step is bit-identical for any thread count. Elements outside every
//! group are left untouched (parameters and moments).

use std::path::Path;

use rayon::prelude::*;

pub use crate::adam_config::{AdamConfig, AdamVariant, WeightDecayMode};
pub use crate::adam_update::AdamStepScalars;
use crate::adam_update::update_slice;
use crate::bookkeeping::{Bookkeeping, bookkeeping_accessors, group_lr};
use crate::common::{
    check_len, chunks_of_segments, decimal_f64, gaps, split, split_mut, split_mut_opt,
};
use crate::error::{OptimError, Result};
use crate::group::ParamGroup;

/// Adam (torch semantics, weight-decay mode from `C`) over one flat f32 buffer of `numel`
/// elements split into groups.
#[derive(Debug, Clone)]
pub struct Adam<C: AdamVariant = AdamConfig> {
    base: Bookkeeping<C>,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    /// Empty unless amsgrad.
    max_exp_avg_sq: Vec<f32>,
}

impl<C: AdamVariant> Adam<C> {
    /// Validates `config` and `groups` (ranges within `0..numel`, no two overlapping) and
    /// allocates zeroed moments of `numel` elements (plus `max_exp_avg_sq` with amsgrad).
    pub fn new(config: C, groups: Vec<ParamGroup>, numel: usize) -> Result<Self> {
        config.hyper().validate()?;
        let amsgrad_len = if config.hyper().amsgrad { numel } else { 0 };
        Ok(Adam {
            base: Bookkeeping::new(config, groups, numel)?,
            exp_avg: vec![0.0; numel],
            exp_avg_sq: vec![0.0; numel],
            max_exp_avg_sq: vec![0.0; amsgrad_len],
        })
    }

    /// One group `"default"` covering `0..numel` with the config's `weight_decay`.
    pub fn with_single_group(config: C, numel: usize) -> Result<Self> {
        let group = ParamGroup::whole("default", numel, config.hyper().weight_decay);
        Self::new(config, vec![group], numel)
    }

    bookkeeping_accessors!(C);

    fn amsgrad(&self) -> bool {
        self.base.config.hyper().amsgrad
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
        self.amsgrad().then_some(&self.max_exp_avg_sq[..])
    }

    /// Mutable moments `(exp_avg, exp_avg_sq, max_exp_avg_sq)` for a device path that keeps
    /// the host copy in sync (the last is `None` without amsgrad).
    pub fn state_mut(&mut self) -> (&mut [f32], &mut [f32], Option<&mut [f32]>) {
        let amsgrad = self.amsgrad();
        (
            &mut self.exp_avg,
            &mut self.exp_avg_sq,
            amsgrad.then_some(&mut self.max_exp_avg_sq[..]),
        )
    }

    /// Replaces the moments and the step count, e.g. with state a device optimizer kept, so
    /// that [`Adam::save_state`] writes it. Lengths must equal `numel`, and `max_exp_avg_sq`
    /// must be given exactly when amsgrad is on.
    pub fn set_state(
        &mut self,
        exp_avg: Vec<f32>,
        exp_avg_sq: Vec<f32>,
        max_exp_avg_sq: Option<Vec<f32>>,
        step: u64,
    ) -> Result<()> {
        let numel = self.base.numel;
        for (what, len) in [("exp_avg", exp_avg.len()), ("exp_avg_sq", exp_avg_sq.len())] {
            if len != numel {
                return Err(OptimError::LengthMismatch {
                    what,
                    expected: numel,
                    actual: len,
                });
            }
        }
        let amsgrad = self.amsgrad();
        if max_exp_avg_sq.is_some() != amsgrad
            || max_exp_avg_sq.as_ref().is_some_and(|m| m.len() != numel)
        {
            return Err(OptimError::LengthMismatch {
                what: "max_exp_avg_sq (given exactly when amsgrad is on)",
                expected: if amsgrad { numel } else { 0 },
                actual: max_exp_avg_sq.as_ref().map_or(0, Vec::len),
            });
        }
        self.exp_avg = exp_avg;
        self.exp_avg_sq = exp_avg_sq;
        self.max_exp_avg_sq = max_exp_avg_sq.unwrap_or_default();
        self.base.step = step;
        Ok(())
    }

    /// The scalars the next step (`step_count() + 1`) would use for group `group` at `lr`.
    /// `None` if `group` is out of range.
    pub fn step_scalars(&self, group: usize, lr: f32) -> Option<AdamStepScalars<C>> {
        let g = self.base.groups.get(group)?;
        Some(self.scalars_for(g, lr, self.base.step + 1))
    }

    fn scalars_for(&self, g: &ParamGroup, lr: f32, step: u64) -> AdamStepScalars<C> {
        AdamStepScalars::new(
            &self.base.config,
            group_lr(g, lr),
            decimal_f64(g.weight_decay),
            step,
        )
    }

    /// One step with learning rate `lr` (times each group's `lr_scale`) on `params` using
    /// `grads`; both must have `numel` elements. Increments the step counter.
    ///
    /// Errors (nothing is modified): `LengthMismatch` for wrong buffer lengths,
    /// `InvalidHyperParameter` for a non-finite or negative `lr`. Non-finite gradients are not
    /// checked (the caller — e.g. a GradScaler — decides whether to step).
    pub fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f32) -> Result<()> {
        self.step_fused(params, grads, lr, 1.0, None)
    }

    /// [`Adam::step`] with what the fused CUDA kernel does around it, for the host copy of its
    /// work (the lean mode's host optimizer): every gradient multiplied by `grad_scale` first
    /// (the clip coefficient, without `clip_grad_norm`'s pass over the gradients, which are
    /// left as they are; 1 changes nothing) and, with `copy` (`numel` elements), every
    /// parameter afterwards written to it as bf16 bits ([`bf16_copy`](crate::bf16_copy)), the
    /// elements outside the groups included. The same bits as scaling the gradients, stepping
    /// and casting in three passes, in one pass over the state.
    pub fn step_fused(
        &mut self,
        params: &mut [f32],
        grads: &[f32],
        lr: f32,
        grad_scale: f32,
        mut copy: Option<&mut [u16]>,
    ) -> Result<()> {
        let what = ["Adam::step params", "Adam::step grads"];
        self.base.check_step(what, params, grads, lr)?;
        if let Some(copy) = &copy {
            check_len("Adam::step_fused copy", self.base.numel, copy.len())?;
        }
        let step = self.base.step + 1;
        let scalars: Vec<AdamStepScalars<C>> = self
            .base
            .groups
            .iter()
            .map(|g| self.scalars_for(g, lr, step))
            .collect();
        let amsgrad = self.amsgrad();
        let chunks = chunks_of_segments(&self.base.segments);
        let p = split_mut(params, &chunks);
        let g = split(grads, &chunks);
        let m = split_mut(&mut self.exp_avg, &chunks);
        let v = split_mut(&mut self.exp_avg_sq, &chunks);
        let x = split_mut_opt(&mut self.max_exp_avg_sq, amsgrad, &chunks);
        let copies: Vec<Option<&mut [u16]>> = match copy.as_deref_mut() {
            Some(copy) => split_mut(copy, &chunks).into_iter().map(Some).collect(),
            None => chunks.iter().map(|_| None).collect(),
        };
        chunks
            .par_iter()
            .zip(p)
            .zip(g)
            .zip(m)
            .zip(v)
            .zip(x)
            .zip(copies)
            .for_each(|((((((c, p), g), m), v), x), copy)| {
                update_slice(&scalars[c.group], (p, g, m, v), x, grad_scale, copy);
            });
        if let Some(copy) = copy {
            // Elements outside every group keep their value; their copy is written too.
            for gap in gaps(&chunks, params.len()) {
                crate::bf16_copy::cast_to_bf16_bits(&params[gap.clone()], &mut copy[gap]);
            }
        }
        self.base.step = step;
        Ok(())
    }

    /// Writes the state atomically (format `tilearn-adam` or `tilearn-adamw`, see
    /// `state_file`): tensors `exp_avg`, `exp_avg_sq` (and `max_exp_avg_sq` with amsgrad);
    /// metadata `step`, `numel`, `config`, `groups`.
    pub fn save_state(&self, path: &Path) -> Result<()> {
        let mut tensors = vec![
            ("exp_avg", &self.exp_avg[..]),
            ("exp_avg_sq", &self.exp_avg_sq[..]),
        ];
        if self.amsgrad() {
            tensors.push(("max_exp_avg_sq", &self.max_exp_avg_sq[..]));
        }
        self.base.save_state(path, C::STATE_FORMAT, tensors)
    }

    /// Reads a state written by [`Adam::save_state`] of the same variant: moments and step
    /// counter. The hyper-parameters and groups of `self` are kept (a run may change them on
    /// resume, as with torch's `load_state_dict` followed by edits); the file must match `numel`
    /// and have been saved with the same `amsgrad`. Any problem (missing or truncated file, bad
    /// header, wrong dtype or length, missing tensor or metadata) gives `OptimError::State` and
    /// leaves `self` unchanged.
    pub fn load_state(&mut self, path: &Path) -> Result<()> {
        let amsgrad = self.amsgrad();
        let mut loaded = self.base.load_state(path, C::STATE_FORMAT, |c: &C| {
            let saved = c.hyper().amsgrad;
            if saved != amsgrad {
                return Err(format!(
                    "state was saved with amsgrad = {saved}, this optimizer has amsgrad = {amsgrad}"
                ));
            }
            let mut names = vec!["exp_avg", "exp_avg_sq"];
            if amsgrad {
                names.push("max_exp_avg_sq");
            }
            Ok(names)
        })?;
        self.base.step = loaded.step;
        self.exp_avg = loaded.next_buffer();
        self.exp_avg_sq = loaded.next_buffer();
        self.max_exp_avg_sq = loaded.next_buffer();
        Ok(())
    }
}
