//! The scaler's checkpoint form: torch's `GradScaler.state_dict()` keys and meanings, so a state
//! saved by one side loads in the other (as JSON). Two keys of ours ride along, prefixed like
//! torch's private `_growth_tracker`: the update and overflow counters, which the auto policy
//! reads (a resume must not lose an overflow between the last decision and the checkpoint).
//! torch's `load_state_dict` reads only its own keys, and ours default to 0 when absent.

use serde::{Deserialize, Serialize};

use super::{GradScaler, Stage, validate_factors};
use crate::error::{Error, Result};

/// torch's five keys plus our two counters. `scale` is the f32 scale widened to f64 (what
/// torch's `get_scale()` returns), so the f32 round trip is exact.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScalerState {
    pub scale: f64,
    pub growth_factor: f64,
    pub backoff_factor: f64,
    pub growth_interval: i32,
    #[serde(rename = "_growth_tracker")]
    pub growth_tracker: i32,
    /// [`GradScaler::update_count`]; 0 when loading torch's state dict.
    #[serde(rename = "_update_count", default)]
    pub update_count: u64,
    /// [`GradScaler::overflow_count`]; 0 when loading torch's state dict.
    #[serde(rename = "_overflow_count", default)]
    pub overflow_count: u64,
}

impl GradScaler {
    /// `None` when disabled (torch returns `{}`). Call after `update`, like torch recommends.
    pub fn state_dict(&self) -> Option<ScalerState> {
        self.config.enabled.then(|| ScalerState {
            scale: f64::from(self.scale),
            growth_factor: self.config.growth_factor,
            backoff_factor: self.config.backoff_factor,
            growth_interval: self.config.growth_interval,
            growth_tracker: self.growth_tracker,
            update_count: self.updates,
            overflow_count: self.overflows,
        })
    }

    /// Restore a state. A no-op on a disabled scaler (torch's rule). Validates what torch only
    /// asserts at construction, and rejects a tracker at or past the interval (torch would then
    /// never grow again, since it grows when the tracker *equals* the interval). Restores the
    /// update/overflow counters (0 from a torch state dict) and drops any half-done step.
    pub fn load_state_dict(&mut self, state: &ScalerState) -> Result<()> {
        if !self.config.enabled {
            return Ok(());
        }
        validate_factors(
            state.growth_factor,
            state.backoff_factor,
            state.growth_interval,
        )
        .map_err(|e| Error::InvalidStateDict(e.to_string()))?;
        let scale = state.scale as f32;
        // torch fills its f32 tensor with the value, i.e. rounds it to f32; so do we.
        if !(scale.is_finite() && scale >= 0.0) {
            return Err(Error::InvalidStateDict(format!(
                "scale {} is not a finite, non-negative f32 value",
                state.scale
            )));
        }
        if state.growth_tracker < 0 || state.growth_tracker >= state.growth_interval {
            return Err(Error::InvalidStateDict(format!(
                "_growth_tracker {} must be in 0..growth_interval ({})",
                state.growth_tracker, state.growth_interval
            )));
        }
        self.scale = scale;
        self.config.init_scale = state.scale;
        self.config.growth_factor = state.growth_factor;
        self.config.backoff_factor = state.backoff_factor;
        self.config.growth_interval = state.growth_interval;
        self.growth_tracker = state.growth_tracker;
        self.stage = Stage::Ready;
        self.updates = state.update_count;
        self.overflows = state.overflow_count;
        Ok(())
    }

    /// The state as a JSON object; `{}` when disabled, like torch.
    pub fn state_dict_json(&self) -> serde_json::Value {
        match self.state_dict() {
            Some(s) => serde_json::json!({
                "scale": s.scale,
                "growth_factor": s.growth_factor,
                "backoff_factor": s.backoff_factor,
                "growth_interval": s.growth_interval,
                "_growth_tracker": s.growth_tracker,
                "_update_count": s.update_count,
                "_overflow_count": s.overflow_count,
            }),
            None => serde_json::Value::Object(serde_json::Map::new()),
        }
    }

    /// Load a JSON state dict (e.g. `json.dumps(scaler.state_dict())` from PyTorch). `{}` is
    /// [`Error::EmptyStateDict`] on an enabled scaler, like torch.
    pub fn load_state_dict_json(&mut self, json: &serde_json::Value) -> Result<()> {
        if !self.config.enabled {
            return Ok(());
        }
        if json.as_object().is_some_and(|m| m.is_empty()) {
            return Err(Error::EmptyStateDict);
        }
        let state: ScalerState = serde_json::from_value(json.clone())
            .map_err(|e| Error::InvalidStateDict(e.to_string()))?;
        self.load_state_dict(&state)
    }
}
