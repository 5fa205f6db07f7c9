// cast.cu: element-wise dtype conversion between f32 and the 16-bit float formats.
//
// Fused:     nothing; one conversion per element (used for the bf16/f16 compute copies of the
//            fp32 master weights and for reading 16-bit tensors back as f32).
// Layout:    flat contiguous arrays of `n` elements; any n, any element alignment. When both
//            pointers allow it (f32 side 16-byte, 16-bit side 8-byte aligned), a thread moves 4
//            elements with one vector load and one vector store; the n % 4 tail and misaligned
//            inputs take the scalar path, so every length is correct.
// Precision: f32 -> bf16 / f16 round to nearest even (__float2bfloat16_rn / __float2half_rn:
//            overflow gives +-inf, f16 subnormals are kept, no flush to zero); bf16 / f16 -> f32
//            is exact. No accumulation.
// Output:    written (`=`); the input is never modified.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "tilearn_kernels.h"

namespace {

constexpr int kThreads = 256;
constexpr unsigned kMaxBlocks = 65535;  // grid-stride loops cover the rest

template <typename Src, typename Dst>
struct Convert;
template <>
struct Convert<float, __nv_bfloat16> {
    static __device__ __forceinline__ __nv_bfloat16 apply(float v) { return __float2bfloat16_rn(v); }
};
template <>
struct Convert<float, __half> {
    static __device__ __forceinline__ __half apply(float v) { return __float2half_rn(v); }
};
template <>
struct Convert<__nv_bfloat16, float> {
    static __device__ __forceinline__ float apply(__nv_bfloat16 v) { return __bfloat162float(v); }
};
template <>
struct Convert<__half, float> {
    static __device__ __forceinline__ float apply(__half v) { return __half2float(v); }
};

// Four elements moved as one aligned unit: 16 bytes of f32, 8 bytes of a 16-bit type.
template <typename T>
struct alignas(4 * sizeof(T)) Pack4 {
    T v[4];
};

template <typename Src, typename Dst>
__global__ void cast_vec4_kernel(const Src* __restrict__ in, Dst* __restrict__ out, size_t n) {
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const size_t n4 = n / 4;
    const Pack4<Src>* in4 = reinterpret_cast<const Pack4<Src>*>(in);
    Pack4<Dst>* out4 = reinterpret_cast<Pack4<Dst>*>(out);
    for (size_t i = tid; i < n4; i += stride) {
        const Pack4<Src> a = in4[i];
        Pack4<Dst> b;
#pragma unroll
        for (int k = 0; k < 4; ++k) b.v[k] = Convert<Src, Dst>::apply(a.v[k]);
        out4[i] = b;
    }
    for (size_t i = n4 * 4 + tid; i < n; i += stride) out[i] = Convert<Src, Dst>::apply(in[i]);
}

template <typename Src, typename Dst>
__global__ void cast_scalar_kernel(const Src* __restrict__ in, Dst* __restrict__ out, size_t n) {
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = Convert<Src, Dst>::apply(in[i]);
}

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

unsigned blocks_for(size_t work) {
    const size_t b = (work + kThreads - 1) / kThreads;
    return static_cast<unsigned>(b < kMaxBlocks ? (b == 0 ? 1 : b) : kMaxBlocks);
}

template <typename Src, typename Dst>
int launch_cast(const void* input, void* output, size_t n, cudaStream_t stream) {
    if (n == 0) return static_cast<int>(cudaSuccess);
    if (input == nullptr || output == nullptr) return static_cast<int>(cudaErrorInvalidValue);
    const Src* in = static_cast<const Src*>(input);
    Dst* out = static_cast<Dst*>(output);
    if (aligned(in, 4 * sizeof(Src)) && aligned(out, 4 * sizeof(Dst)) && n >= 4) {
        cast_vec4_kernel<Src, Dst><<<blocks_for(n / 4), kThreads, 0, stream>>>(in, out, n);
    } else {
        cast_scalar_kernel<Src, Dst><<<blocks_for(n), kThreads, 0, stream>>>(in, out, n);
    }
    return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" int tilearn_cast_f32_to_bf16(const float* input, tilearn_bf16* output, size_t n,
                                        cudaStream_t stream) {
    return launch_cast<float, __nv_bfloat16>(input, output, n, stream);
}

extern "C" int tilearn_cast_f32_to_f16(const float* input, tilearn_f16* output, size_t n,
                                       cudaStream_t stream) {
    return launch_cast<float, __half>(input, output, n, stream);
}

extern "C" int tilearn_cast_bf16_to_f32(const tilearn_bf16* input, float* output, size_t n,
                                        cudaStream_t stream) {
    return launch_cast<__nv_bfloat16, float>(input, output, n, stream);
}

extern "C" int tilearn_cast_f16_to_f32(const tilearn_f16* input, float* output, size_t n,
                                       cudaStream_t stream) {
    return launch_cast<__half, float>(input, output, n, stream);
}
