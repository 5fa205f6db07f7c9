// tilearn_dtype.cuh: the element types of the model kernels (f32, bf16, f16) for device code:
// widening to f32, rounding back to the storage type, and the dispatch from the launchers'
// `dtype` argument (TILEARN_DTYPE_*, tilearn_kernels.h) to a kernel template.
//
// Every model kernel computes in f32 whatever the storage type: loads go through to_f32, and a
// result is rounded once, to nearest even, by from_f32<T> (f16: values of magnitude 65520 and
// above, 65504 plus half a step, become +-inf, which the GradScaler's non-finite check then sees).
#ifndef TILEARN_DTYPE_CUH
#define TILEARN_DTYPE_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "tilearn_kernels.h"

namespace tilearn {

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }

// 16 bytes of T (4 f32, or 8 bf16 / f16), moved with one vector load / store; the pointer
// must be 16-byte aligned.
template <typename T>
struct alignas(16) Vec16 {
    static constexpr int kLen = 16 / sizeof(T);
    T v[kLen];
};

__host__ __device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<unsigned long long>(p) & 15u) == 0;
}

// Calls `f(T{})` with T the storage type of `dtype` and returns its status; an unknown dtype
// launches nothing and returns cudaErrorInvalidValue. Launchers use it as
//   return tilearn::dispatch(dtype, [&](auto tag) { return launch<decltype(tag)>(...); });
template <typename F>
inline int dispatch(int dtype, F&& f) {
    switch (dtype) {
        case TILEARN_DTYPE_F32:
            return f(float{});
        case TILEARN_DTYPE_BF16:
            return f(__nv_bfloat16{});
        case TILEARN_DTYPE_F16:
            return f(__half{});
        default:
            return static_cast<int>(cudaErrorInvalidValue);
    }
}

}  // namespace tilearn

#endif  // TILEARN_DTYPE_CUH
