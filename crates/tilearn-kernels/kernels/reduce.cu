// reduce.cu: whole-buffer gradient reductions of the optimizer step.
//
//   global norm:     sum_sq = sum x[i]^2 and norm = sqrt(sum_sq) over a flat buffer (gradient
//                    clipping, logging).
//   unscale + check: x[i] *= inv_scale in place and found_inf = 1.0 if any x[i] was inf/NaN
//                    (the GradScaler's torch._amp_foreach_non_finite_check_and_unscale_).
//
// Fused:     the unscale and the non-finite check are one read-modify-write pass. The norm is
//            two kernels: per-block partial sums, then one block adds the partials.
// Layout:    flat contiguous arrays of n elements, any n and any element alignment. When the
//            pointer allows it (16-byte aligned f32, 8-byte aligned 16-bit) a thread moves 4
//            elements with one vector access; the n % 4 tail and misaligned buffers take the
//            scalar path. inv_scale and found_inf are single device f32 words.
// Precision: norm: inputs f32, bf16 or f16; every square and every sum in f64 (per thread, per
//            block and across blocks). We chose f64 over f32-per-thread-plus-Kahan because the
//            kernel is memory-bound either way (one f64 FMA per 2-4 bytes loaded is far below the
//            FP64 rate of sm_80/sm_90), and f64 leaves no error that grows with n and no f32
//            overflow of squares above 1.8e19. sum_sq is stored as f64, norm as f32.
//            unscale: inputs f32, bf16 or f16; the product is formed in f32 and rounded once to
//            the input type (exact when inv_scale is a power of two and the result is normal).
// Output:    norm: sum_sq and norm are written (`=`). unscale: x is written in place (`=`);
//            found_inf is only ever set to 1.0, never cleared (OR-accumulated across launches,
//            as in PyTorch): the caller zeroes it once per step.
// Determinism: the norm's grid depends only on n (not on the device), each thread's elements
//            and every reduction tree are fixed, so the result is bit-identical run to run for
//            the same buffer (the vector/scalar choice also depends on the pointer's alignment).
//            The unscale has no reductions; concurrent stores of the same 1.0 are benign.

#include <math.h>

#include "tilearn_dtype.cuh"
#include "tilearn_kernels.h"

namespace {

using tilearn::from_f32;
using tilearn::to_f32;

constexpr unsigned kThreads = 256;            // both kernels; a power of two (tree reduction)
constexpr size_t kElemsPerThread = 16;        // norm: target work per thread before capping
constexpr size_t kMaxPartials = 1024;         // norm: most blocks, i.e. partial sums
constexpr unsigned kMaxUnscaleBlocks = 65535; // grid-stride loops cover the rest

// Four elements moved as one aligned unit: 16 bytes of f32, 8 bytes of a 16-bit type.
template <typename T>
struct alignas(4 * sizeof(T)) Pack4 {
    T v[4];
};

// Sum over the block in a fixed tree; blockDim.x == kThreads. Thread 0 gets the total.
__device__ double block_sum_f64(double v) {
    __shared__ double sh[kThreads];
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned half = kThreads / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) sh[threadIdx.x] += sh[threadIdx.x + half];
        __syncthreads();
    }
    return sh[0];
}

template <typename T, bool kVec>
__global__ void sumsq_partials_kernel(const T* __restrict__ x, size_t n,
                                      double* __restrict__ partials) {
    const size_t stride = static_cast<size_t>(gridDim.x) * kThreads;
    const size_t tid = static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x;
    double acc = 0.0;
    size_t scalar_from = 0;
    if (kVec) {
        const Pack4<T>* x4 = reinterpret_cast<const Pack4<T>*>(x);
        const size_t n4 = n / 4;
        for (size_t i = tid; i < n4; i += stride) {
            const Pack4<T> p = x4[i];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const double v = static_cast<double>(to_f32(p.v[k]));
                acc = fma(v, v, acc);
            }
        }
        scalar_from = n4 * 4;
    }
    for (size_t i = scalar_from + tid; i < n; i += stride) {
        const double v = static_cast<double>(to_f32(x[i]));
        acc = fma(v, v, acc);
    }
    const double total = block_sum_f64(acc);
    if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// One block: thread j adds partials j, j + kThreads, ... in order, then the fixed tree.
__global__ void sumsq_finish_kernel(const double* __restrict__ partials, size_t count,
                                    double* __restrict__ sum_sq, float* __restrict__ norm) {
    double acc = 0.0;
    for (size_t i = threadIdx.x; i < count; i += kThreads) acc += partials[i];
    const double total = block_sum_f64(acc);
    if (threadIdx.x == 0) {
        *sum_sq = total;
        *norm = static_cast<float>(sqrt(total));
    }
}

template <typename T, bool kVec>
__global__ void unscale_check_kernel(T* __restrict__ x, size_t n,
                                     const float* __restrict__ inv_scale,
                                     float* __restrict__ found_inf) {
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const float s = *inv_scale;
    bool non_finite = false;
    size_t scalar_from = 0;
    if (kVec) {
        Pack4<T>* x4 = reinterpret_cast<Pack4<T>*>(x);
        const size_t n4 = n / 4;
        for (size_t i = tid; i < n4; i += stride) {
            Pack4<T> p = x4[i];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const float v = to_f32(p.v[k]);
                non_finite |= !isfinite(v);
                p.v[k] = from_f32<T>(v * s);
            }
            x4[i] = p;
        }
        scalar_from = n4 * 4;
    }
    for (size_t i = scalar_from + tid; i < n; i += stride) {
        const float v = to_f32(x[i]);
        non_finite |= !isfinite(v);
        x[i] = from_f32<T>(v * s);
    }
    // Every thread of the (full-warp) block reaches this point: one store per warp at most.
    if (__any_sync(0xffffffffu, non_finite) && threadIdx.x % 32 == 0) *found_inf = 1.0f;
}

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

template <typename T>
bool vectorizable(const void* p, size_t n) {
    return n >= 4 && aligned(p, 4 * sizeof(T));
}

size_t partial_count(size_t n) {
    const size_t per_block = static_cast<size_t>(kThreads) * kElemsPerThread;
    const size_t blocks = n / per_block + (n % per_block != 0);
    return blocks < kMaxPartials ? blocks : kMaxPartials;
}

template <typename T>
int launch_norm(const void* input, size_t n, double* partials, size_t partials_len,
                double* sum_sq, float* norm, cudaStream_t stream) {
    if (sum_sq == nullptr || norm == nullptr) return static_cast<int>(cudaErrorInvalidValue);
    const size_t blocks = partial_count(n);
    if (blocks > 0 && (input == nullptr || partials == nullptr || partials_len < blocks))
        return static_cast<int>(cudaErrorInvalidValue);
    if (blocks > 0) {
        const T* x = static_cast<const T*>(input);
        if (vectorizable<T>(x, n)) {
            sumsq_partials_kernel<T, true>
                <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x, n, partials);
        } else {
            sumsq_partials_kernel<T, false>
                <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x, n, partials);
        }
        const cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess) return static_cast<int>(err);
    }
    // Also for n == 0 (no partials): the outputs are always written, to 0.
    sumsq_finish_kernel<<<1, kThreads, 0, stream>>>(partials, blocks, sum_sq, norm);
    return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch_unscale(void* data, size_t n, const float* inv_scale, float* found_inf,
                   cudaStream_t stream) {
    if (inv_scale == nullptr || found_inf == nullptr)
        return static_cast<int>(cudaErrorInvalidValue);
    if (n == 0) return static_cast<int>(cudaSuccess);
    if (data == nullptr) return static_cast<int>(cudaErrorInvalidValue);
    T* x = static_cast<T*>(data);
    const bool vec = vectorizable<T>(x, n);
    const size_t work = vec ? n / 4 : n;
    const size_t wanted = work / kThreads + (work % kThreads != 0);
    const unsigned blocks =
        static_cast<unsigned>(wanted < kMaxUnscaleBlocks ? wanted : kMaxUnscaleBlocks);
    if (vec) {
        unscale_check_kernel<T, true><<<blocks, kThreads, 0, stream>>>(x, n, inv_scale, found_inf);
    } else {
        unscale_check_kernel<T, false><<<blocks, kThreads, 0, stream>>>(x, n, inv_scale,
                                                                        found_inf);
    }
    return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" size_t tilearn_global_norm_partials_len(size_t n) { return partial_count(n); }

extern "C" int tilearn_global_norm(int dtype, const void* x, size_t n, double* partials,
                                   size_t partials_len, double* sum_sq, float* norm,
                                   cudaStream_t stream) {
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch_norm<decltype(tag)>(x, n, partials, partials_len, sum_sq, norm, stream);
    });
}

extern "C" int tilearn_unscale_check(int dtype, void* x, size_t n, const float* inv_scale,
                                     float* found_inf, cudaStream_t stream) {
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch_unscale<decltype(tag)>(x, n, inv_scale, found_inf, stream);
    });
}
