//! Policy 1, time + learning rate: policy 0's window, minus an fp32 hold after every
//! learning-rate jump.

use serde::{Deserialize, Serialize};

use super::time::TimePolicy;
use crate::error::{Error, Result};
use crate::names::{Param, PolicyId};

/// Default relative jump that counts as a learning-rate change (10%).
pub const DEFAULT_LR_TOLERANCE: f64 = 0.1;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TimeLrPolicy {
    window: TimePolicy,
    hold: u64,
    lr_tolerance: f64,
    state: TimeLrState,
}

/// What policy 1 remembers between decisions.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct TimeLrState {
    /// The learning rate at the previous decision.
    pub prev_lr: Option<f64>,
    /// The period of the latest learning-rate change.
    pub last_change: Option<u64>,
}

impl TimeLrPolicy {
    pub fn new(start: u64, end: u64, hold: u64, lr_tolerance: f64) -> Result<Self> {
        let window = TimePolicy::new(start, end)?;
        if hold == 0 {
            return Err(Error::ZeroParameter { param: Param::Hold });
        }
        if !(lr_tolerance.is_finite() && lr_tolerance >= 0.0) {
            return Err(Error::InvalidTolerance {
                what: "lr_tolerance",
                value: lr_tolerance,
                requirement: "finite and >= 0",
            });
        }
        Ok(TimeLrPolicy {
            window,
            hold,
            lr_tolerance,
            state: TimeLrState::default(),
        })
    }

    pub fn window(&self) -> TimePolicy {
        self.window
    }

    pub fn hold(&self) -> u64 {
        self.hold
    }

    pub fn lr_tolerance(&self) -> f64 {
        self.lr_tolerance
    }

    pub fn state(&self) -> TimeLrState {
        self.state
    }

    pub fn set_state(&mut self, state: TimeLrState) {
        self.state = state;
    }

    /// Mixed precision on at `period`? See the crate docs for the rule.
    pub(crate) fn decide(&mut self, period: u64, lr: Option<f64>) -> Result<bool> {
        let lr = lr.ok_or(Error::MissingSignal {
            policy: PolicyId::TimeLr,
            signal: "lr",
            period,
        })?;
        if !lr.is_finite() {
            return Err(Error::NonFiniteSignal {
                signal: "lr",
                value: lr,
                period,
            });
        }
        if let Some(prev) = self.state.prev_lr {
            // Strict `>`: with prev == 0 any non-zero lr is a change, an unchanged 0 is not.
            if (lr - prev).abs() > self.lr_tolerance * prev.abs() {
                self.state.last_change = Some(period);
            }
        }
        self.state.prev_lr = Some(lr);
        let held = self
            .state
            .last_change
            .is_some_and(|c| period < c.saturating_add(self.hold));
        Ok(self.window.in_window(period) && !held)
    }
}
