// activation.cu: the SwiGLU gate of the Llama MLP, out = silu(gate) * up,
//   silu(g) = g * sigmoid(g),  sigmoid(g) = 1 / (1 + exp(-g)).
//
// Fused:     forward: the sigmoid, the silu and the product with `up` in one pass (the silu
//            output is never stored). Backward: both input gradients in one pass, recomputing
//            sigmoid(gate) instead of saving it:
//              dup   = dout * silu(g)
//              dgate = dout * up * s * (1 + g * (1 - s)),   s = sigmoid(g).
// Layout:    flat contiguous arrays of `n` elements (the [rows, intermediate] activations), any
//            n. When every pointer is 16-byte aligned a thread moves 16 bytes per operand (4 f32,
//            or 8 bf16 / f16) per access; the n % width tail and misaligned pointers take the
//            scalar path.
// Precision: inputs f32, bf16 or f16; all arithmetic in f32 (expf, not the approximate __expf,
//            and exp only of -|g|, so it never overflows and sigmoid keeps its subnormals;
//            nothing is built with fast math); outputs are rounded once to the storage type.
// Gradients: dgate and dup are written (`=`); no parameters.

#include "tilearn_dtype.cuh"
#include "tilearn_kernels.h"

namespace {

using tilearn::from_f32;
using tilearn::to_f32;
using tilearn::aligned16;
using tilearn::Vec16;  // 16 bytes of T, one vector load / store

constexpr int kThreads = 256;
constexpr unsigned kMaxBlocks = 65535;  // grid-stride loops cover the rest

// Evaluated on the side where exp cannot overflow: for g < 0, e^g / (1 + e^g) keeps
// sigmoid(g) down to f32's subnormals (1 / (1 + e^-g) would flush it to 0 below g ~ -88).
// Written without a branch (e = e^-|g| is e^-g or e^g, the numerator 1 or e): the same
// operations on the same values as the two-sided form, so the same bits, but a warp whose gates
// have both signs evaluates one expf and one division an element instead of both sides' (the
// forward is as much arithmetic as memory traffic: 3.1 TB/s against a 4.2 TB/s copy before).
__device__ __forceinline__ float sigmoid(float g) {
    const float e = expf(-fabsf(g));
    return (g >= 0.0f ? 1.0f : e) / (1.0f + e);
}

__device__ __forceinline__ float swiglu(float g, float u) { return g * sigmoid(g) * u; }

// (dgate, dup) of one element.
__device__ __forceinline__ void swiglu_grad(float dy, float g, float u, float& dg, float& du) {
    const float s = sigmoid(g);
    du = dy * (g * s);
    dg = dy * u * s * (1.0f + g * (1.0f - s));
}

template <typename T>
__global__ void forward_vec_kernel(const T* __restrict__ gate, const T* __restrict__ up,
                                   T* __restrict__ out, size_t n) {
    constexpr int kLen = Vec16<T>::kLen;
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const size_t nv = n / kLen;
    for (size_t i = tid; i < nv; i += stride) {
        const Vec16<T> g = reinterpret_cast<const Vec16<T>*>(gate)[i];
        const Vec16<T> u = reinterpret_cast<const Vec16<T>*>(up)[i];
        Vec16<T> o;
#pragma unroll
        for (int k = 0; k < kLen; ++k) o.v[k] = from_f32<T>(swiglu(to_f32(g.v[k]), to_f32(u.v[k])));
        reinterpret_cast<Vec16<T>*>(out)[i] = o;
    }
    for (size_t i = nv * kLen + tid; i < n; i += stride)
        out[i] = from_f32<T>(swiglu(to_f32(gate[i]), to_f32(up[i])));
}

template <typename T>
__global__ void forward_scalar_kernel(const T* __restrict__ gate, const T* __restrict__ up,
                                      T* __restrict__ out, size_t n) {
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = from_f32<T>(swiglu(to_f32(gate[i]), to_f32(up[i])));
}

template <typename T>
__global__ void backward_vec_kernel(const T* __restrict__ dout, const T* __restrict__ gate,
                                    const T* __restrict__ up, T* __restrict__ dgate,
                                    T* __restrict__ dup, size_t n) {
    constexpr int kLen = Vec16<T>::kLen;
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const size_t nv = n / kLen;
    for (size_t i = tid; i < nv; i += stride) {
        const Vec16<T> dy = reinterpret_cast<const Vec16<T>*>(dout)[i];
        const Vec16<T> g = reinterpret_cast<const Vec16<T>*>(gate)[i];
        const Vec16<T> u = reinterpret_cast<const Vec16<T>*>(up)[i];
        Vec16<T> dg, du;
#pragma unroll
        for (int k = 0; k < kLen; ++k) {
            float a, b;
            swiglu_grad(to_f32(dy.v[k]), to_f32(g.v[k]), to_f32(u.v[k]), a, b);
            dg.v[k] = from_f32<T>(a);
            du.v[k] = from_f32<T>(b);
        }
        reinterpret_cast<Vec16<T>*>(dgate)[i] = dg;
        reinterpret_cast<Vec16<T>*>(dup)[i] = du;
    }
    for (size_t i = nv * kLen + tid; i < n; i += stride) {
        float a, b;
        swiglu_grad(to_f32(dout[i]), to_f32(gate[i]), to_f32(up[i]), a, b);
        dgate[i] = from_f32<T>(a);
        dup[i] = from_f32<T>(b);
    }
}

template <typename T>
__global__ void backward_scalar_kernel(const T* __restrict__ dout, const T* __restrict__ gate,
                                       const T* __restrict__ up, T* __restrict__ dgate,
                                       T* __restrict__ dup, size_t n) {
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        float a, b;
        swiglu_grad(to_f32(dout[i]), to_f32(gate[i]), to_f32(up[i]), a, b);
        dgate[i] = from_f32<T>(a);
        dup[i] = from_f32<T>(b);
    }
}

unsigned blocks_for(size_t work) {
    const size_t b = (work + kThreads - 1) / kThreads;
    return static_cast<unsigned>(b < kMaxBlocks ? (b == 0 ? 1 : b) : kMaxBlocks);
}

template <typename T>
int launch_forward(const void* gate, const void* up, void* out, size_t n, cudaStream_t stream) {
    if (n == 0) return static_cast<int>(cudaSuccess);
    if (gate == nullptr || up == nullptr || out == nullptr)
        return static_cast<int>(cudaErrorInvalidValue);
    const T* g = static_cast<const T*>(gate);
    const T* u = static_cast<const T*>(up);
    T* o = static_cast<T*>(out);
    constexpr size_t kLen = Vec16<T>::kLen;
    if (aligned16(gate) && aligned16(up) && aligned16(out) && n >= kLen) {
        forward_vec_kernel<T><<<blocks_for(n / kLen), kThreads, 0, stream>>>(g, u, o, n);
    } else {
        forward_scalar_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(g, u, o, n);
    }
    return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch_backward(const void* dout, const void* gate, const void* up, void* dgate, void* dup,
                    size_t n, cudaStream_t stream) {
    if (n == 0) return static_cast<int>(cudaSuccess);
    if (dout == nullptr || gate == nullptr || up == nullptr || dgate == nullptr || dup == nullptr)
        return static_cast<int>(cudaErrorInvalidValue);
    const T* dy = static_cast<const T*>(dout);
    const T* g = static_cast<const T*>(gate);
    const T* u = static_cast<const T*>(up);
    T* dg = static_cast<T*>(dgate);
    T* du = static_cast<T*>(dup);
    constexpr size_t kLen = Vec16<T>::kLen;
    if (aligned16(dout) && aligned16(gate) && aligned16(up) && aligned16(dgate) &&
        aligned16(dup) && n >= kLen) {
        backward_vec_kernel<T><<<blocks_for(n / kLen), kThreads, 0, stream>>>(dy, g, u, dg, du, n);
    } else {
        backward_scalar_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(dy, g, u, dg, du, n);
    }
    return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" int tilearn_swiglu_forward(int dtype, const void* gate, const void* up, void* out,
                                      size_t n, cudaStream_t stream) {
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch_forward<decltype(tag)>(gate, up, out, n, stream);
    });
}

extern "C" int tilearn_swiglu_backward(int dtype, const void* dout, const void* gate,
                                       const void* up, void* dgate, void* dup, size_t n,
                                       cudaStream_t stream) {
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch_backward<decltype(tag)>(dout, gate, up, dgate, dup, n, stream);
    });
}
