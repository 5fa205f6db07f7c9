// row_normalize.cu: row L2 normalisation, out[r] = w[r] / max(||w[r]||_2, 1e-12) (PyTorch's
// F.normalize(w, dim=-1)), and its backward: Baichuan2's NormHead, which normalises the lm_head
// rows before the logits product.
//
// Fused:     forward: the row's sum of squares and the scaling in one pass per row.
//            Backward: the row's norm and dot(w, dout) in one reduction, then
//            dw += (dout - u * dot(u, dout)) / n with u = w / n (dw += dout / eps when the clamp
//            is active), in the same block; no saved statistics (the norm is recomputed).
// Layout:    w, out, dout, dw row-major [rows, cols]; one thread block per row.
// Precision: w and out in f32, bf16 or f16 (the launcher's dtype); dout and dw always f32 (the
//            gradient of the normalised head is accumulated in f32 by the logits GEMMs); every
//            sum and product in f32; out rounded once to its type.
// Gradients: out is written (`=`); dw is accumulated (`+=`, the parameter-gradient convention).
// Determinism: fixed-order block reductions (warp butterflies, then warps in order), no atomics.

#include "tilearn_dtype.cuh"
#include "tilearn_kernels.h"

namespace {

using tilearn::from_f32;
using tilearn::to_f32;

constexpr float kEps = 1e-12f;
constexpr unsigned kThreads = 256;

// Sum over the block in a fixed order; every thread gets the total. blockDim.x == kThreads.
__device__ float block_sum(float v) {
    __shared__ float warp_sums[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    v = lane < blockDim.x / 32 ? warp_sums[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();  // warp_sums may be reused by the next call
    return v;
}

template <typename T>
__global__ void forward_kernel(const T* __restrict__ w, size_t cols, T* __restrict__ out) {
    const size_t row = blockIdx.x;
    const T* wr = w + row * cols;
    T* orow = out + row * cols;
    float ss = 0.0f;
    for (size_t c = threadIdx.x; c < cols; c += blockDim.x) {
        const float x = to_f32(wr[c]);
        ss += x * x;
    }
    const float norm = sqrtf(block_sum(ss));
    const float inv = 1.0f / fmaxf(norm, kEps);
    for (size_t c = threadIdx.x; c < cols; c += blockDim.x) orow[c] = from_f32<T>(to_f32(wr[c]) * inv);
}

template <typename T>
__global__ void backward_kernel(const float* __restrict__ dout, const T* __restrict__ w,
                                size_t cols, float* __restrict__ dw) {
    const size_t row = blockIdx.x;
    const T* wr = w + row * cols;
    const float* dr = dout + row * cols;
    float* gr = dw + row * cols;
    float ss = 0.0f, wd = 0.0f;
    for (size_t c = threadIdx.x; c < cols; c += blockDim.x) {
        const float x = to_f32(wr[c]);
        ss += x * x;
        wd += x * dr[c];
    }
    const float norm = sqrtf(block_sum(ss));
    wd = block_sum(wd);
    if (norm > kEps) {
        const float inv = 1.0f / norm;
        const float proj = wd * inv;  // dot(u, dout)
        for (size_t c = threadIdx.x; c < cols; c += blockDim.x)
            gr[c] += (dr[c] - to_f32(wr[c]) * inv * proj) * inv;
    } else {
        const float inv = 1.0f / kEps;
        for (size_t c = threadIdx.x; c < cols; c += blockDim.x) gr[c] += dr[c] * inv;
    }
}

template <typename T>
int launch_forward(const void* w, size_t rows, size_t cols, void* out, cudaStream_t stream) {
    forward_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        static_cast<const T*>(w), cols, static_cast<T*>(out));
    return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch_backward(const float* dout, const void* w, size_t rows, size_t cols, float* dw,
                    cudaStream_t stream) {
    backward_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        dout, static_cast<const T*>(w), cols, dw);
    return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" int tilearn_row_normalize_forward(int dtype, const void* w, size_t rows, size_t cols,
                                             void* out, cudaStream_t stream) {
    if (rows == 0 || cols == 0) return static_cast<int>(cudaSuccess);
    if (w == nullptr || out == nullptr || rows > 0x7fffffffu)
        return static_cast<int>(cudaErrorInvalidValue);
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch_forward<decltype(tag)>(w, rows, cols, out, stream);
    });
}

extern "C" int tilearn_row_normalize_backward(int dtype, const float* dout, const void* w,
                                              size_t rows, size_t cols, float* dw,
                                              cudaStream_t stream) {
    if (rows == 0 || cols == 0) return static_cast<int>(cudaSuccess);
    if (dout == nullptr || w == nullptr || dw == nullptr || rows > 0x7fffffffu)
        return static_cast<int>(cudaErrorInvalidValue);
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch_backward<decltype(tag)>(dout, w, rows, cols, dw, stream);
    });
}
