// z_loss.cu: Baichuan2's z-loss, weight * max(logits)^2 per target row, in two launches around
// the fused cross entropy (which overwrites the logits with their gradient):
//   tilearn_z_loss_rows:  per row whose target is not -100, the row's max and the first
//                         position holding it (arg = -1 and max = 0 for ignored rows);
//   tilearn_z_loss_apply: row_loss[r] += weight * max^2 and, when dlogits is given,
//                         dlogits[r, arg] += grad_scale * weight * 2 * max.
//
// Fused:     the max and its position in one pass over the row (a (value, index) block
//            reduction); the loss and gradient updates of a row in one thread.
// Layout:    logits / dlogits [rows, vocab] row-major in `dtype`; targets [rows] i32; max [rows]
//            f32; arg [rows] i32; row_loss [rows] f32. rows_kernel: one block per row;
//            apply_kernel: one thread per row.
// Precision: the max is a stored logit (exact); max^2, the loss term and the gradient term in
//            f32; the gradient element is read as f32, the term added, and rounded once to its
//            type. grad_scale comes from the argument, or from device memory when grad_scale_dev
//            is not null (a CUDA graph replaying the step with each step's factor).
// Output:    max and arg written (=); row_loss and dlogits accumulated (+=).
// Determinism: fixed-shape block reduction, ties resolved to the lower index; no atomics.

#include "tilearn_dtype.cuh"
#include "tilearn_kernels.h"

namespace {

using tilearn::from_f32;
using tilearn::to_f32;

constexpr int32_t kIgnoreIndex = -100;
constexpr unsigned kThreads = 256;

// (v, i) beats (w, j) when v > w, or v == w and i < j: the first position of the max.
__device__ __forceinline__ void better(float& v, int& i, float w, int j) {
    if (w > v || (w == v && j < i)) {
        v = w;
        i = j;
    }
}

template <typename T>
__global__ void rows_kernel(const T* __restrict__ logits, const int32_t* __restrict__ targets,
                            size_t vocab, float* __restrict__ max, int32_t* __restrict__ arg) {
    const size_t row = blockIdx.x;
    if (targets[row] == kIgnoreIndex) {
        if (threadIdx.x == 0) {
            max[row] = 0.0f;
            arg[row] = -1;
        }
        return;
    }
    const T* x = logits + row * vocab;
    float best = -INFINITY;
    int at = 0x7fffffff;
    for (size_t j = threadIdx.x; j < vocab; j += blockDim.x) better(best, at, to_f32(x[j]), static_cast<int>(j));
    for (int o = 16; o > 0; o >>= 1) {
        const float w = __shfl_xor_sync(0xffffffffu, best, o);
        const int j = __shfl_xor_sync(0xffffffffu, at, o);
        better(best, at, w, j);
    }
    __shared__ float warp_best[32];
    __shared__ int warp_at[32];
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        warp_best[warp] = best;
        warp_at[warp] = at;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float v = warp_best[0];
        int i = warp_at[0];
        for (unsigned w = 1; w < blockDim.x / 32; ++w) better(v, i, warp_best[w], warp_at[w]);
        max[row] = v;
        arg[row] = i;
    }
}

template <typename T>
__global__ void apply_kernel(const float* __restrict__ max, const int32_t* __restrict__ arg,
                             size_t rows, size_t vocab, float weight, float grad_scale,
                             const float* __restrict__ grad_scale_dev, float* __restrict__ row_loss,
                             T* __restrict__ dlogits) {
    const size_t row = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (row >= rows || arg[row] < 0) return;
    const float m = max[row];
    row_loss[row] += weight * m * m;
    if (dlogits != nullptr) {
        const float scale = grad_scale_dev != nullptr ? *grad_scale_dev : grad_scale;
        T* g = dlogits + row * vocab + static_cast<size_t>(arg[row]);
        *g = from_f32<T>(to_f32(*g) + scale * weight * 2.0f * m);
    }
}

}  // namespace

extern "C" int tilearn_z_loss_rows(int dtype, const void* logits, const int32_t* targets,
                                   size_t rows, size_t vocab, float* max, int32_t* arg,
                                   cudaStream_t stream) {
    if (rows == 0) return static_cast<int>(cudaSuccess);
    if (logits == nullptr || targets == nullptr || max == nullptr || arg == nullptr ||
        vocab == 0 || vocab > 0x7fffffffu || rows > 0x7fffffffu)
        return static_cast<int>(cudaErrorInvalidValue);
    return tilearn::dispatch(dtype, [&](auto tag) {
        using T = decltype(tag);
        rows_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
            static_cast<const T*>(logits), targets, vocab, max, arg);
        return static_cast<int>(cudaGetLastError());
    });
}

extern "C" int tilearn_z_loss_apply(int dtype, const float* max, const int32_t* arg, size_t rows,
                                    size_t vocab, float weight, float grad_scale,
                                    const float* grad_scale_dev, float* row_loss, void* dlogits,
                                    cudaStream_t stream) {
    if (rows == 0) return static_cast<int>(cudaSuccess);
    if (max == nullptr || arg == nullptr || row_loss == nullptr)
        return static_cast<int>(cudaErrorInvalidValue);
    const unsigned blocks = static_cast<unsigned>((rows + kThreads - 1) / kThreads);
    return tilearn::dispatch(dtype, [&](auto tag) {
        using T = decltype(tag);
        apply_kernel<T><<<blocks, kThreads, 0, stream>>>(max, arg, rows, vocab, weight,
                                                          grad_scale, grad_scale_dev, row_loss,
                                                          static_cast<T*>(dlogits));
        return static_cast<int>(cudaGetLastError());
    });
}
