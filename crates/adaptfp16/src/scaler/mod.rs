//! `GradScaler` with `torch.amp.GradScaler` semantics, bit for bit.
//!
//! One fp16 step:
//!
//! ```text
//! seed = scaler.scale(1.0)                  // backward of loss * scale
//! scaler.unscale(&mut grads)?               // g *= inv_scale, found_inf flag (on the device)
//! if !scaler.should_skip_step(&mut grads)? { optimizer.step() }   // CPU path
//! let outcome = scaler.update(&mut grads)?  // backoff / growth; the host learns found_inf here
//! ```
//!
//! On the GPU the optimizer kernel reads the target's device found-inf flag itself instead of
//! calling `should_skip_step` (no host sync), and `update` is the step's one synchronisation.
//! With a fused optimizer that unscales inside its own kernel (torch's `_step_supports_amp_scaling`
//! path), call [`GradScaler::check_for_fused_step`] instead of `unscale` and hand the returned
//! `inv_scale` to the optimizer.

mod state;
mod unscale;

pub use state::ScalerState;
pub use unscale::{CpuGrads, UnscaleTarget, unscale_and_check_slice};

use crate::error::{Error, Result};

/// Construction parameters; defaults are torch's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScalerConfig {
    /// Stored as an f32 like torch's `_scale` tensor (`torch.full((), init_scale, float32)`).
    pub init_scale: f64,
    /// Must be > 1. Applied in f64, rounded to f32 (torch's kernel takes it as `double`).
    pub growth_factor: f64,
    /// Must be in (0, 1).
    pub backoff_factor: f64,
    /// Consecutive clean steps before the scale grows; must be >= 1.
    pub growth_interval: i32,
    /// A disabled scaler is the identity: scale 1, nothing skipped (bf16 / fp32 periods).
    pub enabled: bool,
}

impl Default for ScalerConfig {
    fn default() -> Self {
        ScalerConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            enabled: true,
        }
    }
}

/// What one `update` did; the trainer logs it and the auto policy counts overflows from it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOutcome {
    pub scale_before: f32,
    /// A non-finite gradient was found: the optimizer step was (or must be) skipped.
    pub found_inf: bool,
    pub scale_after: f32,
    /// Consecutive clean steps since the last growth or backoff, after this update.
    pub growth_tracker: i32,
}

impl StepOutcome {
    pub fn skipped(&self) -> bool {
        self.found_inf
    }
}

/// Where we are inside one step (torch's per-optimizer `OptState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Ready,
    /// The inf check ran; `found_inf` caches the host read once it happened.
    Checked {
        found_inf: Option<bool>,
    },
}

#[derive(Debug, Clone)]
pub struct GradScaler {
    config: ScalerConfig,
    /// The live scale, an f32 like torch's `_scale` tensor.
    scale: f32,
    /// torch's int32 `_growth_tracker`.
    growth_tracker: i32,
    stage: Stage,
    /// Updates, and overflowing updates, since construction (saved in the state dict).
    updates: u64,
    overflows: u64,
}

impl Default for GradScaler {
    fn default() -> Self {
        GradScaler::new()
    }
}

impl GradScaler {
    /// torch's defaults: 2^16, x2 every 2000 clean steps, x0.5 on overflow, enabled.
    pub fn new() -> Self {
        GradScaler::from_valid(ScalerConfig::default())
    }

    /// The identity scaler for bf16/fp32 runs.
    pub fn disabled() -> Self {
        GradScaler::from_valid(ScalerConfig {
            enabled: false,
            ..ScalerConfig::default()
        })
    }

    pub fn with_config(config: ScalerConfig) -> Result<Self> {
        if config.enabled {
            validate_factors(
                config.growth_factor,
                config.backoff_factor,
                config.growth_interval,
            )?;
            let as_f32 = config.init_scale as f32;
            if !(as_f32.is_finite() && as_f32 > 0.0) {
                return Err(Error::InvalidScalerConfig {
                    field: "init_scale",
                    value: config.init_scale,
                    requirement: "finite and > 0 as an f32",
                });
            }
        }
        Ok(GradScaler::from_valid(config))
    }

    fn from_valid(config: ScalerConfig) -> Self {
        GradScaler {
            config,
            scale: config.init_scale as f32,
            growth_tracker: 0,
            stage: Stage::Ready,
            updates: 0,
            overflows: 0,
        }
    }

    pub fn is_enabled(&self) -> bool {
        self.config.enabled
    }

    pub fn config(&self) -> &ScalerConfig {
        &self.config
    }

    /// The current scale (torch's `get_scale()`; 1.0 when disabled).
    pub fn get_scale(&self) -> f32 {
        if self.config.enabled { self.scale } else { 1.0 }
    }

    /// torch's `_growth_tracker` (0 when disabled).
    pub fn growth_tracker(&self) -> i32 {
        if self.config.enabled {
            self.growth_tracker
        } else {
            0
        }
    }

    /// `loss * scale`: the backward seed. The f64 product of an f32 loss and the f32 scale is
    /// exact, so rounding it to f32 gives torch's f32 `loss * scale` bit for bit.
    pub fn scale(&self, loss: f64) -> f64 {
        loss * f64::from(self.get_scale())
    }

    /// `1/scale` computed in f64 and rounded to f32, exactly as torch's
    /// `scale.double().reciprocal().float()`.
    pub fn inv_scale(&self) -> f32 {
        (1.0 / f64::from(self.get_scale())) as f32
    }

    /// Unscale the step's gradients in one fused pass and arm the step's inf check. Once per
    /// step (a second call before `update` is [`Error::AlreadyUnscaled`]). A no-op when disabled.
    pub fn unscale(&mut self, grads: &mut dyn UnscaleTarget) -> Result<()> {
        self.run_check(grads, self.inv_scale())
    }

    /// For an optimizer that unscales inside its own kernel: run the check-only pass (gradients
    /// untouched, `inv_scale` 1.0, like torch's `_check_inf_per_device`) and return the
    /// `inv_scale` the optimizer must multiply the gradients by. The optimizer must also skip
    /// its update when the target's found-inf flag is set. Returns 1.0 when disabled.
    pub fn check_for_fused_step(&mut self, grads: &mut dyn UnscaleTarget) -> Result<f32> {
        self.run_check(grads, 1.0)?;
        Ok(self.inv_scale())
    }

    fn run_check(&mut self, grads: &mut dyn UnscaleTarget, inv_scale: f32) -> Result<()> {
        if !self.config.enabled {
            return Ok(());
        }
        if self.stage != Stage::Ready {
            return Err(Error::AlreadyUnscaled);
        }
        grads.unscale_and_check(inv_scale).map_err(Error::Backend)?;
        self.stage = Stage::Checked { found_inf: None };
        Ok(())
    }

    /// Whether the optimizer step must be skipped (a non-finite gradient was found). Reads the
    /// flag to the host (free on CPU; a sync on GPU, where the optimizer should read the device
    /// flag instead). Unscales first if `unscale` was not called, like torch's `step`. Always
    /// false when disabled.
    pub fn should_skip_step(&mut self, grads: &mut dyn UnscaleTarget) -> Result<bool> {
        if !self.config.enabled {
            return Ok(false);
        }
        if self.stage == Stage::Ready {
            self.unscale(grads)?;
        }
        self.read_found_inf(grads)
    }

    fn read_found_inf(&mut self, grads: &mut dyn UnscaleTarget) -> Result<bool> {
        match self.stage {
            Stage::Ready => Err(Error::NoInfCheck),
            Stage::Checked {
                found_inf: Some(found),
            } => Ok(found),
            Stage::Checked { found_inf: None } => {
                let found = grads.found_inf().map_err(Error::Backend)?;
                self.stage = Stage::Checked {
                    found_inf: Some(found),
                };
                Ok(found)
            }
        }
    }

    /// End the step: read the found-inf flag (once) and update the scale like torch's
    /// `_amp_update_scale_`. When disabled: nothing changes and the outcome is a clean step at
    /// scale 1.
    pub fn update(&mut self, grads: &mut dyn UnscaleTarget) -> Result<StepOutcome> {
        if !self.config.enabled {
            return Ok(self.identity_outcome());
        }
        let found = self.read_found_inf(grads)?;
        Ok(self.apply_update(found))
    }

    /// End the step with a flag the caller combined itself (e.g. the max over data-parallel
    /// ranks or over several gradient sets, like torch summing `found_inf_per_device`). The
    /// inf check must still have run on this rank this step.
    pub fn update_with_found_inf(&mut self, found_inf: bool) -> Result<StepOutcome> {
        if !self.config.enabled {
            return Ok(self.identity_outcome());
        }
        if self.stage == Stage::Ready {
            return Err(Error::NoInfCheck);
        }
        Ok(self.apply_update(found_inf))
    }

    fn identity_outcome(&self) -> StepOutcome {
        StepOutcome {
            scale_before: 1.0,
            found_inf: false,
            scale_after: 1.0,
            growth_tracker: 0,
        }
    }

    /// torch's `_amp_update_scale_` (CPU and CUDA kernels are the same arithmetic): the f32
    /// scale times the f64 factor, rounded to f32; growth only when the result is finite;
    /// growth when the incremented tracker *equals* the interval.
    fn apply_update(&mut self, found_inf: bool) -> StepOutcome {
        let scale_before = self.scale;
        if found_inf {
            self.scale = (f64::from(self.scale) * self.config.backoff_factor) as f32;
            self.growth_tracker = 0;
            self.overflows += 1;
        } else {
            let successful = self.growth_tracker.wrapping_add(1);
            if successful == self.config.growth_interval {
                let grown = (f64::from(self.scale) * self.config.growth_factor) as f32;
                if grown.is_finite() {
                    self.scale = grown;
                }
                self.growth_tracker = 0;
            } else {
                self.growth_tracker = successful;
            }
        }
        self.updates += 1;
        self.stage = Stage::Ready;
        StepOutcome {
            scale_before,
            found_inf,
            scale_after: self.scale,
            growth_tracker: self.growth_tracker,
        }
    }

    /// Start a fresh fp16 phase at `scale` with a zero growth tracker (the auto policy uses this
    /// when it returns to fp16 after a scale collapse). Also abandons a half-done step.
    pub fn restart_at(&mut self, scale: f32) -> Result<()> {
        if !(scale.is_finite() && scale > 0.0) {
            return Err(Error::InvalidScalerConfig {
                field: "scale",
                value: f64::from(scale),
                requirement: "finite and > 0",
            });
        }
        self.scale = scale;
        self.growth_tracker = 0;
        self.stage = Stage::Ready;
        Ok(())
    }

    /// Number of `update`s since construction (restored by `load_state_dict`).
    pub fn update_count(&self) -> u64 {
        self.updates
    }

    /// Number of those updates that found a non-finite gradient (skipped steps).
    pub fn overflow_count(&self) -> u64 {
        self.overflows
    }
}

pub(crate) fn validate_factors(growth: f64, backoff: f64, interval: i32) -> Result<()> {
    if !(growth.is_finite() && growth > 1.0) {
        return Err(Error::InvalidScalerConfig {
            field: "growth_factor",
            value: growth,
            requirement: "finite and > 1",
        });
    }
    if !(backoff > 0.0 && backoff < 1.0) {
        return Err(Error::InvalidScalerConfig {
            field: "backoff_factor",
            value: backoff,
            requirement: "in (0, 1)",
        });
    }
    if interval < 1 {
        return Err(Error::InvalidScalerConfig {
            field: "growth_interval",
            value: f64::from(interval),
            requirement: ">= 1",
        });
    }
    Ok(())
}
