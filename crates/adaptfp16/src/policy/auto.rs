//! Our `auto` policy: fp16 with the GradScaler, dropping to a fallback precision for a hold
//! period when overflows keep recurring or the loss scale collapses, then back to fp16.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use tilearn_ops::DType;

use crate::error::{Error, Result};
use crate::names::{Param, PolicyId};
use crate::scaler::GradScaler;

pub const DEFAULT_AUTO_HOLD: u64 = 200;
pub const DEFAULT_OVERFLOW_WINDOW: u64 = 100;
pub const DEFAULT_MAX_OVERFLOWS: u64 = 10;
/// Below this the scale has collapsed: fp16 gradients of ordinary size underflow and training
/// stops learning (the known "loss scale fell to 1" failure).
pub const DEFAULT_SCALE_FLOOR: f32 = 1.0;
/// torch's init scale, where a new fp16 phase restarts after a collapse.
pub const DEFAULT_RESUME_SCALE: f32 = 65536.0;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AutoPolicy {
    hold: u64,
    window: u64,
    max_overflows: u64,
    scale_floor: f32,
    resume_scale: f32,
    fallback: DType,
    state: AutoState,
}

/// Why the auto policy fell back (for logs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FallbackReason {
    RecurringOverflows,
    ScaleCollapse,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum AutoMode {
    Fp16,
    /// In the fallback precision for periods `< until`.
    Fallback {
        until: u64,
        reason: FallbackReason,
    },
}

/// What the auto policy remembers between decisions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AutoState {
    pub mode: AutoMode,
    /// (period of the decision, overflows counted at it), newest last, only within the window.
    pub history: VecDeque<(u64, u64)>,
    /// The scaler's overflow counter at the previous decision (the scaler saves its counter in
    /// its state dict, so a resume keeps overflows that happened after the last decision).
    pub baseline: u64,
}

impl Default for AutoState {
    fn default() -> Self {
        AutoState {
            mode: AutoMode::Fp16,
            history: VecDeque::new(),
            baseline: 0,
        }
    }
}

impl AutoPolicy {
    pub fn new(
        hold: u64,
        window: u64,
        max_overflows: u64,
        scale_floor: f32,
        resume_scale: f32,
        fallback: DType,
    ) -> Result<Self> {
        for (param, v) in [(Param::Hold, hold), (Param::OverflowWindow, window)] {
            if v == 0 {
                return Err(Error::ZeroParameter { param });
            }
        }
        if max_overflows == 0 || max_overflows > window {
            return Err(Error::InvalidOverflowLimit {
                max_overflows,
                window,
            });
        }
        if !(scale_floor.is_finite() && scale_floor >= 0.0) {
            return Err(Error::InvalidTolerance {
                what: "scale_floor",
                value: f64::from(scale_floor),
                requirement: "finite and >= 0",
            });
        }
        if !(resume_scale.is_finite() && resume_scale > 0.0 && resume_scale >= scale_floor) {
            return Err(Error::InvalidTolerance {
                what: "resume_scale",
                value: f64::from(resume_scale),
                requirement: "finite, > 0 and >= scale_floor",
            });
        }
        if fallback == DType::F16 {
            return Err(Error::InvalidFallback(fallback));
        }
        Ok(AutoPolicy {
            hold,
            window,
            max_overflows,
            scale_floor,
            resume_scale,
            fallback,
            state: AutoState::default(),
        })
    }

    pub fn hold(&self) -> u64 {
        self.hold
    }

    pub fn window(&self) -> u64 {
        self.window
    }

    pub fn max_overflows(&self) -> u64 {
        self.max_overflows
    }

    pub fn scale_floor(&self) -> f32 {
        self.scale_floor
    }

    pub fn resume_scale(&self) -> f32 {
        self.resume_scale
    }

    pub fn fallback(&self) -> DType {
        self.fallback
    }

    pub fn state(&self) -> &AutoState {
        &self.state
    }

    pub fn set_state(&mut self, state: AutoState) {
        self.state = state;
    }

    /// The precision of `period`. See the crate docs for the rule.
    pub(crate) fn decide(
        &mut self,
        period: u64,
        loss: Option<f64>,
        scaler: Option<&mut GradScaler>,
    ) -> Result<DType> {
        let scaler = scaler.ok_or(Error::MissingSignal {
            policy: PolicyId::Auto,
            signal: "the GradScaler",
            period,
        })?;
        let count = scaler.overflow_count();
        // A counter below the baseline means the scaler was reset or loaded from a state dict
        // without our counters (torch's): count what it has seen since.
        let fresh = count.checked_sub(self.state.baseline).unwrap_or(count);
        self.state.baseline = count;
        let st = &mut self.state;
        match st.mode {
            AutoMode::Fallback { until, .. } if period < until => return Ok(self.fallback),
            AutoMode::Fallback { .. } => {
                // Back to fp16 with a clean slate: what happened before the fallback is stale.
                st.mode = AutoMode::Fp16;
                st.history.clear();
                if scaler.get_scale() < self.scale_floor {
                    scaler.restart_at(self.resume_scale)?;
                }
                return Ok(DType::F16);
            }
            AutoMode::Fp16 => {}
        }
        let non_finite_loss = loss.is_some_and(|l| !l.is_finite());
        st.history
            .push_back((period, fresh + u64::from(non_finite_loss)));
        while st
            .history
            .front()
            .is_some_and(|&(p, _)| p.saturating_add(self.window) <= period)
        {
            st.history.pop_front();
        }
        let recent: u64 = st.history.iter().map(|&(_, n)| n).sum();
        let reason = if scaler.get_scale() < self.scale_floor {
            Some(FallbackReason::ScaleCollapse)
        } else if recent >= self.max_overflows {
            Some(FallbackReason::RecurringOverflows)
        } else {
            None
        };
        Ok(match reason {
            Some(reason) => {
                st.mode = AutoMode::Fallback {
                    until: period.saturating_add(self.hold),
                    reason,
                };
                st.history.clear();
                self.fallback
            }
            None => DType::F16,
        })
    }
}
