// cached_attention.cu: causal grouped-query attention of n new queries against a key/value cache
// (generation: the prompt's prefill with n = prompt length, then n = 1 per decoded token).
// Query row i sits at absolute position start + i and attends to cached keys 0..=start + i;
// query head h reads kv head h / (q_heads / kv_heads).
//   out[i, h, :] = sum_j softmax_j(scale * q[i, h, :] . k[j, g, :] + b_h(j)) v[j, g, :]
// with b_h(j) = slope[h] * (j - (start + i)) under ALiBi (slopes given: Bloom, Baichuan-13B),
// else 0; without slopes the scores are exactly those of the plain kernel.
//
// Fused:     scores, the online softmax (running max and sum, rescaled accumulator) and the
//            product with V in one kernel; scores never reach device memory.
// Layout:    q / out: [n, q_heads, head_dim] row-major (the projections' [n, q_heads * head_dim]);
//            k / v: the cache, [positions, kv_heads, head_dim] row-major with at least
//            start + n positions written. One block per (query head, query row), kWarps warps;
//            warp w takes keys w, w + kWarps, ... (each lane holds head_dim / 32 elements of q
//            and of its accumulator, strided by 32 so loads are coalesced), then the warps'
//            partial (max, sum, accumulator) are merged in shared memory in warp order.
// Precision: q, k, v, out f32, bf16 or f16; every product, exponential and sum in f32 (expf,
//            not the fast intrinsic); out rounded once to its type. head_dim <= 256.
// Gradients: none (forward only; generation needs no backward). out is written (`=`).
// Determinism: a fixed key order per warp, butterfly shuffles, the merge in warp order; no
//            atomics.

#include "tilearn_dtype.cuh"
#include "tilearn_kernels.h"

namespace {

using tilearn::from_f32;
using tilearn::to_f32;

constexpr int kWarp = 32;
constexpr int kWarps = 8;
constexpr int kMaxPerLane = 8;  // head_dim <= 256
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(kFullMask, v, o);
    return v;
}

template <typename T>
__global__ void __launch_bounds__(kWarps* kWarp)
    cached_attention_kernel(const T* __restrict__ q, const T* __restrict__ k,
                            const T* __restrict__ v, T* __restrict__ out, size_t start,
                            int q_heads, int kv_heads, int head_dim, float scale,
                            const float* __restrict__ alibi) {
    __shared__ float part_max[kWarps];
    __shared__ float part_sum[kWarps];
    __shared__ float part_acc[kWarps][kMaxPerLane * kWarp];

    const int h = blockIdx.x;
    const size_t i = blockIdx.y;
    const int g = h / (q_heads / kv_heads);
    const int warp = threadIdx.x / kWarp;
    const int lane = threadIdx.x % kWarp;
    const size_t keys = start + i + 1;
    const float slope = alibi == nullptr ? 0.0f : alibi[h];
    const size_t kv_row = static_cast<size_t>(kv_heads) * head_dim;

    const T* qh = q + (i * q_heads + h) * static_cast<size_t>(head_dim);
    float qr[kMaxPerLane];
    float acc[kMaxPerLane];
#pragma unroll
    for (int r = 0; r < kMaxPerLane; ++r) {
        const int e = lane + r * kWarp;
        qr[r] = e < head_dim ? to_f32(qh[e]) * scale : 0.f;
        acc[r] = 0.f;
    }
    float m = -INFINITY;
    float l = 0.f;
    for (size_t j = warp; j < keys; j += kWarps) {
        const T* kj = k + j * kv_row + static_cast<size_t>(g) * head_dim;
        float dot = 0.f;
#pragma unroll
        for (int r = 0; r < kMaxPerLane; ++r) {
            const int e = lane + r * kWarp;
            if (e < head_dim) dot += qr[r] * to_f32(kj[e]);
        }
        float s = warp_sum(dot);
        // ALiBi: key j is keys - 1 - j positions behind the query.
        if (alibi != nullptr) s = fmaf(slope, -static_cast<float>(keys - 1 - j), s);
        const float m_new = fmaxf(m, s);
        const float correction = expf(m - m_new);  // 0 for the first key (m = -inf)
        const float p = expf(s - m_new);
        l = l * correction + p;
        const T* vj = v + j * kv_row + static_cast<size_t>(g) * head_dim;
#pragma unroll
        for (int r = 0; r < kMaxPerLane; ++r) {
            const int e = lane + r * kWarp;
            if (e < head_dim) acc[r] = acc[r] * correction + p * to_f32(vj[e]);
        }
        m = m_new;
    }
    if (lane == 0) {
        part_max[warp] = m;
        part_sum[warp] = l;
    }
#pragma unroll
    for (int r = 0; r < kMaxPerLane; ++r) part_acc[warp][lane + r * kWarp] = acc[r];
    __syncthreads();

    // Merge: warp 0 always holds key 0, so the overall maximum is finite; a warp that saw no
    // key (m = -inf) contributes exp(-inf) = 0.
    float total_max = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total_max = fmaxf(total_max, part_max[w]);
    float weights[kWarps];
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
        weights[w] = expf(part_max[w] - total_max);
        total += part_sum[w] * weights[w];
    }
    const float inv_total = 1.f / total;
    T* oh = out + (i * q_heads + h) * static_cast<size_t>(head_dim);
    for (int e = threadIdx.x; e < head_dim; e += kWarps * kWarp) {
        float o = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) o += part_acc[w][e] * weights[w];
        oh[e] = from_f32<T>(o * inv_total);
    }
}

template <typename T>
int launch_cached_attention(const void* q, const void* k, const void* v, void* out, size_t n,
                            size_t start, size_t q_heads, size_t kv_heads, size_t head_dim,
                            float scale, const float* alibi, cudaStream_t stream) {
    if (head_dim == 0 || head_dim > static_cast<size_t>(kMaxPerLane * kWarp) || kv_heads == 0 ||
        q_heads % kv_heads != 0 || q_heads > 0x7fffffffu || n > 65535u)
        return static_cast<int>(cudaErrorInvalidValue);
    if (n == 0 || q_heads == 0) return static_cast<int>(cudaSuccess);
    if (q == nullptr || k == nullptr || v == nullptr || out == nullptr)
        return static_cast<int>(cudaErrorInvalidValue);
    const dim3 grid(static_cast<unsigned>(q_heads), static_cast<unsigned>(n));
    cached_attention_kernel<T><<<grid, kWarps * kWarp, 0, stream>>>(
        static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
        static_cast<T*>(out), start, static_cast<int>(q_heads), static_cast<int>(kv_heads),
        static_cast<int>(head_dim), scale, alibi);
    return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" int tilearn_cached_attention(int dtype, const void* q, const void* k, const void* v,
                                        void* out, size_t n, size_t start, size_t q_heads,
                                        size_t kv_heads, size_t head_dim, float scale,
                                        const float* alibi_slopes, cudaStream_t stream) {
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch_cached_attention<decltype(tag)>(q, k, v, out, n, start, q_heads, kv_heads,
                                                      head_dim, scale, alibi_slopes, stream);
    });
}
