//! What a period computes in, and what a period is.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The compute precision of one period. Master weights and optimizer state stay fp32 in every case;
/// this only says what the forward/backward run in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    Fp32,
    Bf16,
    /// Always paired with the [`crate::GradScaler`]: fp16 gradients underflow without loss scaling.
    Fp16,
}

impl Precision {
    /// Mixed precision is on (the seed's `enable_mixed_precision` returned true).
    pub fn is_mixed(self) -> bool {
        self != Precision::Fp32
    }

    /// Whether a step in this precision goes through the GradScaler (scale, unscale, skip, update).
    pub fn needs_scaler(self) -> bool {
        self == Precision::Fp16
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
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

impl FromStr for Precision {
    type Err = ParseNameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "fp32" => Ok(Precision::Fp32),
            "bf16" => Ok(Precision::Bf16),
            "fp16" => Ok(Precision::Fp16),
            _ => Err(ParseNameError {
                what: "precision",
                got: s.to_string(),
                accepted: "fp32, bf16, fp16",
            }),
        }
    }
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
