//! One Adam-family step's per-group scalars ([`AdamStepScalars`], the whole contract between the
//! optimizer's bookkeeping and an elementwise CPU or CUDA kernel) and the elementwise CPU update.

use std::marker::PhantomData;

use crate::adam_config::{AdamConfig, AdamVariant, WeightDecayMode};
use crate::common::decimal_f64;

/// The per-group scalars of one step of `Adam<C>`, computed in f64 from the decimal values of
/// the f32 hyper-parameters (the Python floats torch sees) and rounded to f32 once.
///
/// The type parameter is the config type and thereby the [`WeightDecayMode`]
/// (`C::DECAY`); [`AdamWStepScalars`](crate::AdamWStepScalars) is
/// `AdamStepScalars<AdamWConfig>`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamStepScalars<C: AdamVariant = AdamConfig> {
    /// Whether weight decay runs (torch skips it when `weight_decay == 0`).
    pub apply_decay: bool,
    /// The group's weight decay: the L2 coefficient of `g + weight_decay * p` (L2 mode).
    pub weight_decay: f32,
    /// `1 - lr * weight_decay`, the factor of decoupled decay `p * decay_factor` (decoupled
    /// mode; 1 in L2 mode).
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
    variant: PhantomData<C>,
}

impl<C: AdamVariant> AdamStepScalars<C> {
    /// Scalars for step `step` (1-based, already incremented as torch does before the update),
    /// group learning rate `lr` and weight decay `weight_decay` (both f64, already widened from
    /// their decimal values).
    pub fn new(config: &C, lr: f64, weight_decay: f64, step: u64) -> Self {
        let hyper = config.hyper();
        let beta1 = decimal_f64(hyper.beta1);
        let beta2 = decimal_f64(hyper.beta2);
        // torch: `step = _get_value(step_t)` is a Python float; `beta ** step`.
        let t = step as f64;
        let bias_correction1 = 1.0 - beta1.powf(t);
        let bias_correction2 = 1.0 - beta2.powf(t);
        let decay_factor = match C::DECAY {
            WeightDecayMode::L2 => 1.0,
            WeightDecayMode::Decoupled => (1.0 - lr * weight_decay) as f32,
        };
        AdamStepScalars {
            apply_decay: weight_decay != 0.0,
            weight_decay: weight_decay as f32,
            decay_factor,
            one_minus_beta1: (1.0 - beta1) as f32,
            beta2: beta2 as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
            bias_correction2_sqrt: bias_correction2.sqrt() as f32,
            neg_step_size: (-(lr / bias_correction1)) as f32,
            eps: decimal_f64(hyper.eps) as f32,
            variant: PhantomData,
        }
    }

    /// How these scalars apply the weight decay (`C::DECAY`).
    pub fn decay_mode(&self) -> WeightDecayMode {
        C::DECAY
    }
}

/// torch's `lerp` for a scalar weight, as its scalar CPU kernel writes it.
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

/// One element of the step, in torch's order (see the `adam` module docs). The branch on
/// `C::DECAY` is resolved at compile time.
#[inline(always)]
fn update_element<C: AdamVariant>(
    s: &AdamStepScalars<C>,
    p: &mut f32,
    g: f32,
    m: &mut f32,
    v: &mut f32,
    vmax: Option<&mut f32>,
) {
    let g = match C::DECAY {
        WeightDecayMode::L2 if s.apply_decay => g + s.weight_decay * *p,
        WeightDecayMode::Decoupled if s.apply_decay => {
            *p *= s.decay_factor;
            g
        }
        _ => g,
    };
    *m = lerp(*m, g, s.one_minus_beta1);
    *v *= s.beta2;
    *v += s.one_minus_beta2 * g * g;
    let second = match vmax {
        Some(x) => {
            *x = nan_max(*x, *v);
            *x
        }
        None => *v,
    };
    let denom = second.sqrt() / s.bias_correction2_sqrt + s.eps;
    *p += s.neg_step_size * *m / denom;
}

/// The elementwise update on equal-length slices (one chunk of one range); `vmax` is the
/// amsgrad maximum when enabled. Each gradient is multiplied by `grad_scale` first (1 leaves
/// it as it is, bit for bit); with `copy`, the updated parameters are then written to it as
/// bf16 bits (the chunk is still in cache).
pub(crate) fn update_slice<C: AdamVariant>(
    s: &AdamStepScalars<C>,
    (p, g, m, v): (&mut [f32], &[f32], &mut [f32], &mut [f32]),
    vmax: Option<&mut [f32]>,
    grad_scale: f32,
    copy: Option<&mut [u16]>,
) {
    let pgmv = p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut());
    match vmax {
        Some(vmax) => {
            for ((((p, &g), m), v), x) in pgmv.zip(vmax) {
                update_element(s, p, g * grad_scale, m, v, Some(x));
            }
        }
        None => {
            for (((p, &g), m), v) in pgmv {
                update_element(s, p, g * grad_scale, m, v, None);
            }
        }
    }
    if let Some(copy) = copy {
        crate::bf16_copy::copy_slice(p, copy);
    }
}
