//! The CUDA path (feature `cuda`): the device handle and one safe, typed wrapper per kernel
//! launcher of `kernels/*.cu`.
//!
//! cudarc owns the context (the device's primary context), the stream and every buffer; the
//! kernels are launched by their `extern "C"` launchers (declared in
//! `kernels/include/tilearn_kernels.h`, bound in [`ffi`] by `cargo xtask build-kernels`) on
//! cudarc's stream, which the statically linked CUDA runtime accepts as a `cudaStream_t`.
//! Every wrapper checks lengths and devices before the launch and returns
//! [`OpsError::Cuda`](crate::OpsError::Cuda) with the runtime's error name when a launcher fails.
//! Launches are asynchronous: results are visible to later work on the same stream, and to the
//! host after [`GpuDevice::synchronize`] or a device-to-host copy on that stream.

#[allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    dead_code,
    clippy::all
)]
/// The raw `extern "C"` launchers of `kernels/*.cu` (generated from the header), public so that
/// other crates (tilearn-optim's fused optimizers) can wrap their own kernels.
pub mod ffi;

mod attention;
mod cast;
mod cross_entropy;
mod device;
mod embedding;
mod gemm;
mod launch;
mod norm;
mod reduce;
mod residual;
mod rope;
mod swiglu;

pub use attention::{
    AttentionWorkspace, AttnElement, attention_backward_bf16, attention_backward_f32,
    attention_forward_bf16, attention_forward_f32,
};
pub use cast::{cast_bf16_to_f32, cast_f16_to_f32, cast_f32_to_bf16, cast_f32_to_f16};
pub use cross_entropy::{
    CeTotals, cross_entropy_forward_bf16, cross_entropy_forward_f32, cross_entropy_fused_bf16,
    cross_entropy_fused_f32,
};
pub use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut,
};
pub use device::GpuDevice;
pub use embedding::{
    EmbeddingBackwardScratch, TokenIdCheck, embedding_backward_bf16, embedding_backward_f32,
    embedding_forward_bf16, embedding_forward_f32,
};
pub use gemm::{
    GEMM_WORKSPACE_BYTES, Gemm, GemmElement, MatmulSpec, Operand, Transpose, cublaslt_available,
    linear_backward_bf16, linear_backward_f32, linear_forward_bf16, linear_forward_f32,
};
pub use norm::{
    RmsNormScratch, add_rmsnorm_forward_bf16, add_rmsnorm_forward_f32, rmsnorm_backward_add_bf16,
    rmsnorm_backward_add_f32, rmsnorm_backward_bf16, rmsnorm_backward_f32, rmsnorm_forward_bf16,
    rmsnorm_forward_f32,
};
pub use reduce::{
    NormWorkspace, global_norm_bf16, global_norm_f32, unscale_check_bf16, unscale_check_f16,
    unscale_check_f32,
};
pub use residual::{
    residual_add_bf16, residual_add_f32, residual_add_inplace_bf16, residual_add_inplace_f32,
};
pub use rope::{
    GpuRopeTable, rope_backward_bf16, rope_backward_f32, rope_forward_bf16, rope_forward_f32,
};
pub use swiglu::{
    swiglu_backward_bf16, swiglu_backward_f32, swiglu_forward_bf16, swiglu_forward_f32,
};
