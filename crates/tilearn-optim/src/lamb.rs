//! LAMB over one flat f32 parameter buffer, with the semantics of NVIDIA Apex's `FusedLAMB`
//! (`adam_w_mode=True`, the default).
//!
//! One step `t` (1-based) with learning rate `lr` (the value passed to [`Lamb::step`] times the
//! group's `lr_scale`) and the group's weight decay `wd`:
//!
//! ```text
//! norm = ||g|| over every group element           (only with max_grad_norm = Some(max))
//! clip = norm / max if norm > max else 1          (Apex divides the gradient by it)
//! per element:
//!   s  = g / clip
//!   m  = m * beta1 + beta3 * s                    (beta3 = 1-beta1 with grad_averaging, else 1)
//!   v  = v * beta2 + (1-beta2) * s * s
//!   u  = (m / bc1) / (sqrt(v / bc2) + eps) + wd * p   (bc = 1 - beta^t, or 1 without
//!                                                      bias_correction; `+ wd*p` skipped at 0)
//! per tensor (the `tensor_ranges` given at construction):
//!   ratio = lr * ||p|| / ||u||   if (use_nvlamb or wd != 0) and both norms are non-zero
//!   ratio = lr                   otherwise
//! per element:
//!   p  = p - ratio * u
//! ```
//!
//! The norms are accumulated in f64 over fixed chunks in a fixed order, and every scalar
//! (clip divisor, bias corrections, ratio) is computed in f64 and rounded to f32 once, so a
//! step is bit-identical for any thread count. Apex computes `1 - beta2` and the bias
//! corrections from f32 betas on the device; here they come from the decimal (Python) values,
//! as for torch's optimizers — the difference is below f32 resolution of the update except in
//! `1 - beta2` (about 1e-5 relative for beta2 = 0.999), which only a bit-exact comparison with
//! Apex itself would see.

use std::ops::Range;
use std::path::Path;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::bookkeeping::{Bookkeeping, bookkeeping_accessors, group_lr};
use crate::clip::sum_of_squares;
use crate::common::{
    CHUNK, Chunk, check_beta, check_len, check_lr, check_non_negative, check_positive, decimal_f64,
    split, split_mut,
};
use crate::error::{OptimError, Result};
use crate::group::{ParamGroup, Segment};

const STATE_FORMAT: &str = "tilearn-lamb";

/// Hyper-parameters of [`Lamb`]. `Default` gives Apex `FusedLAMB`'s defaults: lr 1e-3, betas
/// (0.9, 0.999), eps 1e-6, weight decay 0.01, bias correction on, grad averaging on,
/// `max_grad_norm` 1.0, `use_nvlamb` off.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LambConfig {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    pub bias_correction: bool,
    /// Apex `grad_averaging`: the gradient enters the first moment with weight `1 - beta1`
    /// (true) or 1 (false).
    pub grad_averaging: bool,
    /// Global gradient-norm clipping threshold; `None` disables it.
    pub max_grad_norm: Option<f32>,
    /// Apex `use_nvlamb`: apply the trust ratio to every tensor, not only to those of groups
    /// with non-zero weight decay.
    pub use_nvlamb: bool,
}

impl Default for LambConfig {
    fn default() -> Self {
        LambConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-6,
            weight_decay: 0.01,
            bias_correction: true,
            grad_averaging: true,
            max_grad_norm: Some(1.0),
            use_nvlamb: false,
        }
    }
}

impl LambConfig {
    /// `lr` finite and >= 0, betas in `[0, 1)`, `eps` finite and > 0, `weight_decay` finite
    /// and >= 0, `max_grad_norm` (when set) finite and > 0.
    pub fn validate(&self) -> Result<()> {
        check_lr(self.lr)?;
        check_beta("beta1", self.beta1)?;
        check_beta("beta2", self.beta2)?;
        check_positive("eps", self.eps)?;
        check_non_negative("weight_decay", self.weight_decay)?;
        if let Some(max) = self.max_grad_norm {
            check_positive("max_grad_norm", max)?;
        }
        Ok(())
    }
}

/// The per-group scalars of the elementwise part of one LAMB step, rounded to f32 once. The
/// per-tensor ratio comes from [`lamb_trust_ratio`] once the norms are known.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LambStepScalars {
    /// The gradient is divided by this (1 when not clipping); see [`lamb_clip_divisor`].
    pub clip_divisor: f32,
    pub beta1: f32,
    /// Weight of the (clipped) gradient in the first moment: `1 - beta1` or 1.
    pub beta3: f32,
    pub beta2: f32,
    /// `1 - beta2`.
    pub one_minus_beta2: f32,
    /// `1 - beta1^t` (1 without bias correction).
    pub bias_correction1: f32,
    /// `1 - beta2^t` (1 without bias correction).
    pub bias_correction2: f32,
    pub eps: f32,
    /// Decoupled weight decay added to the update as `wd * p` (skipped when 0).
    pub weight_decay: f32,
    /// Whether the per-tensor trust ratio applies to this group (`use_nvlamb || wd != 0`).
    pub use_trust_ratio: bool,
    /// Group learning rate (the ratio when no trust ratio applies).
    pub lr: f32,
}

impl LambStepScalars {
    /// Scalars for step `step` (1-based), group learning rate `lr` and weight decay
    /// `weight_decay` (f64, widened from decimal values), and the clip divisor of this step.
    pub fn new(
        config: &LambConfig,
        lr: f64,
        weight_decay: f64,
        step: u64,
        clip_divisor: f32,
    ) -> Self {
        let beta1 = decimal_f64(config.beta1);
        let beta2 = decimal_f64(config.beta2);
        let t = step as f64;
        let (bc1, bc2) = if config.bias_correction {
            (1.0 - beta1.powf(t), 1.0 - beta2.powf(t))
        } else {
            (1.0, 1.0)
        };
        LambStepScalars {
            clip_divisor,
            beta1: beta1 as f32,
            beta3: if config.grad_averaging {
                (1.0 - beta1) as f32
            } else {
                1.0
            },
            beta2: beta2 as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
            bias_correction1: bc1 as f32,
            bias_correction2: bc2 as f32,
            eps: decimal_f64(config.eps) as f32,
            weight_decay: weight_decay as f32,
            use_trust_ratio: config.use_nvlamb || weight_decay != 0.0,
            lr: lr as f32,
        }
    }
}

/// Apex's clip divisor for a global gradient norm: `norm / max` when `norm > max`, else 1
/// (also 1 for a NaN norm, as Apex's comparison gives, and without `max_grad_norm`).
pub fn lamb_clip_divisor(global_grad_norm: f64, max_grad_norm: Option<f32>) -> f32 {
    match max_grad_norm {
        Some(max) => {
            let max = decimal_f64(max);
            if global_grad_norm > max {
                (global_grad_norm / max) as f32
            } else {
                1.0
            }
        }
        None => 1.0,
    }
}

/// The learning rate applied to one tensor: `lr * param_norm / update_norm` when the trust
/// ratio applies and both norms are non-zero, else `lr`; computed in f64, rounded once.
pub fn lamb_trust_ratio(lr: f64, param_norm: f64, update_norm: f64, use_trust_ratio: bool) -> f32 {
    if use_trust_ratio && param_norm != 0.0 && update_norm != 0.0 {
        (lr * (param_norm / update_norm)) as f32
    } else {
        lr as f32
    }
}

/// Stage 1 on one chunk: moments and the update `u`; returns `(sum p², sum u²)` in f64.
fn stage1(
    s: &LambStepScalars,
    p: &[f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    u: &mut [f32],
) -> (f64, f64) {
    let decay = s.weight_decay != 0.0;
    let mut pp = 0.0f64;
    let mut uu = 0.0f64;
    for ((((&pi, &gi), mi), vi), ui) in p
        .iter()
        .zip(g)
        .zip(m.iter_mut())
        .zip(v.iter_mut())
        .zip(u.iter_mut())
    {
        let sg = gi / s.clip_divisor;
        *mi = *mi * s.beta1 + s.beta3 * sg;
        *vi = *vi * s.beta2 + s.one_minus_beta2 * sg * sg;
        let m_hat = *mi / s.bias_correction1;
        let v_hat = *vi / s.bias_correction2;
        let denom = v_hat.sqrt() + s.eps;
        let mut upd = m_hat / denom;
        if decay {
            upd += s.weight_decay * pi;
        }
        *ui = upd;
        pp += f64::from(pi) * f64::from(pi);
        uu += f64::from(upd) * f64::from(upd);
    }
    (pp, uu)
}

/// LAMB (Apex `FusedLAMB` semantics) over one flat f32 buffer split into groups, with
/// per-tensor trust ratios over `tensor_ranges`.
#[derive(Debug, Clone)]
pub struct Lamb {
    base: Bookkeeping<LambConfig>,
    /// Non-empty tensors inside a group, sorted by start, each with its group index.
    tensors: Vec<(Range<usize>, usize)>,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    /// Scratch for the update `u` of the current step (Apex writes it into the gradient).
    update: Vec<f32>,
    /// The ratio applied to each tensor of `tensors` in the last step.
    last_ratios: Vec<f32>,
}

impl Lamb {
    /// Validates `config`, `groups` and `tensor_ranges` and allocates zeroed moments.
    ///
    /// `tensor_ranges` are the model's per-tensor views into the flat buffer (the units of the
    /// trust ratio). Each non-empty range must lie inside one group range or outside every
    /// group (a frozen tensor, ignored); they must not overlap; and together they must cover
    /// every group element. Violations give `InvalidTensorRange` (or `RangeOutOfBounds`).
    pub fn new(
        config: LambConfig,
        groups: Vec<ParamGroup>,
        numel: usize,
        tensor_ranges: Vec<Range<usize>>,
    ) -> Result<Self> {
        config.validate()?;
        let base = Bookkeeping::new(config, groups, numel)?;
        let tensors = assign_tensors(&base.segments, numel, tensor_ranges)?;
        let n_tensors = tensors.len();
        Ok(Lamb {
            base,
            tensors,
            exp_avg: vec![0.0; numel],
            exp_avg_sq: vec![0.0; numel],
            update: vec![0.0; numel],
            last_ratios: vec![0.0; n_tensors],
        })
    }

    /// One group `"default"` covering `0..numel` with `config.weight_decay`.
    pub fn with_single_group(
        config: LambConfig,
        numel: usize,
        tensor_ranges: Vec<Range<usize>>,
    ) -> Result<Self> {
        let group = ParamGroup::whole("default", numel, config.weight_decay);
        Self::new(config, vec![group], numel, tensor_ranges)
    }

    bookkeeping_accessors!(LambConfig);

    /// The trust-ratio tensors inside groups, sorted by start, with their group index.
    pub fn tensors(&self) -> &[(Range<usize>, usize)] {
        &self.tensors
    }

    /// First moments, `numel` elements.
    pub fn exp_avg(&self) -> &[f32] {
        &self.exp_avg
    }

    /// Second moments, `numel` elements.
    pub fn exp_avg_sq(&self) -> &[f32] {
        &self.exp_avg_sq
    }

    /// Mutable moments `(exp_avg, exp_avg_sq)` (for a device path that keeps the host copy in
    /// sync).
    pub fn state_mut(&mut self) -> (&mut [f32], &mut [f32]) {
        (&mut self.exp_avg, &mut self.exp_avg_sq)
    }

    /// The learning rate applied to each tensor of [`Lamb::tensors`] in the last step (the
    /// trust ratio times lr, or lr); zeros before the first step.
    pub fn last_ratios(&self) -> &[f32] {
        &self.last_ratios
    }

    /// The global gradient norm Apex clips with: L2 over every group element, f64,
    /// deterministic (fixed chunks summed in buffer order).
    pub fn global_grad_norm(&self, grads: &[f32]) -> Result<f64> {
        check_len("Lamb::global_grad_norm grads", self.base.numel, grads.len())?;
        Ok(self
            .base
            .segments
            .iter()
            .map(|s| sum_of_squares(&grads[s.range.clone()]))
            .sum::<f64>()
            .sqrt())
    }

    /// The elementwise scalars the next step would use for group `group` at `lr` given the
    /// step's global gradient norm (ignored without `max_grad_norm`); `None` if `group` is out
    /// of range.
    pub fn step_scalars(
        &self,
        group: usize,
        lr: f32,
        global_grad_norm: f64,
    ) -> Option<LambStepScalars> {
        let g = self.base.groups.get(group)?;
        let clip = lamb_clip_divisor(global_grad_norm, self.base.config.max_grad_norm);
        Some(self.scalars_for(g, lr, self.base.step + 1, clip))
    }

    fn scalars_for(&self, g: &ParamGroup, lr: f32, step: u64, clip: f32) -> LambStepScalars {
        LambStepScalars::new(
            &self.base.config,
            group_lr(g, lr),
            decimal_f64(g.weight_decay),
            step,
            clip,
        )
    }

    /// Chunks of at most `CHUNK` elements, each inside one tensor, in buffer order.
    fn chunks(&self) -> Vec<Chunk> {
        let mut out = Vec::new();
        for (ti, (r, gi)) in self.tensors.iter().enumerate() {
            let mut start = r.start;
            while start < r.end {
                let end = (start + CHUNK).min(r.end);
                out.push(Chunk {
                    group: *gi,
                    tensor: ti,
                    range: start..end,
                });
                start = end;
            }
        }
        out
    }

    /// One LAMB step with learning rate `lr` (times each group's `lr_scale`); `params` and
    /// `grads` must have `numel` elements. Increments the step counter.
    ///
    /// Errors (nothing is modified): `LengthMismatch`, or `InvalidHyperParameter` for a
    /// non-finite or negative `lr`.
    pub fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f32) -> Result<()> {
        let what = ["Lamb::step params", "Lamb::step grads"];
        self.base.check_step(what, params, grads, lr)?;
        let step = self.base.step + 1;
        let max_grad_norm = self.base.config.max_grad_norm;
        let clip = match max_grad_norm {
            Some(_) => lamb_clip_divisor(self.global_grad_norm(grads)?, max_grad_norm),
            None => 1.0,
        };
        let scalars: Vec<LambStepScalars> = self
            .base
            .groups
            .iter()
            .map(|g| self.scalars_for(g, lr, step, clip))
            .collect();
        let chunks = self.chunks();

        // Stage 1: moments, update, and per-chunk squared norms (in chunk order).
        let partial: Vec<(f64, f64)> = {
            let p = split(params, &chunks);
            let g = split(grads, &chunks);
            let m = split_mut(&mut self.exp_avg, &chunks);
            let v = split_mut(&mut self.exp_avg_sq, &chunks);
            let u = split_mut(&mut self.update, &chunks);
            chunks
                .par_iter()
                .zip(p)
                .zip(g)
                .zip(m)
                .zip(v)
                .zip(u)
                .map(|(((((c, p), g), m), v), u)| stage1(&scalars[c.group], p, g, m, v, u))
                .collect()
        };

        // Per-tensor norms, summed in chunk order, then the ratio of each tensor.
        let mut sums = vec![(0.0f64, 0.0f64); self.tensors.len()];
        for (c, (pp, uu)) in chunks.iter().zip(&partial) {
            sums[c.tensor].0 += pp;
            sums[c.tensor].1 += uu;
        }
        let ratios: Vec<f32> = self
            .tensors
            .iter()
            .zip(&sums)
            .map(|((_, gi), &(pp, uu))| {
                let lr_group = group_lr(&self.base.groups[*gi], lr);
                lamb_trust_ratio(lr_group, pp.sqrt(), uu.sqrt(), scalars[*gi].use_trust_ratio)
            })
            .collect();

        // Stage 2: p = p - ratio * u.
        let p = split_mut(params, &chunks);
        let u = split(&self.update, &chunks);
        chunks.par_iter().zip(p).zip(u).for_each(|((c, p), u)| {
            let r = ratios[c.tensor];
            for (pi, &ui) in p.iter_mut().zip(u) {
                *pi -= r * ui;
            }
        });
        self.last_ratios = ratios;
        self.base.step = step;
        Ok(())
    }

    /// Writes the state atomically (format `tilearn-lamb`, see `state_file`): tensors
    /// `exp_avg`, `exp_avg_sq`; metadata `step`, `numel`, `config`, `groups`.
    pub fn save_state(&self, path: &Path) -> Result<()> {
        let tensors = vec![
            ("exp_avg", &self.exp_avg[..]),
            ("exp_avg_sq", &self.exp_avg_sq[..]),
        ];
        self.base.save_state(path, STATE_FORMAT, tensors)
    }

    /// Reads a state written by [`Lamb::save_state`] (must match `numel`). Any problem gives
    /// `OptimError::State` and leaves `self` unchanged.
    pub fn load_state(&mut self, path: &Path) -> Result<()> {
        let mut loaded = self
            .base
            .load_state(path, STATE_FORMAT, |_| Ok(vec!["exp_avg", "exp_avg_sq"]))?;
        self.base.step = loaded.step;
        self.exp_avg = loaded.next_buffer();
        self.exp_avg_sq = loaded.next_buffer();
        Ok(())
    }
}

/// Checks `tensor_ranges` against the group segments (see [`Lamb::new`]) and returns the
/// non-empty tensors inside groups, sorted by start, with their group index.
fn assign_tensors(
    segments: &[Segment],
    numel: usize,
    tensor_ranges: Vec<Range<usize>>,
) -> Result<Vec<(Range<usize>, usize)>> {
    let bad = |r: &Range<usize>, message: &'static str| OptimError::InvalidTensorRange {
        start: r.start,
        end: r.end,
        message,
    };
    let mut ranges: Vec<Range<usize>> = Vec::with_capacity(tensor_ranges.len());
    for r in tensor_ranges {
        if r.start > r.end {
            return Err(bad(&r, "reversed (start > end)"));
        }
        if r.end > numel {
            return Err(OptimError::RangeOutOfBounds {
                start: r.start,
                end: r.end,
                len: numel,
            });
        }
        if r.start < r.end {
            ranges.push(r);
        }
    }
    ranges.sort_by_key(|r| r.start);
    for pair in ranges.windows(2) {
        if pair[1].start < pair[0].end {
            return Err(bad(&pair[1], "overlaps another tensor range"));
        }
    }
    let mut out = Vec::with_capacity(ranges.len());
    let mut covered = 0usize;
    for r in ranges {
        // The first segment that ends after r.start (segments are sorted and disjoint).
        let i = segments.partition_point(|s| s.range.end <= r.start);
        match segments.get(i) {
            Some(s) if s.range.start <= r.start => {
                if r.end > s.range.end {
                    return Err(bad(&r, "straddles the end of a parameter-group range"));
                }
                covered += r.len();
                out.push((r, s.group));
            }
            Some(s) if s.range.start < r.end => {
                return Err(bad(&r, "straddles the start of a parameter-group range"));
            }
            // Entirely outside every group: a frozen tensor, not stepped.
            _ => {}
        }
    }
    let group_elems: usize = segments.iter().map(|s| s.range.len()).sum();
    if covered != group_elems {
        // Find the first uncovered group element for the message.
        let mut pos_iter = out.iter().map(|(r, _)| r.clone()).peekable();
        for s in segments {
            let mut pos = s.range.start;
            while pos < s.range.end {
                match pos_iter.peek() {
                    Some(t) if t.start == pos => {
                        pos = t.end;
                        pos_iter.next();
                    }
                    _ => {
                        let end = pos_iter
                            .peek()
                            .map_or(s.range.end, |t| t.start.min(s.range.end));
                        return Err(bad(
                            &(pos..end),
                            "group elements covered by no tensor range",
                        ));
                    }
                }
            }
        }
    }
    Ok(out)
}
