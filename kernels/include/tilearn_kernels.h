/*
 * tilearn_kernels.h: every extern "C" launcher of the kernel files (kernels/<op>.cu).
 *
 * Conventions shared by all launchers:
 *   - Pointers are device pointers, row-major and contiguous.
 *   - bf16 and f16 tensors are passed as their 16-bit storage (`tilearn_bf16`, `tilearn_f16`);
 *     the kernels reinterpret them as __nv_bfloat16 / __half.
 *   - The launch is asynchronous on `stream`. The return value is the cudaError_t of
 *     cudaGetLastError() after the launch (0 = cudaSuccess); invalid arguments return
 *     cudaErrorInvalidValue (1) without launching anything.
 *
 * The Rust FFI (crates/tilearn-ops/src/cuda/ffi.rs) is generated from this file by
 * `cargo xtask build-kernels`. This header must stay parseable without the CUDA headers.
 */
#ifndef TILEARN_KERNELS_H
#define TILEARN_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __CUDACC__
#include <cuda_runtime.h>
#else
/* The runtime's stream handle is the driver's CUstream: an opaque pointer. */
typedef struct CUstream_st *cudaStream_t;
#endif

/* 16-bit storage of a bfloat16 / IEEE binary16 value. */
typedef uint16_t tilearn_bf16;
typedef uint16_t tilearn_f16;

#ifdef __cplusplus
extern "C" {
#endif

/* ---- status.cu: names for the status codes the launchers return ---- */

/* cudaGetErrorName / cudaGetErrorString of a returned code (static strings, never NULL). */
const char *tilearn_status_name(int status);
const char *tilearn_status_string(int status);

/* ---- cast.cu: element-wise dtype conversion, out[i] = convert(in[i]) for i < n ---- */

/* f32 -> bf16, round to nearest even. */
int tilearn_cast_f32_to_bf16(const float *input, tilearn_bf16 *output, size_t n,
                             cudaStream_t stream);
/* f32 -> f16, round to nearest even (overflow to +-inf, subnormals kept). */
int tilearn_cast_f32_to_f16(const float *input, tilearn_f16 *output, size_t n,
                            cudaStream_t stream);
/* bf16 -> f32, exact. */
int tilearn_cast_bf16_to_f32(const tilearn_bf16 *input, float *output, size_t n,
                             cudaStream_t stream);
/* f16 -> f32, exact. */
int tilearn_cast_f16_to_f32(const tilearn_f16 *input, float *output, size_t n,
                            cudaStream_t stream);

/* ---- norm.cu: RMSNorm (Hugging Face LlamaRMSNorm), y = w * x / sqrt(mean(x^2) + eps) ---- */

/* x, out: [rows, dim]; weight: [dim]; rstd: [rows] (written, f32). */
int tilearn_rmsnorm_forward_f32(const float *x, const float *weight, size_t rows, size_t dim,
                                float eps, float *out, float *rstd, cudaStream_t stream);
int tilearn_rmsnorm_forward_bf16(const tilearn_bf16 *x, const tilearn_bf16 *weight, size_t rows,
                                 size_t dim, float eps, tilearn_bf16 *out, float *rstd,
                                 cudaStream_t stream);

/* Number of f32 elements of scratch that tilearn_rmsnorm_backward_* needs for (rows, dim). */
size_t tilearn_rmsnorm_backward_scratch_len(size_t rows, size_t dim);

/* dout, x, dx: [rows, dim]; weight: [dim]; rstd: [rows] from the forward;
 * dx is written (=), dweight (f32, [dim]) is accumulated (+=) deterministically;
 * scratch: at least tilearn_rmsnorm_backward_scratch_len(rows, dim) f32 elements, clobbered. */
int tilearn_rmsnorm_backward_f32(const float *dout, const float *x, const float *weight,
                                 const float *rstd, size_t rows, size_t dim, float *dx,
                                 float *dweight, float *scratch, size_t scratch_len,
                                 cudaStream_t stream);
int tilearn_rmsnorm_backward_bf16(const tilearn_bf16 *dout, const tilearn_bf16 *x,
                                  const tilearn_bf16 *weight, const float *rstd, size_t rows,
                                  size_t dim, tilearn_bf16 *dx, float *dweight, float *scratch,
                                  size_t scratch_len, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* TILEARN_KERNELS_H */
