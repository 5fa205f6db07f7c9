//! A small host tensor: dtype, shape and contiguous row-major storage.
//!
//! This is not a general array library. It carries parameters and activations between
//! checkpoint files, the CPU reference ops (which work on `&[f32]` views) and, under the
//! `cuda` feature, device buffers.

use half::{bf16, f16};

use crate::{DType, OpsError, Result};

/// Where a tensor's storage lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    Cuda(usize),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// A contiguous host tensor. Storage is kept as little-endian bytes of `dtype`.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    dtype: DType,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl Tensor {
    /// Builds a tensor from raw little-endian bytes, checking the length against the shape.
    pub fn from_bytes(dtype: DType, shape: Vec<usize>, bytes: Vec<u8>) -> Result<Tensor> {
        let numel: usize = shape.iter().product();
        if numel * dtype.size_in_bytes() != bytes.len() {
            return Err(OpsError::ByteLength {
                bytes: bytes.len(),
                dtype,
                shape,
            });
        }
        Ok(Tensor {
            dtype,
            shape,
            bytes,
        })
    }

    /// Builds a tensor of `dtype` from f32 values (rounding to nearest even for bf16/f16).
    pub fn from_f32(dtype: DType, shape: Vec<usize>, values: &[f32]) -> Result<Tensor> {
        let numel: usize = shape.iter().product();
        if numel != values.len() {
            return Err(OpsError::ShapeMismatch {
                op: "Tensor::from_f32",
                expected: numel,
                actual: values.len(),
            });
        }
        let bytes = match dtype {
            DType::F32 => bytemuck::cast_slice(values).to_vec(),
            DType::BF16 => {
                let v: Vec<bf16> = values.iter().map(|&x| bf16::from_f32(x)).collect();
                bytemuck::cast_slice(&v).to_vec()
            }
            DType::F16 => {
                let v: Vec<f16> = values.iter().map(|&x| f16::from_f32(x)).collect();
                bytemuck::cast_slice(&v).to_vec()
            }
        };
        Ok(Tensor {
            dtype,
            shape,
            bytes,
        })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn device(&self) -> Device {
        Device::Cpu
    }

    /// Raw little-endian bytes of the storage.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Converts the values to f32 (exact for every dtype we store).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        // The byte buffer may not be 4-byte aligned, so read element by element.
        match self.dtype {
            DType::F32 => self
                .bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            DType::BF16 => self
                .bytes
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::F16 => self
                .bytes
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        }
    }

    /// Returns the same values stored as `dtype`.
    pub fn to_dtype(&self, dtype: DType) -> Tensor {
        if dtype == self.dtype {
            return self.clone();
        }
        Tensor::from_f32(dtype, self.shape.clone(), &self.to_f32_vec())
            .expect("shape and value count agree by construction")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_each_dtype() {
        let values = [1.0f32, -2.5, 0.15625, 3.0e4];
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let t = Tensor::from_f32(dtype, vec![2, 2], &values).unwrap();
            assert_eq!(t.as_bytes().len(), 4 * dtype.size_in_bytes());
            let back = t.to_f32_vec();
            for (a, b) in values.iter().zip(&back) {
                // bf16 keeps 8 significant bits, f16 11: 1/128 relative is a safe bound for both.
                assert!((a - b).abs() <= a.abs() / 128.0, "{dtype}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn rejects_wrong_byte_length() {
        let err = Tensor::from_bytes(DType::F32, vec![3], vec![0u8; 8]).unwrap_err();
        assert!(matches!(err, OpsError::ByteLength { .. }));
    }
}
