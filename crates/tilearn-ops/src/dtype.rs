//! Element types tilearn stores and computes in. [`DType`] is also *the* compute precision of a
//! training step (what `adaptfp16` decides, what the GPU engine runs, what `tilearn bench
//! --precision` and the training log name): a step's precision is the element type of its
//! activations and working weights, so one enum serves both and nothing maps between copies.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Element type of a tensor, and the compute precision of a training step. Compute in the CPU
/// reference is always f32 (or f64 in tests); bf16/f16 are storage and mixed-precision compute
/// types. Master weights and optimizer state stay f32 whatever a step computes in.
///
/// Names ([`DType::as_str`], `Display`, `FromStr`, serde): `fp32`, `bf16`, `fp16` — the
/// spellings of `tilearn train --fp16`, `--amp-fallback`, `tilearn bench --precision` and the
/// `precision` field of `train_log.jsonl` and `amp_policy.json`. [`DType::parse`] additionally
/// reads the Hugging Face `config.json` spellings.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    #[serde(rename = "fp32")]
    F32,
    #[serde(rename = "bf16")]
    BF16,
    /// Always paired with a loss scaler when it computes a backward: f16's 5-bit exponent lets
    /// small gradients underflow to zero without one (see [`DType::needs_loss_scaling`]).
    #[serde(rename = "fp16")]
    F16,
}

/// The names `FromStr` accepts, in [`DType::ALL`] order, for error messages.
const ACCEPTED: &str = "fp32, bf16, fp16";

impl DType {
    /// Every type, widest first.
    pub const ALL: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

    /// Bytes per element.
    pub const fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// A 16-bit type: as a step's precision, mixed precision is on (the seed's
    /// `enable_mixed_precision` returned true) and the kernels read a 16-bit working copy of
    /// the f32 master weights.
    pub const fn is_half(self) -> bool {
        !matches!(self, DType::F32)
    }

    /// Whether a backward in this type needs loss scaling (a GradScaler: scale, unscale, skip
    /// the step on inf/NaN, update): only f16, whose range is too narrow for small gradients.
    /// bf16 has f32's exponent range and needs none.
    pub const fn needs_loss_scaling(self) -> bool {
        matches!(self, DType::F16)
    }

    /// The short name: `fp32`, `bf16`, `fp16`.
    pub const fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "fp32",
            DType::BF16 => "bf16",
            DType::F16 => "fp16",
        }
    }

    /// The name used in Hugging Face `config.json` (`torch_dtype` / `dtype`).
    pub const fn hf_name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
        }
    }

    /// Parses any spelling found in the wild, case-insensitively (for `config.json`):
    /// `float32`/`fp32`/`f32`, `bfloat16`/`bf16`, `float16`/`fp16`/`f16`/`half`. Command-line
    /// flags use the strict `FromStr` instead.
    pub fn parse(name: &str) -> Option<DType> {
        match name.to_ascii_lowercase().as_str() {
            "float32" | "fp32" | "f32" => Some(DType::F32),
            "bfloat16" | "bf16" => Some(DType::BF16),
            "float16" | "fp16" | "f16" | "half" => Some(DType::F16),
            _ => None,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A precision name that is not one of `fp32`, `bf16`, `fp16`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("precision `{got}` is not one of: {ACCEPTED}")]
pub struct ParseDTypeError {
    pub got: String,
}

/// Exactly the short names ([`DType::as_str`]), as flags take them: `fp32`, `bf16`, `fp16`.
impl FromStr for DType {
    type Err = ParseDTypeError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DType::ALL
            .into_iter()
            .find(|d| d.as_str() == s)
            .ok_or_else(|| ParseDTypeError { got: s.to_string() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_names_round_trip_through_display_fromstr_and_serde() {
        let names: Vec<&str> = DType::ALL.iter().map(|d| d.as_str()).collect();
        assert_eq!(names.join(", "), ACCEPTED);
        for d in DType::ALL {
            assert_eq!(d.to_string(), d.as_str());
            assert_eq!(d.as_str().parse::<DType>(), Ok(d));
            let json = serde_json::to_string(&d).unwrap();
            assert_eq!(json, format!("\"{}\"", d.as_str()));
            assert_eq!(serde_json::from_str::<DType>(&json).unwrap(), d);
            assert_eq!(DType::parse(d.hf_name()), Some(d));
        }
    }

    #[test]
    fn fromstr_is_strict_and_names_the_accepted_spellings() {
        for bad in ["half", "f32", "FP16", "float16", ""] {
            let err = bad.parse::<DType>().unwrap_err();
            assert_eq!(
                err.to_string(),
                format!("precision `{bad}` is not one of: fp32, bf16, fp16")
            );
        }
        assert!(serde_json::from_str::<DType>("\"f16\"").is_err());
    }

    #[test]
    fn only_f16_needs_loss_scaling_and_only_f32_is_full_width() {
        assert_eq!(
            DType::ALL.map(DType::needs_loss_scaling),
            [false, false, true]
        );
        assert_eq!(DType::ALL.map(DType::is_half), [false, true, true]);
        assert_eq!(DType::ALL.map(DType::size_in_bytes), [4, 2, 2]);
    }
}
