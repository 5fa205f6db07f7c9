//! SGD over one flat f32 parameter buffer, with `torch.optim.SGD` semantics (momentum,
//! dampening, nesterov, L2 weight decay).
//!
//! Per element of every group range, one step with learning rate `lr` (the value passed to
//! [`Sgd::step`] times the group's `lr_scale`) and the group's weight decay `wd` does what
//! torch's single-tensor f32 path does, in the same order:
//!
//! ```text
//! g   = g + wd * p                        (skipped when wd == 0)
//! if momentum != 0:
//!     buf = g                             (first step: torch clones the gradient, no dampening)
//!     buf = buf * momentum + (1-dampening) * g   (later steps: mul_ then add_(alpha))
//!     g   = g + momentum * buf            (nesterov)   or   g = buf   (otherwise)
//! p   = p + (-lr) * g                     (torch: add_(grad, alpha=-lr))
//! ```
//!
//! The scalars are computed in f64 from the decimal values of the f32 hyper-parameters and
//! rounded to f32 once per step ([`SgdStepScalars`]); the elementwise work is f32 in fixed
//! chunks, so a step is bit-identical for any thread count. Elements outside every group are
//! left untouched.

use std::path::Path;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::bookkeeping::{Bookkeeping, bookkeeping_accessors, group_lr};
use crate::common::{
    check_beta, check_lr, check_non_negative, check_unit_closed, chunks_of_segments, decimal_f64,
    split, split_mut, split_mut_opt,
};
use crate::error::{OptimError, Result};
use crate::group::ParamGroup;

const STATE_FORMAT: &str = "tilearn-sgd";

/// Hyper-parameters of [`Sgd`]. `Default`: lr 1e-3, no momentum, no dampening, no weight
/// decay, no nesterov (torch's defaults apart from lr, which torch requires explicitly).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SgdConfig {
    pub lr: f32,
    pub momentum: f32,
    pub dampening: f32,
    pub weight_decay: f32,
    pub nesterov: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        SgdConfig {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
}

impl SgdConfig {
    /// Checks the hyper-parameters: `lr` finite and >= 0, `momentum` in `[0, 1)`, `dampening`
    /// in `[0, 1]`, `weight_decay` finite and >= 0, and (as torch) nesterov only with
    /// `momentum > 0` and `dampening == 0`.
    pub fn validate(&self) -> Result<()> {
        check_lr(self.lr)?;
        check_beta("momentum", self.momentum)?;
        check_unit_closed("dampening", self.dampening)?;
        check_non_negative("weight_decay", self.weight_decay)?;
        if self.nesterov {
            if self.momentum == 0.0 {
                return Err(OptimError::InvalidHyperParameter {
                    name: "momentum",
                    value: f64::from(self.momentum),
                    message: "nesterov requires momentum > 0",
                });
            }
            if self.dampening != 0.0 {
                return Err(OptimError::InvalidHyperParameter {
                    name: "dampening",
                    value: f64::from(self.dampening),
                    message: "nesterov requires dampening == 0",
                });
            }
        }
        Ok(())
    }

    /// Whether a momentum buffer exists (torch keeps none when momentum is 0).
    pub fn uses_momentum(&self) -> bool {
        self.momentum != 0.0
    }
}

/// The per-group scalars of one SGD step, rounded to f32 once: the whole contract between the
/// bookkeeping here and an elementwise (CPU or CUDA) kernel.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdStepScalars {
    /// L2 coefficient added as `g + weight_decay * p`; skipped when 0.
    pub weight_decay: f32,
    /// 0 means plain SGD without a momentum buffer.
    pub momentum: f32,
    /// `1 - dampening`, the weight of the gradient added to the buffer after the first step.
    pub one_minus_dampening: f32,
    pub nesterov: bool,
    /// First step of the buffer: `buf = g` (no decay of the zero buffer, no dampening).
    pub first_step: bool,
    /// `-lr` (group-scaled).
    pub neg_lr: f32,
}

impl SgdStepScalars {
    /// Scalars for a step with group learning rate `lr` and weight decay `weight_decay` (f64,
    /// widened from their decimal values); `first_step` when no step has run yet.
    pub fn new(config: &SgdConfig, lr: f64, weight_decay: f64, first_step: bool) -> Self {
        SgdStepScalars {
            weight_decay: weight_decay as f32,
            momentum: decimal_f64(config.momentum) as f32,
            one_minus_dampening: (1.0 - decimal_f64(config.dampening)) as f32,
            nesterov: config.nesterov,
            first_step,
            neg_lr: (-lr) as f32,
        }
    }
}

/// The elementwise SGD update on equal-length slices (one chunk of one range).
fn update_slice(s: &SgdStepScalars, p: &mut [f32], g: &[f32], buf: Option<&mut [f32]>) {
    let wd = s.weight_decay;
    let decay = wd != 0.0;
    match buf {
        Some(buf) => {
            for ((pi, &gi), bi) in p.iter_mut().zip(g).zip(buf) {
                let gi = if decay { gi + wd * *pi } else { gi };
                *bi = if s.first_step {
                    gi
                } else {
                    *bi * s.momentum + s.one_minus_dampening * gi
                };
                let d = if s.nesterov {
                    gi + s.momentum * *bi
                } else {
                    *bi
                };
                *pi += s.neg_lr * d;
            }
        }
        None => {
            for (pi, &gi) in p.iter_mut().zip(g) {
                let gi = if decay { gi + wd * *pi } else { gi };
                *pi += s.neg_lr * gi;
            }
        }
    }
}

/// SGD (torch semantics) over one flat f32 buffer of `numel` elements split into groups. The
/// momentum buffer is initialised by the first step (`step_count() == 0` until then).
#[derive(Debug, Clone)]
pub struct Sgd {
    base: Bookkeeping<SgdConfig>,
    /// Empty unless momentum != 0.
    momentum_buffer: Vec<f32>,
}

impl Sgd {
    /// Validates `config` and `groups` and allocates the momentum buffer (`numel` zeros, only
    /// with momentum).
    pub fn new(config: SgdConfig, groups: Vec<ParamGroup>, numel: usize) -> Result<Self> {
        config.validate()?;
        let buf_len = if config.uses_momentum() { numel } else { 0 };
        Ok(Sgd {
            base: Bookkeeping::new(config, groups, numel)?,
            momentum_buffer: vec![0.0; buf_len],
        })
    }

    /// One group `"default"` covering `0..numel` with `config.weight_decay`.
    pub fn with_single_group(config: SgdConfig, numel: usize) -> Result<Self> {
        let group = ParamGroup::whole("default", numel, config.weight_decay);
        Self::new(config, vec![group], numel)
    }

    bookkeeping_accessors!(SgdConfig);

    /// The momentum buffer; `Some` only with momentum != 0.
    pub fn momentum_buffer(&self) -> Option<&[f32]> {
        self.base
            .config
            .uses_momentum()
            .then_some(&self.momentum_buffer[..])
    }

    /// Mutable momentum buffer (for a device path that keeps the host copy in sync).
    pub fn momentum_buffer_mut(&mut self) -> Option<&mut [f32]> {
        self.base
            .config
            .uses_momentum()
            .then_some(&mut self.momentum_buffer[..])
    }

    /// The scalars the next step would use for group `group` at `lr`; `None` if `group` is out
    /// of range.
    pub fn step_scalars(&self, group: usize, lr: f32) -> Option<SgdStepScalars> {
        let g = self.base.groups.get(group)?;
        Some(self.scalars_for(g, lr))
    }

    fn scalars_for(&self, g: &ParamGroup, lr: f32) -> SgdStepScalars {
        SgdStepScalars::new(
            &self.base.config,
            group_lr(g, lr),
            decimal_f64(g.weight_decay),
            self.base.step == 0,
        )
    }

    /// One SGD step with learning rate `lr` (times each group's `lr_scale`); `params` and
    /// `grads` must have `numel` elements. Increments the step counter.
    ///
    /// Errors (nothing is modified): `LengthMismatch`, or `InvalidHyperParameter` for a
    /// non-finite or negative `lr`.
    pub fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f32) -> Result<()> {
        let what = ["Sgd::step params", "Sgd::step grads"];
        self.base.check_step(what, params, grads, lr)?;
        let scalars: Vec<SgdStepScalars> = self
            .base
            .groups
            .iter()
            .map(|g| self.scalars_for(g, lr))
            .collect();
        let chunks = chunks_of_segments(&self.base.segments);
        let p = split_mut(params, &chunks);
        let g = split(grads, &chunks);
        let uses = self.base.config.uses_momentum();
        let b = split_mut_opt(&mut self.momentum_buffer, uses, &chunks);
        chunks
            .par_iter()
            .zip(p)
            .zip(g)
            .zip(b)
            .for_each(|(((c, p), g), b)| update_slice(&scalars[c.group], p, g, b));
        self.base.step += 1;
        Ok(())
    }

    /// Writes the state atomically (format `tilearn-sgd`, see `state_file`): tensor
    /// `momentum_buffer` (only with momentum); metadata `step`, `numel`, `config`, `groups`.
    pub fn save_state(&self, path: &Path) -> Result<()> {
        let mut tensors = Vec::new();
        if self.base.config.uses_momentum() {
            tensors.push(("momentum_buffer", &self.momentum_buffer[..]));
        }
        self.base.save_state(path, STATE_FORMAT, tensors)
    }

    /// Reads a state written by [`Sgd::save_state`]. The file must match `numel` and agree on
    /// whether a momentum buffer exists. Any problem gives `OptimError::State` and leaves
    /// `self` unchanged.
    pub fn load_state(&mut self, path: &Path) -> Result<()> {
        let momentum = self.base.config.momentum;
        let uses = self.base.config.uses_momentum();
        let mut loaded = self.base.load_state(path, STATE_FORMAT, |c| {
            if c.uses_momentum() != uses {
                return Err(format!(
                    "state was saved with momentum = {}, this optimizer has momentum = \
                     {momentum} (a momentum buffer exists only for momentum != 0)",
                    c.momentum
                ));
            }
            Ok(if uses {
                vec!["momentum_buffer"]
            } else {
                Vec::new()
            })
        })?;
        self.base.step = loaded.step;
        self.momentum_buffer = loaded.next_buffer();
        Ok(())
    }
}
