//! The CUDA path (feature `cuda`): the device handle and one safe, typed wrapper per kernel
//! launcher of tilearn-kernels (`crates/tilearn-kernels/kernels/*.cu`), generic over the element
//! type ([`DeviceFloat`]) where the kernel is.
//!
//! cudarc owns the context (the device's primary context), the stream and every buffer; the
//! kernels are launched by their `extern "C"` launchers (declared in
//! `crates/tilearn-kernels/kernels/include/tilearn_kernels.h`, bound in `tilearn_kernels::ffi`
//! by `cargo xtask build-kernels`) on cudarc's stream, which the statically linked CUDA runtime
//! accepts as a `cudaStream_t`. Every wrapper goes through one launch builder (`launch.rs`).
//! Every wrapper checks lengths and devices before the launch and returns
//! [`OpsError::Cuda`](crate::OpsError::Cuda) with the runtime's error name when a launcher fails.
//! Launches are asynchronous: results are visible to later work on the same stream, and to the
//! host after [`GpuDevice::synchronize`] or a device-to-host copy on that stream.

/// The raw `extern "C"` launchers, re-exported from tilearn-kernels for the tests that drive a
/// launcher directly (invalid dtype codes, scratch sizes). New code depends on
/// `tilearn_kernels::ffi` itself.
pub use tilearn_kernels::ffi;

mod attention;
mod cached_attention;
mod cast;
mod cross_entropy;
mod device;
mod dtype;
mod embedding;
mod flash_backward;
mod gelu;
mod gemm;
pub mod launch;
mod norm;
mod reduce;
mod residual;
mod rope;
mod row_normalize;
mod swiglu;
mod z_loss;

// Each op module exports exactly its public wrappers and workspace types.
pub use attention::*;
pub use cached_attention::*;
pub use cast::{cast_bf16_to_f32, cast_f16_to_f32, cast_f32_to_bf16, cast_f32_to_f16};
pub use cross_entropy::*;
pub use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut,
};
pub use device::GpuDevice;
pub use dtype::DeviceFloat;
pub use embedding::*;
pub use flash_backward::{FlashBackward, flash_dq_accum_len};
pub use gelu::*;
pub use gemm::*;
pub use norm::*;
pub use reduce::*;
pub use residual::*;
pub use rope::*;
pub use row_normalize::*;
pub use swiglu::*;
pub use z_loss::*;
