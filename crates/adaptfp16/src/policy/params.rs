//! Names of policies and of their parameters, shared by the builder, the errors and the CLI.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::precision::ParseNameError;

/// Which policy: Tilearn-Angel's 0/1/2, or our `auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PolicyId {
    /// 0: time-based.
    Time,
    /// 1: time + learning rate.
    TimeLr,
    /// 2: loss-based.
    Loss,
    /// Ours: fp16 with a fallback when overflows recur or the loss scale collapses.
    Auto,
}

impl PolicyId {
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyId::Time => "0",
            PolicyId::TimeLr => "1",
            PolicyId::Loss => "2",
            PolicyId::Auto => "auto",
        }
    }
}

impl fmt::Display for PolicyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PolicyId {
    type Err = ParseNameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "0" => Ok(PolicyId::Time),
            "1" => Ok(PolicyId::TimeLr),
            "2" => Ok(PolicyId::Loss),
            "auto" => Ok(PolicyId::Auto),
            _ => Err(ParseNameError {
                what: "mixed-precision policy",
                got: s.to_string(),
                accepted: "0 (time), 1 (time + learning rate), 2 (loss), auto",
            }),
        }
    }
}

/// A policy parameter. `Display` gives the seed's name (`start_time`, …); [`Param::flag`] the
/// `tilearn train` flag where one exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Param {
    Start,
    End,
    Hold,
    Interval,
    IntervalHold,
    Fallback,
    LrTolerance,
    LossRiseTolerance,
    OverflowWindow,
    MaxOverflows,
    ScaleFloor,
    ResumeScale,
}

impl Param {
    pub fn name(self) -> &'static str {
        match self {
            Param::Start => "start_time",
            Param::End => "end_time",
            Param::Hold => "hold_time",
            Param::Interval => "interval_time",
            Param::IntervalHold => "interval_hold_time",
            Param::Fallback => "fallback",
            Param::LrTolerance => "lr_tolerance",
            Param::LossRiseTolerance => "loss_rise_tolerance",
            Param::OverflowWindow => "overflow_window",
            Param::MaxOverflows => "max_overflows",
            Param::ScaleFloor => "scale_floor",
            Param::ResumeScale => "resume_scale",
        }
    }

    /// The CLI flag that sets it (builder-only knobs have none).
    pub fn flag(self) -> Option<&'static str> {
        match self {
            Param::Start => Some("--amp-start"),
            Param::End => Some("--amp-end"),
            Param::Hold => Some("--amp-hold"),
            Param::Interval => Some("--amp-interval"),
            Param::IntervalHold => Some("--amp-interval-hold"),
            Param::Fallback => Some("--amp-fallback"),
            _ => None,
        }
    }
}

impl fmt::Display for Param {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What the trainer knows at a decision: the learning rate of the period about to run and the
/// loss of the previous period (the seed's `lr` and `loss` arguments).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Signals {
    pub lr: Option<f64>,
    pub loss: Option<f64>,
}
