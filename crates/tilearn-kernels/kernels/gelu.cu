// gelu.cu: Bloom's tanh-approximated GeLU (transformers' bloom_gelu_forward), element-wise,
//   gelu(x)  = 0.5 x (1 + t),  t = tanh(C x (1 + A x^2)),  C = 0.79788456, A = 0.044715;
//   gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) (C + 3 A C x^2)   (the exact derivative).
//
// Fused:     forward: the polynomial, the tanh and the product in one pass. Backward: dx from
//            dout and the saved input x in one pass (tanh recomputed, not stored).
// Layout:    flat contiguous arrays of `n` elements (the [rows, intermediate] activations), any
//            n; a grid-stride loop of one element per thread and step.
// Precision: inputs f32, bf16 or f16; all arithmetic in f32 with tanhf (not an approximate
//            intrinsic); where tanh has saturated (1 - t^2 == 0 in f32, |x| >~ 4.5) the second
//            term of gelu' is exactly 0, so x^2 overflowing for huge |x| never makes 0 * inf;
//            outputs rounded once to the storage type.
// Gradients: dx is written (`=`); no parameters.

#include "tilearn_dtype.cuh"
#include "tilearn_kernels.h"

namespace {

using tilearn::from_f32;
using tilearn::to_f32;

constexpr float kC = 0.79788456f;
constexpr float kA = 0.044715f;
constexpr int kThreads = 256;
constexpr unsigned kMaxBlocks = 65535;  // the grid-stride loop covers the rest

__device__ __forceinline__ float tanh_arg(float x) { return kC * x * (1.0f + kA * x * x); }

template <typename T>
__global__ void gelu_forward_kernel(const T* __restrict__ x, T* __restrict__ out, size_t n) {
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        const float v = to_f32(x[i]);
        out[i] = from_f32<T>(0.5f * v * (1.0f + tanhf(tanh_arg(v))));
    }
}

template <typename T>
__global__ void gelu_backward_kernel(const T* __restrict__ dout, const T* __restrict__ x,
                                     T* __restrict__ dx, size_t n) {
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        const float v = to_f32(x[i]);
        const float t = tanhf(tanh_arg(v));
        const float sech2 = 1.0f - t * t;
        const float second = sech2 == 0.0f ? 0.0f : 0.5f * v * sech2 * (kC + 3.0f * kA * kC * v * v);
        dx[i] = from_f32<T>(to_f32(dout[i]) * (0.5f * (1.0f + t) + second));
    }
}

unsigned blocks_for(size_t n) {
    const size_t b = (n + kThreads - 1) / kThreads;
    return static_cast<unsigned>(b < kMaxBlocks ? b : kMaxBlocks);
}

template <typename T>
int launch_forward(const void* x, void* out, size_t n, cudaStream_t stream) {
    if (n == 0) return static_cast<int>(cudaSuccess);
    if (x == nullptr || out == nullptr) return static_cast<int>(cudaErrorInvalidValue);
    gelu_forward_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(static_cast<const T*>(x),
                                                                    static_cast<T*>(out), n);
    return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch_backward(const void* dout, const void* x, void* dx, size_t n, cudaStream_t stream) {
    if (n == 0) return static_cast<int>(cudaSuccess);
    if (dout == nullptr || x == nullptr || dx == nullptr)
        return static_cast<int>(cudaErrorInvalidValue);
    gelu_backward_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(
        static_cast<const T*>(dout), static_cast<const T*>(x), static_cast<T*>(dx), n);
    return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" int tilearn_gelu_tanh_forward(int dtype, const void* x, void* out, size_t n,
                                         cudaStream_t stream) {
    return tilearn::dispatch(dtype,
                             [&](auto tag) { return launch_forward<decltype(tag)>(x, out, n, stream); });
}

extern "C" int tilearn_gelu_tanh_backward(int dtype, const void* dout, const void* x, void* dx,
                                          size_t n, cudaStream_t stream) {
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch_backward<decltype(tag)>(dout, x, dx, n, stream);
    });
}
