//! The names of the policy vocabulary — which policy ([`PolicyId`]), its parameters ([`Param`]),
//! what a period is ([`TimeUnit`]) — with their seed and command-line spellings, and the error
//! for a name that is none of them. Shared by the policies, the errors and the CLI; a leaf that
//! imports nothing from the crate, so [`crate::error`] can name policies without depending on
//! [`crate::policy`].

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

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

/// A value that is not one of the accepted spellings; the message lists them.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} `{got}` is not one of: {accepted}")]
pub struct ParseNameError {
    pub what: &'static str,
    pub got: String,
    pub accepted: &'static str,
}

/// What one "period" of a policy is. The trainer asks for a decision once per period, with the
/// 0-based index of that period (the global step, or the epoch). LLM runs have few epochs, so
/// the default is `Step`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TimeUnit {
    #[default]
    Step,
    Epoch,
}

impl TimeUnit {
    pub fn as_str(self) -> &'static str {
        match self {
            TimeUnit::Step => "step",
            TimeUnit::Epoch => "epoch",
        }
    }
}

impl fmt::Display for TimeUnit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TimeUnit {
    type Err = ParseNameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "step" => Ok(TimeUnit::Step),
            "epoch" => Ok(TimeUnit::Epoch),
            _ => Err(ParseNameError {
                what: "unit",
                got: s.to_string(),
                accepted: "step, epoch",
            }),
        }
    }
}
