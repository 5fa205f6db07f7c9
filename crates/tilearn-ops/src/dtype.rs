//! Element types tilearn stores and computes in.

use std::fmt;

/// Element type of a tensor. Compute in the CPU reference is always f32 (or f64 in tests);
/// bf16/f16 are storage and mixed-precision compute types.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    F16,
}

impl DType {
    /// Bytes per element.
    pub const fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
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

    /// Parses `float32`/`fp32`/`f32`, `bfloat16`/`bf16`, `float16`/`fp16`/`f16`.
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
        f.write_str(match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        })
    }
}
