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

/* ---- optim_*.cu (shared machinery in kernels/optim_common.cuh): fused multi-tensor optimizer
 *      steps over flat buffers: fp32 master weights and state, f32 or bf16 gradients, an
 *      optional bf16/f16 working copy of the parameters written by the same kernel ---- */

/* Dtype codes of tilearn_optim_launch. */
#define TILEARN_OPTIM_DTYPE_NONE 0
#define TILEARN_OPTIM_DTYPE_F32 1
#define TILEARN_OPTIM_DTYPE_BF16 2
#define TILEARN_OPTIM_DTYPE_F16 3

/* Most parameter groups one launch takes (their scalars travel as a kernel argument). */
#define TILEARN_OPTIM_MAX_GROUPS 16

/* One contiguous range of the flat buffers and its group. Segments are sorted by start and
 * disjoint; elements in no segment are never read or written. A segment of len elements is cut
 * into ceil(len / chunk) chunks; chunk_begin is the number of chunks of all earlier segments. */
typedef struct tilearn_optim_segment {
    uint64_t start;
    uint64_t end;
    uint64_t chunk_begin;
    uint64_t group;
} tilearn_optim_segment;

/* What every optimizer launch shares. Pointers marked (device) are device pointers; every
 * buffer has the same element indexing (index 0 = first element of the buffer). */
typedef struct tilearn_optim_launch {
    const tilearn_optim_segment *segments; /* (device) n_segments entries */
    uint64_t n_segments;
    uint64_t n_chunks;       /* total chunks of all segments */
    uint64_t chunk;          /* elements per chunk: > 0, a multiple of 4 */
    int grad_dtype;          /* TILEARN_OPTIM_DTYPE_F32 or _BF16 */
    const void *grads;       /* (device) */
    int copy_dtype;          /* _NONE, _BF16 or _F16: the working copy of the parameters */
    void *param_copy;        /* (device) NULL iff copy_dtype == _NONE; written (=) */
    const float *inv_scale;  /* (device, NULL = 1) gradients are multiplied by *inv_scale */
    const float *found_inf;  /* (device, NULL = never) *found_inf != 0: no change at all */
    const double *grad_sumsq; /* (device, NULL = no clipping) global sum of squares of the
                                 unscaled gradients: clip to max_norm as clip_grad_norm_ */
    double max_norm;
    int stochastic_rounding; /* bf16 copy only: round stochastically with (seed, step, index) */
    uint64_t seed;
    uint64_t step;
    uint64_t index_offset;   /* global index of buffer element 0 (a ZeRO shard's start) */
} tilearn_optim_launch;

/* optim_norm.cu: global gradient sum of squares, deterministic (fixed grid, fixed-order block
 * and final reductions, f64 accumulation). out[0] = sum (g * inv_scale)^2, out[1] = sqrt of
 * it (both f64, written); inv_scale (device) may be NULL (= 1). partials: scratch of at least
 * tilearn_optim_norm_partials_len() f64 elements, clobbered. */
size_t tilearn_optim_norm_partials_len(void);
int tilearn_optim_grad_sumsq_f32(const float *grads, size_t n, const float *inv_scale,
                                 double *partials, size_t partials_len, double *out,
                                 cudaStream_t stream);
int tilearn_optim_grad_sumsq_bf16(const tilearn_bf16 *grads, size_t n, const float *inv_scale,
                                  double *partials, size_t partials_len, double *out,
                                  cudaStream_t stream);

/* optim_adam.cu: Adam / AdamW (torch.optim semantics, optional amsgrad). Per group:
 *   l2_decay:        g = g + l2_weight_decay * p                 (Adam's weight decay)
 *   decoupled_decay: p = p * decay_factor                         (AdamW, 1 - lr * wd)
 *   m = lerp(m, g, one_minus_beta1); v = v * beta2 + one_minus_beta2 * g * g
 *   amsgrad (max_exp_avg_sq != NULL): vmax = max(vmax, v), the denominator uses vmax
 *   p = p + neg_step_size * m / (sqrt(v) / bias_correction2_sqrt + eps) */
typedef struct tilearn_optim_adam_group {
    float decay_factor;
    float l2_weight_decay;
    float one_minus_beta1;
    float beta2;
    float one_minus_beta2;
    float bias_correction2_sqrt;
    float neg_step_size;
    float eps;
    uint32_t decoupled_decay;
    uint32_t l2_decay;
} tilearn_optim_adam_group;

/* params, exp_avg, exp_avg_sq (and max_exp_avg_sq, or NULL without amsgrad): (device) f32,
 * updated in place (=) on the launch's segments. */
int tilearn_optim_adam(const tilearn_optim_launch *launch, const tilearn_optim_adam_group *groups,
                       uint32_t n_groups, float *params, float *exp_avg, float *exp_avg_sq,
                       float *max_exp_avg_sq, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* TILEARN_KERNELS_H */
