//! [`DeviceFloat`]: the element types of the model kernels' tensors (f32, bf16, f16), and what
//! a launcher wrapper needs to know about each: the `TILEARN_DTYPE_*` code the dtype-generic
//! `extern "C"` launchers take (see tilearn-kernels' `kernels/include/tilearn_kernels.h`),
//! cuBLASLt's name for it, and the host conversions the tests and the engine use.
//!
//! One trait instead of a wrapper per type: each op has one generic Rust wrapper and one C
//! launcher that dispatches on the code to a kernel template (tilearn-kernels'
//! `kernels/include/tilearn_dtype.cuh`), so adding a type touches this file and the dispatch,
//! not every op.

use std::ffi::c_int;

use cudarc::cublaslt::sys::cudaDataType;
use cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use half::{bf16, f16};
use tilearn_kernels::ffi;

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

/// A storage type of activations and weights on the device. Kernels always compute in f32
/// and round each stored result once (to nearest even) to `Self`.
pub trait DeviceFloat:
    DeviceRepr + ValidAsZeroBits + Copy + Default + Send + Sync + Unpin + 'static + sealed::Sealed
{
    /// The launchers' `dtype` argument (`TILEARN_DTYPE_*`).
    const DTYPE: c_int;
    /// cuBLASLt's name for the type.
    const CUDA_DATA_TYPE: cudaDataType;
    /// For messages and test names: `f32`, `bf16`, `f16`.
    const NAME: &'static str;

    /// Exact widening.
    fn to_f32(self) -> f32;
    /// Rounding to nearest even (f16: magnitudes from 65520, 65504 plus half a step, become
    /// ±inf).
    fn from_f32(value: f32) -> Self;
}

impl DeviceFloat for f32 {
    const DTYPE: c_int = ffi::TILEARN_DTYPE_F32 as c_int;
    const CUDA_DATA_TYPE: cudaDataType = cudaDataType::CUDA_R_32F;
    const NAME: &'static str = "f32";

    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(value: f32) -> Self {
        value
    }
}

impl DeviceFloat for bf16 {
    const DTYPE: c_int = ffi::TILEARN_DTYPE_BF16 as c_int;
    const CUDA_DATA_TYPE: cudaDataType = cudaDataType::CUDA_R_16BF;
    const NAME: &'static str = "bf16";

    fn to_f32(self) -> f32 {
        f32::from(self)
    }
    fn from_f32(value: f32) -> Self {
        bf16::from_f32(value)
    }
}

impl DeviceFloat for f16 {
    const DTYPE: c_int = ffi::TILEARN_DTYPE_F16 as c_int;
    const CUDA_DATA_TYPE: cudaDataType = cudaDataType::CUDA_R_16F;
    const NAME: &'static str = "f16";

    fn to_f32(self) -> f32 {
        f32::from(self)
    }
    fn from_f32(value: f32) -> Self {
        f16::from_f32(value)
    }
}
