// rope.cu: rotary position embedding, Hugging Face Llama convention (rotate_half): element i of
// a head pairs with element i + h (h = head_dim / 2), both rotated by the angle of position t:
//   y[i]     = x[i] * cos[t, i] - x[i+h] * sin[t, i]
//   y[i+h]   = x[i+h] * cos[t, i] + x[i] * sin[t, i]          (i < h)
// The backward applies the inverse (transposed) rotation, i.e. the same formula with -sin.
//
// Fused:     nothing beyond the rotation; applied in place to q or k.
// Layout:    x is [batch, seq, heads, head_dim] row-major, rotated in place; token (b, t) uses
//            row positions[b, t] of the tables (int32 [batch, seq]: packed examples restart
//            at 0), or row t when positions is null. cos and sin are [table_seq, h] row-major f32
//            (table_seq >= seq), computed on the host in f64 (tilearn_ops::cpu::RopeTable,
//            which applies the rope_scaling variants) and uploaded rounded to f32. One thread
//            rotates a group of pairs: 16 bytes of x from each half (4 f32, or 8 bf16 / f16
//            pairs) when h is a multiple of that width and x, cos, sin are 16-byte aligned; one
//            pair per thread otherwise.
// Precision: x f32, bf16 or f16; arithmetic in f32 with f32 cos/sin; each output rounded once
//            to the storage type. (transformers rounds cos/sin and both products to the model's
//            half type; this is at least as accurate.)
// Gradients: the backward rewrites the incoming gradient in place (`=`, dx replaces dy); no
//            parameters.

#include "tilearn_dtype.cuh"
#include "tilearn_kernels.h"

namespace {

using tilearn::aligned16;
using tilearn::from_f32;
using tilearn::to_f32;

constexpr int kThreads = 256;
constexpr unsigned kMaxBlocks = 65535;  // grid-stride loops cover the rest

// N consecutive elements moved together: one 16-byte access per 16 bytes when N * sizeof(T) is a
// multiple of 16, a plain scalar access when N == 1.
template <typename T, int N>
struct alignas(N * sizeof(T) < 16 ? N * sizeof(T) : 16) Pack {
    T v[N];
};

// One work item = kVec pairs (i, i + h) of one head of one row.
template <typename T, int kVec, bool kInverse>
__global__ void rope_kernel(T* __restrict__ x, const float* __restrict__ cos_table,
                            const float* __restrict__ sin_table,
                            const int* __restrict__ positions, size_t table_seq,
                            size_t rows, size_t seq, size_t heads, size_t half) {
    const size_t groups = half / kVec;  // launch guarantees half % kVec == 0
    const size_t work = rows * groups;
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    for (size_t w = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; w < work;
         w += stride) {
        const size_t row = w / groups;  // (b, t, head) flattened
        const size_t i0 = (w - row * groups) * kVec;
        const size_t token = row / heads;  // b * seq + t
        // A position outside the table (the caller checks; a bad one must not read out of
        // bounds) is clamped to it.
        const size_t t = positions != nullptr
                             ? static_cast<size_t>(min(max(positions[token], 0),
                                                       static_cast<int>(table_seq - 1)))
                             : token % seq;
        Pack<T, kVec>* lo = reinterpret_cast<Pack<T, kVec>*>(x + row * 2 * half + i0);
        Pack<T, kVec>* hi = reinterpret_cast<Pack<T, kVec>*>(x + row * 2 * half + half + i0);
        const Pack<float, kVec> c =
            *reinterpret_cast<const Pack<float, kVec>*>(cos_table + t * half + i0);
        const Pack<float, kVec> s =
            *reinterpret_cast<const Pack<float, kVec>*>(sin_table + t * half + i0);
        const Pack<T, kVec> a = *lo;
        const Pack<T, kVec> b = *hi;
        Pack<T, kVec> ya, yb;
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
            const float x1 = to_f32(a.v[k]);
            const float x2 = to_f32(b.v[k]);
            const float sn = kInverse ? -s.v[k] : s.v[k];
            ya.v[k] = from_f32<T>(x1 * c.v[k] - x2 * sn);
            yb.v[k] = from_f32<T>(x2 * c.v[k] + x1 * sn);
        }
        *lo = ya;
        *hi = yb;
    }
}

unsigned blocks_for(size_t work) {
    const size_t b = (work + kThreads - 1) / kThreads;
    return static_cast<unsigned>(b < kMaxBlocks ? (b == 0 ? 1 : b) : kMaxBlocks);
}

// a * b without overflow, or false.
bool mul_ok(size_t a, size_t b, size_t* out) {
    if (a != 0 && b > SIZE_MAX / a) return false;
    *out = a * b;
    return true;
}

template <typename T, bool kInverse>
int launch_rope(void* x, const float* cos_table, const float* sin_table,
                const int32_t* positions, size_t batch, size_t seq, size_t heads,
                size_t head_dim, size_t table_seq, cudaStream_t stream) {
    if (head_dim == 0 || head_dim % 2 != 0 || seq > table_seq || table_seq > 0x7fffffff)
        return static_cast<int>(cudaErrorInvalidValue);
    size_t bt = 0, rows = 0, elems = 0, table_elems = 0;
    if (!mul_ok(batch, seq, &bt) || !mul_ok(bt, heads, &rows) || !mul_ok(rows, head_dim, &elems) ||
        !mul_ok(table_seq, head_dim / 2, &table_elems))
        return static_cast<int>(cudaErrorInvalidValue);
    if (elems == 0) return static_cast<int>(cudaSuccess);
    if (x == nullptr || cos_table == nullptr || sin_table == nullptr)
        return static_cast<int>(cudaErrorInvalidValue);
    const size_t half = head_dim / 2;
    T* xt = static_cast<T*>(x);
    constexpr int kVec = 16 / sizeof(T);
    if (half % kVec == 0 && aligned16(x) && aligned16(cos_table) && aligned16(sin_table)) {
        rope_kernel<T, kVec, kInverse><<<blocks_for(rows * (half / kVec)), kThreads, 0, stream>>>(
            xt, cos_table, sin_table, positions, table_seq, rows, seq, heads, half);
    } else {
        rope_kernel<T, 1, kInverse><<<blocks_for(rows * half), kThreads, 0, stream>>>(
            xt, cos_table, sin_table, positions, table_seq, rows, seq, heads, half);
    }
    return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" int tilearn_rope_forward(int dtype, void* x, const float* cos_table,
                                    const float* sin_table, const int32_t* positions,
                                    size_t batch, size_t seq, size_t heads, size_t head_dim,
                                    size_t table_seq, cudaStream_t stream) {
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch_rope<decltype(tag), false>(x, cos_table, sin_table, positions, batch, seq,
                                                 heads, head_dim, table_seq, stream);
    });
}

extern "C" int tilearn_rope_backward(int dtype, void* dx, const float* cos_table,
                                     const float* sin_table, const int32_t* positions,
                                     size_t batch, size_t seq, size_t heads, size_t head_dim,
                                     size_t table_seq, cudaStream_t stream) {
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch_rope<decltype(tag), true>(dx, cos_table, sin_table, positions, batch, seq,
                                                heads, head_dim, table_seq, stream);
    });
}
