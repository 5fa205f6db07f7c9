// residual.cu: residual additions of the transformer stream.
//
// Fused:     nothing; one add per element. `out = a + b` joins a branch to the stream in the
//            forward; `acc += x` adds a branch's input gradient into the stream's gradient in the
//            backward (the gradient of a residual add is the identity).
// Layout:    flat contiguous arrays of `n` elements, any n. When every pointer is 16-byte aligned
//            a thread moves 16 bytes per operand (4 f32, or 8 bf16 / f16) per load/store; the
//            n % width tail and misaligned pointers (e.g. views at odd offsets) take the scalar
//            path.
// Precision: f32: one f32 add. bf16 / f16: both operands widened to f32 (exactly), added, the
//            sum rounded once to the storage type (round to nearest even; an f16 sum of magnitude
//            65520 or more, past the largest f16 65504 by half an ulp, becomes +-inf), which is
//            what PyTorch's bf16 / f16 add does.
// Output:    `out` is written (`=`); the in-place form accumulates (`acc +=`). `out` may alias `a`
//            (that is how the in-place form is launched): each element is read before the same
//            thread writes it, so no pointer here is __restrict__.

#include "tilearn_dtype.cuh"
#include "tilearn_kernels.h"

namespace {

using tilearn::from_f32;
using tilearn::to_f32;
using tilearn::Vec16;  // 16 bytes of T, one vector load / store

constexpr int kThreads = 256;
constexpr unsigned kMaxBlocks = 65535;  // grid-stride loops cover the rest

template <typename T>
__global__ void add_vec_kernel(const T* a, const T* b, T* out, size_t n) {
    constexpr int kLen = Vec16<T>::kLen;
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const size_t nv = n / kLen;
    const Vec16<T>* av = reinterpret_cast<const Vec16<T>*>(a);
    const Vec16<T>* bv = reinterpret_cast<const Vec16<T>*>(b);
    Vec16<T>* ov = reinterpret_cast<Vec16<T>*>(out);
    for (size_t i = tid; i < nv; i += stride) {
        const Vec16<T> x = av[i];
        const Vec16<T> y = bv[i];
        Vec16<T> z;
#pragma unroll
        for (int k = 0; k < kLen; ++k) z.v[k] = from_f32<T>(to_f32(x.v[k]) + to_f32(y.v[k]));
        ov[i] = z;
    }
    for (size_t i = nv * kLen + tid; i < n; i += stride)
        out[i] = from_f32<T>(to_f32(a[i]) + to_f32(b[i]));
}

template <typename T>
__global__ void add_scalar_kernel(const T* a, const T* b, T* out, size_t n) {
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = from_f32<T>(to_f32(a[i]) + to_f32(b[i]));
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

unsigned blocks_for(size_t work) {
    const size_t b = (work + kThreads - 1) / kThreads;
    return static_cast<unsigned>(b < kMaxBlocks ? (b == 0 ? 1 : b) : kMaxBlocks);
}

template <typename T>
int launch_add(const void* a, const void* b, void* out, size_t n, cudaStream_t stream) {
    if (n == 0) return static_cast<int>(cudaSuccess);
    if (a == nullptr || b == nullptr || out == nullptr)
        return static_cast<int>(cudaErrorInvalidValue);
    const T* at = static_cast<const T*>(a);
    const T* bt = static_cast<const T*>(b);
    T* ot = static_cast<T*>(out);
    constexpr size_t kLen = Vec16<T>::kLen;
    if (aligned16(a) && aligned16(b) && aligned16(out) && n >= kLen) {
        add_vec_kernel<T><<<blocks_for(n / kLen), kThreads, 0, stream>>>(at, bt, ot, n);
    } else {
        add_scalar_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(at, bt, ot, n);
    }
    return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" int tilearn_residual_add(int dtype, const void* a, const void* b, void* out,
                                    size_t n, cudaStream_t stream) {
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch_add<decltype(tag)>(a, b, out, n, stream);
    });
}

extern "C" int tilearn_residual_add_inplace(int dtype, void* acc, const void* x, size_t n,
                                            cudaStream_t stream) {
    // out == a == acc: the aliasing the kernel allows (see the header comment).
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch_add<decltype(tag)>(acc, x, acc, n, stream);
    });
}
