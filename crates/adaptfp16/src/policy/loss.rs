//! Policy 2, loss-based: windows `[k*interval, k*interval + interval_hold)`, k >= 1, in which the
//! loss trend decides; between windows the last decision stands.

use serde::{Deserialize, Serialize};

use super::time::check_order;
use crate::error::{Error, Result};
use crate::names::Param;

pub const DEFAULT_INTERVAL: u64 = 1000;
pub const DEFAULT_INTERVAL_HOLD: u64 = 100;
/// Default relative rise of the loss over the window's reference that turns mixed precision off.
pub const DEFAULT_LOSS_RISE_TOLERANCE: f64 = 0.02;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LossPolicy {
    start: u64,
    end: Option<u64>,
    interval: u64,
    interval_hold: u64,
    rise_tolerance: f64,
    state: LossState,
}

/// What policy 2 remembers between decisions.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossState {
    /// The standing decision (mixed on?). Starts on.
    pub on: bool,
    /// Index k of the window last seen, and its reference loss once one was observed.
    pub window: Option<u64>,
    pub reference: Option<f64>,
}

impl Default for LossState {
    fn default() -> Self {
        LossState {
            on: true,
            window: None,
            reference: None,
        }
    }
}

impl LossPolicy {
    pub fn new(
        start: u64,
        end: Option<u64>,
        interval: u64,
        interval_hold: u64,
        rise_tolerance: f64,
    ) -> Result<Self> {
        if let Some(end) = end {
            check_order(start, end)?;
        }
        if interval == 0 {
            return Err(Error::ZeroParameter {
                param: Param::Interval,
            });
        }
        if interval_hold == 0 {
            return Err(Error::ZeroParameter {
                param: Param::IntervalHold,
            });
        }
        if interval_hold > interval {
            return Err(Error::IntervalHoldTooLong {
                interval_hold,
                interval,
            });
        }
        if !(rise_tolerance.is_finite() && rise_tolerance >= 0.0) {
            return Err(Error::InvalidTolerance {
                what: "loss_rise_tolerance",
                value: rise_tolerance,
                requirement: "finite and >= 0",
            });
        }
        Ok(LossPolicy {
            start,
            end,
            interval,
            interval_hold,
            rise_tolerance,
            state: LossState::default(),
        })
    }

    pub fn start(&self) -> u64 {
        self.start
    }

    pub fn end(&self) -> Option<u64> {
        self.end
    }

    pub fn interval(&self) -> u64 {
        self.interval
    }

    pub fn interval_hold(&self) -> u64 {
        self.interval_hold
    }

    pub fn rise_tolerance(&self) -> f64 {
        self.rise_tolerance
    }

    pub fn state(&self) -> LossState {
        self.state
    }

    pub fn set_state(&mut self, state: LossState) {
        self.state = state;
    }

    /// The window index k (>= 1) that `period` falls in, if any.
    pub fn window_of(&self, period: u64) -> Option<u64> {
        let k = period / self.interval;
        (k >= 1 && period - k * self.interval < self.interval_hold).then_some(k)
    }

    /// Mixed precision on at `period`? See the crate docs for the rule.
    pub(crate) fn decide(&mut self, period: u64, loss: Option<f64>) -> bool {
        if period < self.start || self.end.is_some_and(|e| period > e) {
            return false;
        }
        let Some(k) = self.window_of(period) else {
            return self.state.on;
        };
        if self.state.window != Some(k) {
            self.state.window = Some(k);
            self.state.reference = None;
        }
        let s = &mut self.state;
        match (loss, s.reference) {
            (Some(l), _) if !l.is_finite() => s.on = false,
            // No reference yet: the window switches mixed precision on and, given a loss,
            // takes it as the reference the rest of the window is compared with.
            (l, None) => {
                s.reference = l;
                s.on = true;
            }
            (None, Some(_)) => {}
            (Some(l), Some(r)) => s.on = l - r <= self.rise_tolerance * r.abs(),
        }
        s.on
    }
}
