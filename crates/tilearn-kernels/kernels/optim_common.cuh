// optim_common.cuh: the multi-tensor machinery shared by the fused optimizer kernels
// (optim_adam.cu, optim_sgd.cu, optim_lion.cu, optim_lamb.cu). Not a translation unit of its own:
// build.rs compiles only *.cu files, each optimizer file includes this one.
//
// Work decomposition: the launcher gets a device table of segments (sorted, disjoint element
// ranges of the flat buffers, each tagged with its parameter group) and cuts every segment into
// chunks of `chunk` elements (a multiple of 4). Chunk c of the whole table is processed by block
// c % gridDim.x; a chunk never spans two segments, so one block applies one group's scalars to
// it. A block finds its chunk's segment by binary search over the segments' `chunk_begin` prefix
// sums (once per chunk, not per element). One launch therefore covers every group and tensor.
//
// Vectorisation: when every buffer's base pointer is 16-byte (f32) / 8-byte (16-bit) aligned the
// body of each chunk moves 4 elements per thread with one 16-byte (or 8-byte) load/store per
// buffer; the unaligned head and the tail of a chunk (a segment may start at any element) take
// the scalar path. Every element is computed by the same instructions on either path, so the
// result does not depend on alignment, grid size or chunk size.
//
// Mixed precision, read inside the kernel (no host synchronisation):
//   found_inf (device f32, optional): when != 0 (or NaN) every thread returns before touching
//                                     memory: the step is skipped and all buffers stay
//                                     bit-identical (torch GradScaler's skipped step).
//   inv_scale (device f32, optional): g = f32(grad) * inv_scale (torch's unscale_, one f32
//                                     multiply).
//   grad_sumsq (device f64, optional): global sum of squares of the unscaled gradients (from
//                                     optim_norm.cu); norm = sqrt(sumsq) in f64 and, when norm is
//                                     finite and > max_norm, g = g * f32(max_norm / (norm + 1e-6))
//                                     (torch's clip_grad_norm_, coefficient as the CPU reference
//                                     computes it).
//   param_copy (bf16 / f16, optional): the working copy of the updated fp32 master weight,
//                                     written by the same kernel: round to nearest even, or for
//                                     bf16 optionally stochastic rounding with a counter-based
//                                     hash of (seed, step, global element index), so the same
//                                     element rounds the same way whatever the sharding.
//
// Arithmetic uses the explicit IEEE round-to-nearest intrinsics (__fadd_rn, __fmul_rn,
// __fdiv_rn, __fsqrt_rn) so nvcc cannot contract into FMAs: the kernels perform the same f32
// operations in the same order as the CPU reference (crates/tilearn-optim/src/*.rs).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "tilearn_kernels.h"

namespace tilearn_optim {

constexpr int kThreads = 256;

// ---- element access, W = 1 (scalar) or 4 (one vector load/store per buffer) ----

template <int W>
__device__ __forceinline__ void load_f32(const float* p, uint64_t i, float (&x)[W]) {
    if constexpr (W == 4) {
        const float4 t = *reinterpret_cast<const float4*>(p + i);
        x[0] = t.x;
        x[1] = t.y;
        x[2] = t.z;
        x[3] = t.w;
    } else {
        x[0] = p[i];
    }
}

template <int W>
__device__ __forceinline__ void store_f32(float* p, uint64_t i, const float (&x)[W]) {
    if constexpr (W == 4) {
        *reinterpret_cast<float4*>(p + i) = make_float4(x[0], x[1], x[2], x[3]);
    } else {
        p[i] = x[0];
    }
}

// Four 16-bit values as one aligned 8-byte unit.
struct alignas(8) Raw16x4 {
    uint16_t v[4];
};

template <typename G>
struct Grad;
template <>
struct Grad<float> {
    template <int W>
    static __device__ __forceinline__ void load(const void* g, uint64_t i, float (&x)[W]) {
        load_f32<W>(static_cast<const float*>(g), i, x);
    }
};
template <>
struct Grad<__nv_bfloat16> {
    template <int W>
    static __device__ __forceinline__ void load(const void* g, uint64_t i, float (&x)[W]) {
        const uint16_t* raw = static_cast<const uint16_t*>(g);
        if constexpr (W == 4) {
            const Raw16x4 t = *reinterpret_cast<const Raw16x4*>(raw + i);
#pragma unroll
            for (int k = 0; k < 4; ++k) x[k] = __bfloat162float(__ushort_as_bfloat16(t.v[k]));
        } else {
            x[0] = __bfloat162float(__ushort_as_bfloat16(raw[i]));
        }
    }
};

// splitmix64's finaliser over (seed, step, index): 16 uniformly distributed bits per element.
__device__ __forceinline__ uint32_t sr_bits(uint64_t seed, uint64_t step, uint64_t index) {
    uint64_t x = seed ^ (step * 0x9E3779B97F4A7C15ull) ^ (index * 0xD1B54A32D192ED03ull);
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    x ^= x >> 31;
    return static_cast<uint32_t>(x) & 0xFFFFu;
}

// bf16 with stochastic rounding: adding 16 random bits below the kept mantissa and truncating
// rounds away from zero with probability (discarded bits) / 2^16. A finite value that would
// round to infinity is truncated instead (stays at the largest finite bf16); inf/NaN round to
// nearest as usual.
__device__ __forceinline__ uint16_t bf16_stochastic(float v, uint32_t r) {
    if (!isfinite(v)) return __bfloat16_as_ushort(__float2bfloat16_rn(v));
    const uint32_t bits = __float_as_uint(v);
    const uint32_t up = bits + r;
    if ((up & 0x7F800000u) == 0x7F800000u) return static_cast<uint16_t>(bits >> 16);
    return static_cast<uint16_t>(up >> 16);
}

struct NoCopy {};

template <typename O>
struct Copy;
template <>
struct Copy<NoCopy> {
    template <int W>
    static __device__ __forceinline__ void store(void*, uint64_t, const float (&)[W], bool,
                                                 uint64_t, uint64_t, uint64_t) {}
};
template <>
struct Copy<__nv_bfloat16> {
    template <int W>
    static __device__ __forceinline__ void store(void* out, uint64_t i, const float (&x)[W],
                                                 bool stochastic, uint64_t seed, uint64_t step,
                                                 uint64_t index_offset) {
        uint16_t h[W];
#pragma unroll
        for (int k = 0; k < W; ++k) {
            h[k] = stochastic
                       ? bf16_stochastic(x[k], sr_bits(seed, step, index_offset + i + k))
                       : __bfloat16_as_ushort(__float2bfloat16_rn(x[k]));
        }
        uint16_t* raw = static_cast<uint16_t*>(out);
        if constexpr (W == 4) {
            Raw16x4 t;
#pragma unroll
            for (int k = 0; k < 4; ++k) t.v[k] = h[k];
            *reinterpret_cast<Raw16x4*>(raw + i) = t;
        } else {
            raw[i] = h[0];
        }
    }
};
template <>
struct Copy<__half> {
    template <int W>
    static __device__ __forceinline__ void store(void* out, uint64_t i, const float (&x)[W], bool,
                                                 uint64_t, uint64_t, uint64_t) {
        uint16_t* raw = static_cast<uint16_t*>(out);
        if constexpr (W == 4) {
            Raw16x4 t;
#pragma unroll
            for (int k = 0; k < 4; ++k) t.v[k] = __half_as_ushort(__float2half_rn(x[k]));
            *reinterpret_cast<Raw16x4*>(raw + i) = t;
        } else {
            raw[i] = __half_as_ushort(__float2half_rn(x[0]));
        }
    }
};

// ---- per-launch context (kernel argument, by value) ----

struct Context {
    const tilearn_optim_segment* segments;
    uint64_t n_segments;
    uint64_t n_chunks;
    uint64_t chunk;
    const void* grads;
    void* param_copy;
    const float* inv_scale;
    const float* found_inf;
    const double* grad_sumsq;
    double max_norm;
    uint64_t seed;
    uint64_t step;
    uint64_t index_offset;
    int stochastic;
    int vec;
};

// What every thread needs to turn a stored gradient into the one the update uses.
struct GradTransform {
    float inv_scale;
    float clip_coef;
    bool clip;

    __device__ __forceinline__ float apply(float g) const {
        g = __fmul_rn(g, inv_scale);
        return clip ? __fmul_rn(g, clip_coef) : g;
    }
};

// True when the step must be skipped (found_inf set). Every thread reads the same flag.
__device__ __forceinline__ bool skip_step(const Context& ctx) {
    return ctx.found_inf != nullptr && !(*ctx.found_inf == 0.0f);
}

__device__ __forceinline__ GradTransform grad_transform(const Context& ctx) {
    GradTransform t{1.0f, 1.0f, false};
    if (ctx.inv_scale != nullptr) t.inv_scale = *ctx.inv_scale;
    if (ctx.grad_sumsq != nullptr) {
        const double norm = sqrt(*ctx.grad_sumsq);
        // As clip.rs::clip_coefficient: a negative max_norm counts as 0, NaN never clips.
        const double max_norm = ctx.max_norm < 0.0 ? 0.0 : ctx.max_norm;
        if (isfinite(norm) && norm > max_norm) {
            t.clip = true;
            t.clip_coef = static_cast<float>(max_norm / (norm + 1e-6));
        }
    }
    return t;
}

// The segment holding chunk `c`: the last one whose chunk_begin <= c.
__device__ __forceinline__ uint64_t find_segment(const Context& ctx, uint64_t c) {
    uint64_t lo = 0, hi = ctx.n_segments;
    while (hi - lo > 1) {
        const uint64_t mid = lo + (hi - lo) / 2;
        if (ctx.segments[mid].chunk_begin <= c) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    return lo;
}

// Calls body.template run<W>(i) for every element i of [begin, end): the aligned body 4 at a
// time (when ctx.vec), head and tail one at a time.
template <typename Body>
__device__ __forceinline__ void for_range(const Context& ctx, uint64_t begin, uint64_t end,
                                          Body& body) {
    const uint64_t t = threadIdx.x;
    if (ctx.vec) {
        const uint64_t a = min((begin + 3) & ~uint64_t(3), end);
        const uint64_t b = max(a, end & ~uint64_t(3));
        for (uint64_t i = begin + t; i < a; i += blockDim.x) body.template run<1>(i);
        for (uint64_t i = b + t; i < end; i += blockDim.x) body.template run<1>(i);
        for (uint64_t i = a + 4 * t; i < b; i += 4 * uint64_t(blockDim.x)) body.template run<4>(i);
    } else {
        for (uint64_t i = begin + t; i < end; i += blockDim.x) body.template run<1>(i);
    }
}

// Walks this block's chunks; calls visit(segment_index, segment, begin, end) for each.
template <typename Visit>
__device__ __forceinline__ void for_chunks(const Context& ctx, Visit&& visit) {
    for (uint64_t c = blockIdx.x; c < ctx.n_chunks; c += gridDim.x) {
        const uint64_t s = find_segment(ctx, c);
        const tilearn_optim_segment seg = ctx.segments[s];
        const uint64_t begin = seg.start + (c - seg.chunk_begin) * ctx.chunk;
        const uint64_t end = min(begin + ctx.chunk, seg.end);
        visit(s, seg, begin, end);
    }
}

// ---- host side ----

inline bool aligned(const void* p, size_t bytes) {
    return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

inline size_t dtype_size(int dtype) {
    switch (dtype) {
        case TILEARN_OPTIM_DTYPE_F32:
            return 4;
        case TILEARN_OPTIM_DTYPE_BF16:
        case TILEARN_OPTIM_DTYPE_F16:
            return 2;
        default:
            return 0;
    }
}

// Validates the common part of a launch and builds the kernel context. `state` lists the f32
// buffers of the optimizer (params first); null entries are optional buffers left out.
// Returns cudaSuccess or cudaErrorInvalidValue.
inline cudaError_t make_context(const tilearn_optim_launch* l, const float* const* state,
                                int n_state, Context* ctx) {
    if (l == nullptr) return cudaErrorInvalidValue;
    if (l->chunk == 0 || l->chunk % 4 != 0) return cudaErrorInvalidValue;
    if (l->n_segments > 0 && l->segments == nullptr) return cudaErrorInvalidValue;
    if (l->grads == nullptr) return cudaErrorInvalidValue;
    if (l->grad_dtype != TILEARN_OPTIM_DTYPE_F32 && l->grad_dtype != TILEARN_OPTIM_DTYPE_BF16)
        return cudaErrorInvalidValue;
    if (l->copy_dtype != TILEARN_OPTIM_DTYPE_NONE && l->copy_dtype != TILEARN_OPTIM_DTYPE_BF16 &&
        l->copy_dtype != TILEARN_OPTIM_DTYPE_F16)
        return cudaErrorInvalidValue;
    if ((l->copy_dtype == TILEARN_OPTIM_DTYPE_NONE) != (l->param_copy == nullptr))
        return cudaErrorInvalidValue;
    if (l->stochastic_rounding && l->copy_dtype != TILEARN_OPTIM_DTYPE_BF16)
        return cudaErrorInvalidValue;
    if (state[0] == nullptr) return cudaErrorInvalidValue;
    bool vec = aligned(l->grads, 4 * dtype_size(l->grad_dtype));
    if (l->param_copy != nullptr) vec = vec && aligned(l->param_copy, 8);
    for (int k = 0; k < n_state; ++k) {
        if (state[k] != nullptr) vec = vec && aligned(state[k], 16);
    }
    *ctx = Context{l->segments,   l->n_segments, l->n_chunks,   l->chunk,
                   l->grads,      l->param_copy, l->inv_scale,  l->found_inf,
                   l->grad_sumsq, l->max_norm,   l->seed,       l->step,
                   l->index_offset, l->stochastic_rounding != 0, vec ? 1 : 0};
    return cudaSuccess;
}

// Blocks to launch: enough resident blocks to fill every SM, never more than there are chunks.
template <typename Kernel>
unsigned grid_for(Kernel kernel, uint64_t n_chunks) {
    int device = 0, sms = 132, per_sm = 8;
    if (cudaGetDevice(&device) == cudaSuccess) {
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    }
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0) !=
            cudaSuccess ||
        per_sm < 1) {
        per_sm = 1;
    }
    // Clear any error a failed query left behind: the launcher reports cudaGetLastError().
    cudaGetLastError();
    const uint64_t resident = static_cast<uint64_t>(sms) * static_cast<uint64_t>(per_sm);
    const uint64_t blocks = n_chunks < resident ? n_chunks : resident;
    return static_cast<unsigned>(blocks == 0 ? 1 : blocks);
}

// Dispatches on the (grad dtype, copy dtype) pair: calls f.template operator()<G, O>().
template <typename F>
cudaError_t dispatch_dtypes(int grad_dtype, int copy_dtype, F&& f) {
    if (grad_dtype == TILEARN_OPTIM_DTYPE_F32) {
        if (copy_dtype == TILEARN_OPTIM_DTYPE_NONE) return f.template operator()<float, NoCopy>();
        if (copy_dtype == TILEARN_OPTIM_DTYPE_BF16)
            return f.template operator()<float, __nv_bfloat16>();
        return f.template operator()<float, __half>();
    }
    if (copy_dtype == TILEARN_OPTIM_DTYPE_NONE)
        return f.template operator()<__nv_bfloat16, NoCopy>();
    if (copy_dtype == TILEARN_OPTIM_DTYPE_BF16)
        return f.template operator()<__nv_bfloat16, __nv_bfloat16>();
    return f.template operator()<__nv_bfloat16, __half>();
}

}  // namespace tilearn_optim
