// optim_norm.cu: the global gradient sum of squares for fused gradient-norm clipping.
//
// Fused:     GradScaler unscale (g * inv_scale, inv_scale read on the device) and the squared
//            L2 norm of a whole flat gradient buffer (every tensor of the model) in one
//            multi-tensor pass, then a one-block final reduction; the optimizer kernels read
//            the sum (grad_sumsq) and apply the clip coefficient themselves, so clipping costs
//            one read of the gradients and no host synchronisation. ZeRO shards: run it on the
//            shard, all-reduce out[0] (a plain sum), pass it to the optimizer.
// Layout:    grads flat [n], f32 or bf16, any alignment (16-byte / 8-byte vector loads when the
//            base pointer allows).
// Precision: each element as f32: g = f32(grad) * inv_scale (the gradient the optimizer will
//            see), squared and accumulated in f64. Deterministic and independent of the device:
//            a fixed grid of kBlocks x kThreads threads, each thread summing a fixed strided
//            set of elements in order, block sums in a fixed tree order into partials[block],
//            then one block sums the partials in a fixed tree order. Bit-identical run to run
//            (the order depends only on n and on whether the base pointer allows vector loads).
// Output:    out[0] = sum of squares, out[1] = sqrt(out[0]), f64, written (=); grads only read.

#include <cuda_bf16.h>

#include "tilearn_kernels.h"

namespace {

constexpr int kThreads = 256;
// Fixed grid (not sized to the device) so the summation order, hence the bits, never changes.
constexpr int kBlocks = 1024;
constexpr int kFinalThreads = 1024;
static_assert(kBlocks == kFinalThreads, "the final reduction gives one thread per partial");

__device__ __forceinline__ float load1(const float* g, size_t i) { return g[i]; }
__device__ __forceinline__ float load1(const __nv_bfloat16* g, size_t i) {
    return __bfloat162float(g[i]);
}

struct alignas(8) Bf16x4 {
    __nv_bfloat16 v[4];
};

__device__ __forceinline__ void load4(const float* g, size_t i4, float (&x)[4]) {
    const float4 t = reinterpret_cast<const float4*>(g)[i4];
    x[0] = t.x;
    x[1] = t.y;
    x[2] = t.z;
    x[3] = t.w;
}
__device__ __forceinline__ void load4(const __nv_bfloat16* g, size_t i4, float (&x)[4]) {
    const Bf16x4 t = reinterpret_cast<const Bf16x4*>(g)[i4];
#pragma unroll
    for (int k = 0; k < 4; ++k) x[k] = __bfloat162float(t.v[k]);
}

__device__ __forceinline__ double sq(float g, float inv_scale) {
    const double u = static_cast<double>(__fmul_rn(g, inv_scale));
    return u * u;
}

// Sum over the block in a fixed order: warp butterflies, then the warp sums in warp order.
template <int Threads>
__device__ double block_sum(double v) {
    __shared__ double warp_sums[Threads / 32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    double total = 0.0;
    if (threadIdx.x == 0) {
        for (int w = 0; w < Threads / 32; ++w) total += warp_sums[w];
    }
    return total;  // meaningful in thread 0 only
}

template <typename G>
__global__ void __launch_bounds__(kThreads)
    sumsq_partials(const G* __restrict__ g, size_t n, const float* __restrict__ inv_scale_ptr,
                   int vec, double* __restrict__ partials) {
    const float inv_scale = inv_scale_ptr != nullptr ? *inv_scale_ptr : 1.0f;
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    double acc = 0.0;
    size_t scalar_from = 0;
    if (vec) {
        const size_t n4 = n / 4;
        for (size_t i = tid; i < n4; i += stride) {
            float x[4];
            load4(g, i, x);
#pragma unroll
            for (int k = 0; k < 4; ++k) acc += sq(x[k], inv_scale);
        }
        scalar_from = n4 * 4;
    }
    for (size_t i = scalar_from + tid; i < n; i += stride) acc += sq(load1(g, i), inv_scale);
    const double total = block_sum<kThreads>(acc);
    if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

__global__ void __launch_bounds__(kFinalThreads)
    sumsq_final(const double* __restrict__ partials, double* __restrict__ out) {
    const double total = block_sum<kFinalThreads>(partials[threadIdx.x]);
    if (threadIdx.x == 0) {
        out[0] = total;
        out[1] = sqrt(total);
    }
}

template <typename G>
int launch_sumsq(const G* grads, size_t n, const float* inv_scale, double* partials,
                 size_t partials_len, double* out, cudaStream_t stream) {
    if (out == nullptr || partials == nullptr || partials_len < static_cast<size_t>(kBlocks))
        return static_cast<int>(cudaErrorInvalidValue);
    if (n > 0 && grads == nullptr) return static_cast<int>(cudaErrorInvalidValue);
    // Every block writes its partial (zero when it has no elements), so n == 0 gives out = 0.
    const int vec = reinterpret_cast<uintptr_t>(grads) % (4 * sizeof(G)) == 0 ? 1 : 0;
    sumsq_partials<G><<<kBlocks, kThreads, 0, stream>>>(grads, n, inv_scale, vec, partials);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return static_cast<int>(err);
    sumsq_final<<<1, kFinalThreads, 0, stream>>>(partials, out);
    return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" size_t tilearn_optim_norm_partials_len(void) { return static_cast<size_t>(kBlocks); }

extern "C" int tilearn_optim_grad_sumsq_f32(const float* grads, size_t n, const float* inv_scale,
                                            double* partials, size_t partials_len, double* out,
                                            cudaStream_t stream) {
    return launch_sumsq<float>(grads, n, inv_scale, partials, partials_len, out, stream);
}

extern "C" int tilearn_optim_grad_sumsq_bf16(const tilearn_bf16* grads, size_t n,
                                             const float* inv_scale, double* partials,
                                             size_t partials_len, double* out,
                                             cudaStream_t stream) {
    return launch_sumsq<__nv_bfloat16>(reinterpret_cast<const __nv_bfloat16*>(grads), n,
                                       inv_scale, partials, partials_len, out, stream);
}
