//! AdamW over one flat f32 parameter buffer, with `torch.optim.AdamW` semantics.
//!
//! Per element of every group range, one step `t` (1-based) with learning rate `lr` (the value
//! passed to [`AdamW::step`] times the group's `lr_scale`) and the group's weight decay `wd` does
//! what torch's single-tensor f32 path does, in the same order:
//!
//! ```text
//! p  = p * (1 - lr*wd)                        (decoupled decay, skipped when wd == 0)
//! m  = m + (1-beta1) * (g - m)                (torch: exp_avg.lerp_(grad, 1-beta1))
//! v  = v * beta2;  v = v + (1-beta2) * g * g  (torch: mul_ then addcmul_)
//! v̂  = max(v̂, v)                              (amsgrad only; the denominator then uses v̂)
//! denom = sqrt(v) / sqrt(1 - beta2^t) + eps
//! p  = p + (-(lr / (1 - beta1^t)) * m) / denom (torch: addcdiv_(m, denom, value=-step_size))
//! ```
//!
//! The scalars (`1 - lr*wd`, bias corrections, step size) are computed in f64 as Python does
//! and rounded to f32 once per step ([`AdamWStepScalars`]); the elementwise work is f32. The
//! f32 hyper-parameters are widened to f64 through their shortest decimal form, so `0.9f32`
//! becomes the Python float `0.9` and the bias corrections match torch's.
//!
//! The elementwise loop is split into fixed chunks run by rayon; every element is computed by
//! exactly the same operations whatever the thread count, so a step is bit-reproducible.
//! Elements outside every group are left untouched (parameters and moments).

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use safetensors::{Dtype, SafeTensors, View};
use serde::{Deserialize, Serialize};

use crate::common::decimal_f64;
use crate::error::{OptimError, Result};
use crate::group::{ParamGroup, Segment, validate_groups};

/// Elements per parallel work item of the CPU step.
const CHUNK: usize = 1 << 14;

/// Format tag written into the safetensors metadata of a state file.
const STATE_FORMAT: &str = "tilearn-adamw";
const STATE_FORMAT_VERSION: &str = "1";

/// Hyper-parameters of [`AdamW`]. `Default` gives Hugging Face Trainer's defaults
/// (`learning_rate` 5e-5, `adam_beta1` 0.9, `adam_beta2` 0.999, `adam_epsilon` 1e-8,
/// `weight_decay` 0.0, no amsgrad).
///
/// `lr` is the base learning rate (what a schedule multiplies); [`AdamW::step`] takes the
/// learning rate of the current step explicitly. `weight_decay` is the default decay for
/// groups built with [`AdamW::with_single_group`]; each [`ParamGroup`] carries its own.
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
        AdamWConfig {
            lr: 5e-5,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            amsgrad: false,
        }
    }
}

impl AdamWConfig {
    /// Checks the hyper-parameters: `lr` finite and >= 0, betas in `[0, 1)`, `eps` finite and
    /// > 0, `weight_decay` finite and >= 0.
    pub fn validate(&self) -> Result<()> {
        check_lr(self.lr)?;
        for (name, beta) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&beta) {
                return Err(OptimError::InvalidHyperParameter {
                    name,
                    value: f64::from(beta),
                    message: "must lie in [0, 1)",
                });
            }
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(OptimError::InvalidHyperParameter {
                name: "eps",
                value: f64::from(self.eps),
                message: "must be finite and > 0",
            });
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(OptimError::InvalidHyperParameter {
                name: "weight_decay",
                value: f64::from(self.weight_decay),
                message: "must be finite and >= 0",
            });
        }
        Ok(())
    }
}

fn check_lr(lr: f32) -> Result<()> {
    if lr.is_finite() && lr >= 0.0 {
        Ok(())
    } else {
        Err(OptimError::InvalidHyperParameter {
            name: "lr",
            value: f64::from(lr),
            message: "must be finite and >= 0",
        })
    }
}

/// The per-group scalars of one AdamW step, computed in f64 and rounded to f32 once.
///
/// This is the whole contract between the optimizer's bookkeeping and an elementwise kernel:
/// the CPU loop here and a fused CUDA kernel take the same values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStepScalars {
    /// Whether decoupled weight decay runs (torch skips it when `weight_decay == 0`).
    pub apply_decay: bool,
    /// `1 - lr * weight_decay`.
    pub decay_factor: f32,
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

impl AdamWStepScalars {
    /// Scalars for step `step` (1-based, already incremented as torch does before the update),
    /// learning rate `lr` (group-scaled) and weight decay `weight_decay`, all as f64.
    pub fn new(config: &AdamWConfig, lr: f64, weight_decay: f64, step: u64) -> Self {
        let beta1 = decimal_f64(config.beta1);
        let beta2 = decimal_f64(config.beta2);
        let eps = decimal_f64(config.eps);
        // torch: `step = _get_value(step_t)` is a Python float; `beta ** step`.
        let t = step as f64;
        let bias_correction1 = 1.0 - beta1.powf(t);
        let bias_correction2 = 1.0 - beta2.powf(t);
        let step_size = lr / bias_correction1;
        AdamWStepScalars {
            apply_decay: weight_decay != 0.0,
            decay_factor: (1.0 - lr * weight_decay) as f32,
            one_minus_beta1: (1.0 - beta1) as f32,
            beta2: beta2 as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
            bias_correction2_sqrt: bias_correction2.sqrt() as f32,
            neg_step_size: (-step_size) as f32,
            eps: eps as f32,
        }
    }
}

/// torch's `lerp` for a scalar weight, as its CPU kernel writes it.
#[inline(always)]
fn lerp(start: f32, end: f32, weight: f32) -> f32 {
    if weight.abs() < 0.5 {
        start + weight * (end - start)
    } else {
        end - (end - start) * (1.0 - weight)
    }
}

/// `torch.maximum`: NaN in either operand gives NaN.
#[inline(always)]
fn nan_max(a: f32, b: f32) -> f32 {
    if a.is_nan() || a >= b { a } else { b }
}

/// The elementwise AdamW update on equal-length slices (one chunk of one range).
fn update_slice(
    s: &AdamWStepScalars,
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    vmax: Option<&mut [f32]>,
) {
    debug_assert!(p.len() == g.len() && p.len() == m.len() && p.len() == v.len());
    if s.apply_decay {
        let f = s.decay_factor;
        p.iter_mut().for_each(|x| *x *= f);
    }
    for ((mi, vi), &gi) in m.iter_mut().zip(v.iter_mut()).zip(g) {
        *mi = lerp(*mi, gi, s.one_minus_beta1);
        *vi *= s.beta2;
        *vi += s.one_minus_beta2 * gi * gi;
    }
    let second = match vmax {
        Some(vmax) => {
            debug_assert_eq!(vmax.len(), v.len());
            for (a, &b) in vmax.iter_mut().zip(v.iter()) {
                *a = nan_max(*a, b);
            }
            &*vmax
        }
        None => &*v,
    };
    for ((pi, &mi), &vi) in p.iter_mut().zip(m.iter()).zip(second) {
        let denom = vi.sqrt() / s.bias_correction2_sqrt + s.eps;
        *pi += s.neg_step_size * mi / denom;
    }
}

/// One parallel work item: equal-length chunks of every buffer plus the group's scalars.
struct Work<'a> {
    p: &'a mut [f32],
    g: &'a [f32],
    m: &'a mut [f32],
    v: &'a mut [f32],
    vmax: Option<&'a mut [f32]>,
    group: usize,
}

fn split_mut<'a>(rest: &mut &'a mut [f32], at: usize) -> &'a mut [f32] {
    let (head, tail) = std::mem::take(rest).split_at_mut(at);
    *rest = tail;
    head
}

fn split<'a>(rest: &mut &'a [f32], at: usize) -> &'a [f32] {
    let (head, tail) = rest.split_at(at);
    *rest = tail;
    head
}

/// AdamW (torch semantics) over one flat f32 buffer of `numel` elements split into groups.
#[derive(Debug, Clone)]
pub struct AdamW {
    config: AdamWConfig,
    groups: Vec<ParamGroup>,
    segments: Vec<Segment>,
    numel: usize,
    step: u64,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    /// Empty unless `config.amsgrad`.
    max_exp_avg_sq: Vec<f32>,
}

impl AdamW {
    /// Validates `config` and `groups` (ranges within `0..numel`, no two overlapping) and
    /// allocates zeroed moments of `numel` elements (plus `max_exp_avg_sq` with amsgrad).
    pub fn new(config: AdamWConfig, groups: Vec<ParamGroup>, numel: usize) -> Result<Self> {
        config.validate()?;
        let segments = validate_groups(&groups, numel)?;
        let amsgrad_len = if config.amsgrad { numel } else { 0 };
        Ok(AdamW {
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
    pub fn with_single_group(config: AdamWConfig, numel: usize) -> Result<Self> {
        let group = ParamGroup::whole("default", numel, config.weight_decay);
        Self::new(config, vec![group], numel)
    }

    pub fn config(&self) -> &AdamWConfig {
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

    /// The scalars the next step (`step_count() + 1`) would use for group `group` at `lr`.
    /// `None` if `group` is out of range.
    pub fn step_scalars(&self, group: usize, lr: f32) -> Option<AdamWStepScalars> {
        let g = self.groups.get(group)?;
        Some(self.scalars_for(g, lr, self.step + 1))
    }

    fn scalars_for(&self, g: &ParamGroup, lr: f32, step: u64) -> AdamWStepScalars {
        let lr_group = decimal_f64(lr) * decimal_f64(g.lr_scale);
        AdamWStepScalars::new(&self.config, lr_group, decimal_f64(g.weight_decay), step)
    }

    /// One AdamW step with learning rate `lr` (times each group's `lr_scale`) on `params`
    /// using `grads`; both must have `numel` elements. Increments the step counter.
    ///
    /// Errors (nothing is modified): `LengthMismatch` for wrong buffer lengths,
    /// `InvalidHyperParameter` for a non-finite or negative `lr`. Non-finite gradients are not
    /// checked (the caller — e.g. a GradScaler — decides whether to step).
    pub fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f32) -> Result<()> {
        if params.len() != self.numel {
            return Err(OptimError::LengthMismatch {
                what: "AdamW::step params",
                expected: self.numel,
                actual: params.len(),
            });
        }
        if grads.len() != self.numel {
            return Err(OptimError::LengthMismatch {
                what: "AdamW::step grads",
                expected: self.numel,
                actual: grads.len(),
            });
        }
        check_lr(lr)?;
        let step = self.step + 1;
        let scalars: Vec<AdamWStepScalars> = self
            .groups
            .iter()
            .map(|g| self.scalars_for(g, lr, step))
            .collect();

        let amsgrad = self.config.amsgrad;
        let mut work: Vec<Work<'_>> = Vec::new();
        let mut p_rest: &mut [f32] = params;
        let mut g_rest: &[f32] = grads;
        let mut m_rest: &mut [f32] = &mut self.exp_avg;
        let mut v_rest: &mut [f32] = &mut self.exp_avg_sq;
        let mut x_rest: &mut [f32] = &mut self.max_exp_avg_sq;
        let mut pos = 0usize;
        for seg in &self.segments {
            // Skip the gap before this range (segments are sorted and disjoint).
            let gap = seg.range.start - pos;
            split_mut(&mut p_rest, gap);
            split(&mut g_rest, gap);
            split_mut(&mut m_rest, gap);
            split_mut(&mut v_rest, gap);
            if amsgrad {
                split_mut(&mut x_rest, gap);
            }
            let mut left = seg.range.len();
            while left > 0 {
                let n = left.min(CHUNK);
                work.push(Work {
                    p: split_mut(&mut p_rest, n),
                    g: split(&mut g_rest, n),
                    m: split_mut(&mut m_rest, n),
                    v: split_mut(&mut v_rest, n),
                    vmax: if amsgrad {
                        Some(split_mut(&mut x_rest, n))
                    } else {
                        None
                    },
                    group: seg.group,
                });
                left -= n;
            }
            pos = seg.range.end;
        }
        work.into_par_iter()
            .for_each(|w| update_slice(&scalars[w.group], w.p, w.g, w.m, w.v, w.vmax));
        self.step = step;
        Ok(())
    }

    /// Writes the state (moments, step, config, groups) to a safetensors file at `path`,
    /// atomically: the data goes to `<path>.tmp`, is flushed to disk, then renamed.
    ///
    /// Tensors: `exp_avg`, `exp_avg_sq` (and `max_exp_avg_sq` with amsgrad), F32, shape
    /// `[numel]`. Metadata: `format`, `format_version`, `step`, `numel`, `config` (JSON of
    /// [`AdamWConfig`]) and `groups` (JSON).
    /// Replaces the moments and the step count, e.g. with state a device optimizer kept, so
    /// that [`AdamW::save_state`] writes it in this format. Lengths must equal `numel`, and
    /// `max_exp_avg_sq` must be given exactly when amsgrad is on.
    pub fn set_state(
        &mut self,
        exp_avg: Vec<f32>,
        exp_avg_sq: Vec<f32>,
        max_exp_avg_sq: Option<Vec<f32>>,
        step: u64,
    ) -> Result<()> {
        for (what, len) in [("exp_avg", exp_avg.len()), ("exp_avg_sq", exp_avg_sq.len())] {
            if len != self.numel {
                return Err(OptimError::LengthMismatch {
                    what,
                    expected: self.numel,
                    actual: len,
                });
            }
        }
        if max_exp_avg_sq.is_some() != self.config.amsgrad
            || max_exp_avg_sq
                .as_ref()
                .is_some_and(|m| m.len() != self.numel)
        {
            return Err(OptimError::LengthMismatch {
                what: "max_exp_avg_sq (given exactly when amsgrad is on)",
                expected: if self.config.amsgrad { self.numel } else { 0 },
                actual: max_exp_avg_sq.as_ref().map_or(0, Vec::len),
            });
        }
        self.exp_avg = exp_avg;
        self.exp_avg_sq = exp_avg_sq;
        self.max_exp_avg_sq = max_exp_avg_sq.unwrap_or_default();
        self.step = step;
        Ok(())
    }

    pub fn save_state(&self, path: &Path) -> Result<()> {
        let err = |message: String| OptimError::State {
            file: path.to_path_buf(),
            message,
        };
        let config_json = serde_json::to_string(&self.config)
            .map_err(|e| err(format!("cannot encode config: {e}")))?;
        let groups_json = serde_json::to_string(&groups_to_json(&self.groups))
            .map_err(|e| err(format!("cannot encode groups: {e}")))?;
        let metadata: HashMap<String, String> = [
            ("format", STATE_FORMAT.to_string()),
            ("format_version", STATE_FORMAT_VERSION.to_string()),
            ("step", self.step.to_string()),
            ("numel", self.numel.to_string()),
            ("config", config_json),
            ("groups", groups_json),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();

        let mut tensors = vec![
            ("exp_avg", F32View::new(&self.exp_avg)),
            ("exp_avg_sq", F32View::new(&self.exp_avg_sq)),
        ];
        if self.config.amsgrad {
            tensors.push(("max_exp_avg_sq", F32View::new(&self.max_exp_avg_sq)));
        }

        let tmp = tmp_path(path);
        let write = || -> std::result::Result<(), String> {
            safetensors::serialize_to_file(tensors, Some(metadata), &tmp)
                .map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
            std::fs::File::open(&tmp)
                .and_then(|f| f.sync_all())
                .map_err(|e| format!("cannot sync {}: {e}", tmp.display()))?;
            std::fs::rename(&tmp, path)
                .map_err(|e| format!("cannot rename {} into place: {e}", tmp.display()))
        };
        write().map_err(|message| {
            let _ = std::fs::remove_file(&tmp);
            err(message)
        })
    }

    /// Reads a state written by [`AdamW::save_state`] into this optimizer: moments and step
    /// counter. The hyper-parameters and groups of `self` are kept (a run may change them on
    /// resume, as with torch's `load_state_dict` followed by edits); the buffers must match
    /// `numel`, and `max_exp_avg_sq` must be present exactly when `self` uses amsgrad.
    ///
    /// Any problem (missing or truncated file, bad header, wrong dtype or length, missing
    /// tensor or metadata) gives `OptimError::State` and leaves `self` unchanged.
    pub fn load_state(&mut self, path: &Path) -> Result<()> {
        let loaded = read_state(path, self.numel, self.config.amsgrad).map_err(|message| {
            OptimError::State {
                file: path.to_path_buf(),
                message,
            }
        })?;
        self.step = loaded.step;
        self.exp_avg = loaded.exp_avg;
        self.exp_avg_sq = loaded.exp_avg_sq;
        self.max_exp_avg_sq = loaded.max_exp_avg_sq;
        Ok(())
    }
}

/// `<path>.tmp` (the suffix appended to the full file name).
fn tmp_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".tmp");
    PathBuf::from(s)
}

#[derive(Serialize)]
struct GroupJson<'a> {
    name: &'a str,
    ranges: Vec<[usize; 2]>,
    weight_decay: f32,
    lr_scale: f32,
}

fn groups_to_json(groups: &[ParamGroup]) -> Vec<GroupJson<'_>> {
    groups
        .iter()
        .map(|g| GroupJson {
            name: &g.name,
            ranges: g.ranges.iter().map(|r| [r.start, r.end]).collect(),
            weight_decay: g.weight_decay,
            lr_scale: g.lr_scale,
        })
        .collect()
}

/// A borrowed f32 buffer as a 1-D safetensors F32 tensor (little-endian bytes; borrowed
/// without a copy on little-endian hosts).
struct F32View<'a> {
    data: &'a [f32],
    shape: [usize; 1],
}

impl<'a> F32View<'a> {
    fn new(data: &'a [f32]) -> Self {
        F32View {
            data,
            shape: [data.len()],
        }
    }
}

impl View for F32View<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        if cfg!(target_endian = "little") {
            Cow::Borrowed(bytemuck::cast_slice(self.data))
        } else {
            Cow::Owned(self.data.iter().flat_map(|x| x.to_le_bytes()).collect())
        }
    }

    fn data_len(&self) -> usize {
        std::mem::size_of_val(self.data)
    }
}

struct LoadedState {
    step: u64,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    max_exp_avg_sq: Vec<f32>,
}

fn read_state(
    path: &Path,
    numel: usize,
    amsgrad: bool,
) -> std::result::Result<LoadedState, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read: {e}"))?;
    let (_, header) = SafeTensors::read_metadata(&bytes)
        .map_err(|e| format!("not a valid safetensors file: {e}"))?;
    let meta = header
        .metadata()
        .as_ref()
        .ok_or_else(|| "no metadata (not an AdamW state file)".to_string())?;
    let get = |key: &str| {
        meta.get(key)
            .ok_or_else(|| format!("metadata `{key}` missing"))
    };
    let format = get("format")?;
    if format != STATE_FORMAT {
        return Err(format!(
            "metadata format is `{format}`, expected `{STATE_FORMAT}`"
        ));
    }
    let version = get("format_version")?;
    if version != STATE_FORMAT_VERSION {
        return Err(format!(
            "format version {version} is not supported (expected {STATE_FORMAT_VERSION})"
        ));
    }
    let step: u64 = get("step")?
        .parse()
        .map_err(|e| format!("metadata `step` is not an integer: {e}"))?;
    let file_numel: usize = get("numel")?
        .parse()
        .map_err(|e| format!("metadata `numel` is not an integer: {e}"))?;
    if file_numel != numel {
        return Err(format!(
            "state is for {file_numel} parameters, this optimizer has {numel}"
        ));
    }
    let file_config: AdamWConfig = serde_json::from_str(get("config")?)
        .map_err(|e| format!("metadata `config` is not valid JSON: {e}"))?;
    if file_config.amsgrad != amsgrad {
        return Err(format!(
            "state was saved with amsgrad = {}, this optimizer has amsgrad = {amsgrad}",
            file_config.amsgrad
        ));
    }

    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| format!("not a valid safetensors file: {e}"))?;
    let tensor = |name: &str| -> std::result::Result<Vec<f32>, String> {
        let view = st
            .tensor(name)
            .map_err(|e| format!("tensor `{name}`: {e}"))?;
        if view.dtype() != Dtype::F32 {
            return Err(format!(
                "tensor `{name}` has dtype {:?}, expected F32",
                view.dtype()
            ));
        }
        if view.shape() != [numel] {
            return Err(format!(
                "tensor `{name}` has shape {:?}, expected [{numel}]",
                view.shape()
            ));
        }
        Ok(view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    };
    let exp_avg = tensor("exp_avg")?;
    let exp_avg_sq = tensor("exp_avg_sq")?;
    let max_exp_avg_sq = if amsgrad {
        tensor("max_exp_avg_sq")?
    } else {
        Vec::new()
    };
    Ok(LoadedState {
        step,
        exp_avg,
        exp_avg_sq,
        max_exp_avg_sq,
    })
}
