// attention.cu: the element-wise and row-wise kernels of causal grouped-query attention; the
// matrix products (S = scale·Q·Kᵀ, O = P·V and the four backward products) run on cuBLASLt, in
// crates/tilearn-ops/src/cuda/attention.rs, which also documents the whole algorithm.
//
// Fused:     softmax: the causal mask (and the optional key mask: packed examples by restarting
//            positions, a sliding window; query i sees keys lo(i) ..= i, see tilearn_key_mask), the row max, the sum of exponentials (one online pass),
//            the probabilities and the log-sum-exp, in one kernel (S is read twice, P written
//            once). probs: the backward's recomputation P = exp(S - lse) with the mask.
//            ALiBi (optional slopes in the key mask): softmax and probs add slope[head] ·
//            (j − i) to each score as they read it (head = row / seq % heads); dscores needs no
//            bias (it is a constant of the scores).
//            dscores: dS = P ∘ (dP − delta) · scale with the mask, written over P in place.
//            delta: rowsum(dO ∘ O) straight from the [B, T, H, D] tensors (no permute); for
//            16-bit types at head_dim 64 / 128, 16-byte loads in memory order.
// Layout:    scores / dP: f32 [rows, ld] row-major with rows = (batch, head, query) and the
//            query position i = row % seq; only columns [0, seq) are used (ld >= seq pads rows
//            for aligned GEMMs). probs / dS: [rows, ld] of f32, bf16 or f16; every column j in
//            [0, seq) is written: keys j <= i get their value, keys j > i an exact 0 (the GEMMs
//            that consume P run over all seq columns). lse / delta: f32 [rows].
//            swap_axes: [outer, x, y, inner] -> [outer, y, x, inner] on raw bytes (the permute
//            between the projections' [B, T, H, D] and the per-head [B, H, T, D]).
// Precision: scores, dP, lse, delta and all arithmetic in f32 (expf / logf, not the fast
//            intrinsics, so the f32 path meets 1e-5 against the reference); P and dS are
//            rounded once to their storage type, the launcher's dtype: f32, bf16 or f16 (P is
//            in [0, 1], which f16 holds; tiny dS values become f16 subnormals).
// Gradients: dS and delta are written (`=`); there are no parameters.
// Determinism: one warp per row, butterfly shuffles in a fixed pattern, no atomics.

#include "tilearn_dtype.cuh"
#include "tilearn_kernels.h"

namespace {

constexpr int kWarp = 32;
constexpr int kRowsPerBlock = 8;  // one warp per row, 256 threads
constexpr unsigned kFullMask = 0xffffffffu;
constexpr unsigned kMaxGridX = 0x7fffffffu;

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = kWarp / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(kFullMask, v, o);
    return v;
}

__device__ __forceinline__ size_t warp_row() {
    return static_cast<size_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
}

// The key mask as the row kernels read it: positions from the chunk's first batch row, the
// window (0: none), and the rows of one batch row (heads * seq).
struct RowMask {
    const int32_t* positions;
    size_t window;
    size_t rows_per_batch;
    const float* alibi;  // [heads] slopes, or null
    size_t seq;          // rows of one head (to find a row's head for its slope)
    size_t heads;
};

// The ALiBi slope of row r (0 without slopes): bias slope * (j - i) for key j.
__device__ __forceinline__ float row_slope(const RowMask& m, size_t r) {
    return m.alibi == nullptr ? 0.0f : m.alibi[(r / m.seq) % m.heads];
}

// Score j of query i with the row's ALiBi bias (exactly s[j] when slope is 0).
__device__ __forceinline__ float biased(const float* s, size_t j, size_t i, float slope) {
    return fmaf(slope, static_cast<float>(static_cast<long long>(j) - static_cast<long long>(i)),
                s[j]);
}

// The first key query i of row r sees (0 without a mask), clamped to [0, i]: the rule of
// tilearn_key_mask and of the CPU reference's key_start.
__device__ __forceinline__ size_t first_key(const RowMask& m, size_t r, size_t i, size_t seq) {
    long long lo = 0;
    const long long ii = static_cast<long long>(i);
    if (m.positions != nullptr) lo = ii - m.positions[(r / m.rows_per_batch) * seq + i];
    if (m.window > 0) {
        const long long w = ii + 1 - static_cast<long long>(m.window);
        lo = lo > w ? lo : w;
    }
    lo = lo < 0 ? 0 : (lo > ii ? ii : lo);
    return static_cast<size_t>(lo);
}

// ---- swap_axes: dst[o, yi, xi, e] = src[o, xi, yi, e], moved in words of W bytes ----
template <typename W>
__global__ void swap_axes_kernel(const W* __restrict__ src, W* __restrict__ dst, size_t outer,
                                 size_t x, size_t y, size_t inner) {
    const size_t n = outer * x * y * inner;
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    for (size_t idx = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < n;
         idx += stride) {
        const size_t e = idx % inner;
        size_t rest = idx / inner;
        const size_t xi = rest % x;
        rest /= x;
        const size_t yi = rest % y;
        const size_t o = rest / y;
        dst[idx] = src[((o * x + xi) * y + yi) * inner + e];
    }
}

// ---- softmax: P[r, j] = exp(S[r, j] - lse[r]) for j <= i, 0 for i < j < seq ----
template <typename TP>
__global__ void softmax_kernel(const float* __restrict__ scores, size_t ld, size_t rows,
                               size_t seq, TP* __restrict__ probs, float* __restrict__ lse,
                               RowMask mask) {
    const size_t r = warp_row();
    if (r >= rows) return;
    const int lane = threadIdx.x % kWarp;
    const size_t i = r % seq;
    const size_t lo = first_key(mask, r, i, seq);
    const float slope = row_slope(mask, r);
    const float* s = scores + r * ld;
    // Online max and sum of this lane's keys, then the warp's.
    float m = -INFINITY, l = 0.0f;
    for (size_t j = lo + lane; j <= i; j += kWarp) {
        const float x = biased(s, j, i, slope);
        const float m_new = fmaxf(m, x);
        l = l * expf(m - m_new) + expf(x - m_new);
        m = m_new;
    }
    const float m_all = warp_max(m);
    // A lane without keys has m = -inf and l = 0: its term is 0 * exp(-inf) = 0.
    const float l_all = warp_sum(l == 0.0f ? 0.0f : l * expf(m - m_all));
    const float row_lse = m_all + logf(l_all);
    TP* p = probs + r * ld;
    for (size_t j = lane; j < seq; j += kWarp)
        p[j] = tilearn::from_f32<TP>(lo <= j && j <= i ? expf(biased(s, j, i, slope) - row_lse)
                                                       : 0.0f);
    if (lane == 0) lse[r] = row_lse;
}

// ---- probs: the backward's P = exp(S - lse) with the causal mask ----
template <typename TP>
__global__ void probs_kernel(const float* __restrict__ scores, size_t ld, size_t rows, size_t seq,
                             const float* __restrict__ lse, TP* __restrict__ probs,
                             RowMask mask) {
    const size_t r = warp_row();
    if (r >= rows) return;
    const int lane = threadIdx.x % kWarp;
    const size_t i = r % seq;
    const size_t lo = first_key(mask, r, i, seq);
    const float row_lse = lse[r];
    const float slope = row_slope(mask, r);
    const float* s = scores + r * ld;
    TP* p = probs + r * ld;
    for (size_t j = lane; j < seq; j += kWarp)
        p[j] = tilearn::from_f32<TP>(lo <= j && j <= i ? expf(biased(s, j, i, slope) - row_lse)
                                                       : 0.0f);
}

// ---- dscores: dS = P * (dP - delta) * scale, in place over P, with the causal mask ----
template <typename TP>
__global__ void dscores_kernel(TP* __restrict__ probs_ds, const float* __restrict__ dprobs,
                               size_t ld, size_t rows, size_t seq,
                               const float* __restrict__ delta, float scale, RowMask mask) {
    const size_t r = warp_row();
    if (r >= rows) return;
    const int lane = threadIdx.x % kWarp;
    const size_t i = r % seq;
    const size_t lo = first_key(mask, r, i, seq);
    const float row_delta = delta[r];
    TP* p = probs_ds + r * ld;
    const float* dp = dprobs + r * ld;
    for (size_t j = lane; j < seq; j += kWarp) {
        // Each element is read and written by the same thread, so in place is race-free.
        const float v =
            lo <= j && j <= i ? tilearn::to_f32(p[j]) * (dp[j] - row_delta) * scale : 0.0f;
        p[j] = tilearn::from_f32<TP>(v);
    }
}

// ---- delta[b, h, t] = sum_d dout[b, t, h, d] * out[b, t, h, d] ----
template <typename T>
__global__ void delta_kernel(const T* __restrict__ dout, const T* __restrict__ out, size_t batch,
                             size_t seq, size_t heads, size_t head_dim,
                             float* __restrict__ delta) {
    const size_t r = warp_row();  // (b, h, t)
    if (r >= batch * heads * seq) return;
    const int lane = threadIdx.x % kWarp;
    const size_t t = r % seq;
    const size_t bh = r / seq;
    const size_t h = bh % heads;
    const size_t b = bh / heads;
    const size_t base = ((b * seq + t) * heads + h) * head_dim;
    float acc = 0.0f;
    for (size_t d = lane; d < head_dim; d += kWarp)
        acc += tilearn::to_f32(dout[base + d]) * tilearn::to_f32(out[base + d]);
    acc = warp_sum(acc);
    if (lane == 0) delta[r] = acc;
}

// The same for 16-bit types with head_dim = 8 LANES (64 or 128) and 16-byte aligned tensors:
// LANES threads per row load 16 bytes each of dout and out, rows taken in memory order
// ([b, t, h]: the loads of a warp are contiguous); the (b, h, t) index is formed only for the
// store. The one-warp-per-row kernel above reads 2 bytes a lane and reached a third of the copy
// bandwidth (H200, TinyLlama's attention shape: 0.113 ms for 134 MB).
template <typename T, int LANES>
__global__ void delta_vec_kernel(const T* __restrict__ dout, const T* __restrict__ out,
                                 unsigned rows, unsigned seq, unsigned heads,
                                 float* __restrict__ delta) {
    constexpr int kRowsPerCta = 256 / LANES;
    const unsigned m = blockIdx.x * kRowsPerCta + threadIdx.x / LANES;  // (b, t, h)
    const int part = static_cast<int>(threadIdx.x % LANES);
    float acc = 0.0f;
    if (m < rows) {
        const size_t at = static_cast<size_t>(m) * LANES + part;
        const uint4 x = reinterpret_cast<const uint4*>(dout)[at];
        const uint4 y = reinterpret_cast<const uint4*>(out)[at];
        const T* xs = reinterpret_cast<const T*>(&x);
        const T* ys = reinterpret_cast<const T*>(&y);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc += tilearn::to_f32(xs[i]) * tilearn::to_f32(ys[i]);
    }
#pragma unroll
    for (int o = LANES / 2; o > 0; o /= 2) acc += __shfl_xor_sync(kFullMask, acc, o);
    if (m < rows && part == 0) {
        const unsigned h = m % heads;
        const unsigned bt = m / heads;
        delta[(static_cast<size_t>(bt / seq) * heads + h) * seq + bt % seq] = acc;
    }
}

template <typename T, int LANES>
int launch_delta_vec(const void* dout, const void* out, size_t rows, size_t seq, size_t heads,
                     float* delta, cudaStream_t stream) {
    constexpr size_t kRowsPerCta = 256 / LANES;
    delta_vec_kernel<T, LANES><<<static_cast<unsigned>((rows + kRowsPerCta - 1) / kRowsPerCta),
                                 256, 0, stream>>>(
        static_cast<const T*>(dout), static_cast<const T*>(out), static_cast<unsigned>(rows),
        static_cast<unsigned>(seq), static_cast<unsigned>(heads), delta);
    return static_cast<int>(cudaGetLastError());
}

bool row_grid(size_t rows, unsigned* blocks) {
    const size_t b = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
    if (b == 0 || b > kMaxGridX) return false;
    *blocks = static_cast<unsigned>(b);
    return true;
}

bool row_args_ok(const void* a, const void* b, size_t ld, size_t rows, size_t seq) {
    return a != nullptr && b != nullptr && seq > 0 && ld >= seq && rows % seq == 0 &&
           rows <= SIZE_MAX / ld;
}

// The row kernels' view of `mask` (NULL: causal), or false when it is unusable.
bool row_mask(const tilearn_key_mask* mask, size_t heads, size_t seq, RowMask* out) {
    *out = RowMask{nullptr, 0, 1, nullptr, 1, 1};
    if (mask == nullptr) return true;
    if (heads == 0 || heads > SIZE_MAX / seq) return false;
    if (mask->positions != nullptr && reinterpret_cast<uintptr_t>(mask->positions) % 4 != 0)
        return false;
    if (mask->alibi_slopes != nullptr &&
        reinterpret_cast<uintptr_t>(mask->alibi_slopes) % 4 != 0)
        return false;
    *out = RowMask{mask->positions, mask->sliding_window, heads * seq, mask->alibi_slopes, seq,
                   heads};
    return true;
}

template <typename TP>
int launch_softmax(const float* scores, size_t ld, size_t rows, size_t seq, void* probs,
                   float* lse, const tilearn_key_mask* km, size_t heads, cudaStream_t stream) {
    if (rows == 0) return static_cast<int>(cudaSuccess);
    RowMask mask;
    if (!row_args_ok(scores, probs, ld, rows, seq) || lse == nullptr ||
        !row_mask(km, heads, seq, &mask))
        return static_cast<int>(cudaErrorInvalidValue);
    unsigned blocks;
    if (!row_grid(rows, &blocks)) return static_cast<int>(cudaErrorInvalidValue);
    softmax_kernel<TP><<<blocks, kRowsPerBlock * kWarp, 0, stream>>>(
        scores, ld, rows, seq, static_cast<TP*>(probs), lse, mask);
    return static_cast<int>(cudaGetLastError());
}

template <typename TP>
int launch_probs(const float* scores, size_t ld, size_t rows, size_t seq, const float* lse,
                 void* probs, const tilearn_key_mask* km, size_t heads, cudaStream_t stream) {
    if (rows == 0) return static_cast<int>(cudaSuccess);
    RowMask mask;
    if (!row_args_ok(scores, probs, ld, rows, seq) || lse == nullptr ||
        !row_mask(km, heads, seq, &mask))
        return static_cast<int>(cudaErrorInvalidValue);
    unsigned blocks;
    if (!row_grid(rows, &blocks)) return static_cast<int>(cudaErrorInvalidValue);
    probs_kernel<TP><<<blocks, kRowsPerBlock * kWarp, 0, stream>>>(
        scores, ld, rows, seq, lse, static_cast<TP*>(probs), mask);
    return static_cast<int>(cudaGetLastError());
}

template <typename TP>
int launch_dscores(void* probs_ds, const float* dprobs, size_t ld, size_t rows, size_t seq,
                   const float* delta, float scale, const tilearn_key_mask* km, size_t heads,
                   cudaStream_t stream) {
    if (rows == 0) return static_cast<int>(cudaSuccess);
    RowMask mask;
    if (!row_args_ok(probs_ds, dprobs, ld, rows, seq) || delta == nullptr ||
        !row_mask(km, heads, seq, &mask))
        return static_cast<int>(cudaErrorInvalidValue);
    unsigned blocks;
    if (!row_grid(rows, &blocks)) return static_cast<int>(cudaErrorInvalidValue);
    dscores_kernel<TP><<<blocks, kRowsPerBlock * kWarp, 0, stream>>>(
        static_cast<TP*>(probs_ds), dprobs, ld, rows, seq, delta, scale, mask);
    return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch_delta(const void* dout, const void* out, size_t batch, size_t seq, size_t heads,
                 size_t head_dim, float* delta, cudaStream_t stream) {
    if (batch == 0 || seq == 0 || heads == 0) return static_cast<int>(cudaSuccess);
    if (dout == nullptr || out == nullptr || delta == nullptr || head_dim == 0)
        return static_cast<int>(cudaErrorInvalidValue);
    if (seq > SIZE_MAX / heads || batch > SIZE_MAX / (seq * heads))
        return static_cast<int>(cudaErrorInvalidValue);
    const size_t rows = batch * heads * seq;
    if constexpr (sizeof(T) == 2) {
        if (rows <= 0xffffffffu && tilearn::aligned16(dout) && tilearn::aligned16(out)) {
            if (head_dim == 64)
                return launch_delta_vec<T, 8>(dout, out, rows, seq, heads, delta, stream);
            if (head_dim == 128)
                return launch_delta_vec<T, 16>(dout, out, rows, seq, heads, delta, stream);
        }
    }
    unsigned blocks;
    if (!row_grid(rows, &blocks)) return static_cast<int>(cudaErrorInvalidValue);
    delta_kernel<T><<<blocks, kRowsPerBlock * kWarp, 0, stream>>>(
        static_cast<const T*>(dout), static_cast<const T*>(out), batch, seq, heads, head_dim,
        delta);
    return static_cast<int>(cudaGetLastError());
}

template <typename W>
void launch_swap(const void* src, void* dst, size_t outer, size_t x, size_t y, size_t inner_bytes,
                 cudaStream_t stream) {
    const size_t inner = inner_bytes / sizeof(W);
    const size_t n = outer * x * y * inner;
    const unsigned threads = 256;
    size_t blocks = (n + threads - 1) / threads;
    if (blocks > 65535u * 8u) blocks = 65535u * 8u;  // grid-stride loop covers the rest
    swap_axes_kernel<W><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
        static_cast<const W*>(src), static_cast<W*>(dst), outer, x, y, inner);
}

}  // namespace

extern "C" int tilearn_attention_swap_axes(const void* src, void* dst, size_t outer, size_t x,
                                           size_t y, size_t inner_bytes, cudaStream_t stream) {
    if (outer == 0 || x == 0 || y == 0 || inner_bytes == 0) return static_cast<int>(cudaSuccess);
    if (src == nullptr || dst == nullptr || src == dst)
        return static_cast<int>(cudaErrorInvalidValue);
    if (x > SIZE_MAX / y || outer > SIZE_MAX / (x * y) ||
        inner_bytes > SIZE_MAX / (outer * x * y))
        return static_cast<int>(cudaErrorInvalidValue);
    // The widest word that divides the row of `inner_bytes` and both pointers' alignment.
    const uintptr_t align = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) |
                            static_cast<uintptr_t>(inner_bytes);
    if (align % 16 == 0) {
        launch_swap<uint4>(src, dst, outer, x, y, inner_bytes, stream);
    } else if (align % 8 == 0) {
        launch_swap<uint2>(src, dst, outer, x, y, inner_bytes, stream);
    } else if (align % 4 == 0) {
        launch_swap<uint32_t>(src, dst, outer, x, y, inner_bytes, stream);
    } else if (align % 2 == 0) {
        launch_swap<uint16_t>(src, dst, outer, x, y, inner_bytes, stream);
    } else {
        launch_swap<uint8_t>(src, dst, outer, x, y, inner_bytes, stream);
    }
    return static_cast<int>(cudaGetLastError());
}

extern "C" int tilearn_attention_softmax(int dtype, const float* scores, size_t ld, size_t rows,
                                         size_t seq, void* probs, float* lse,
                                         const tilearn_key_mask* mask, size_t heads,
                                         cudaStream_t stream) {
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch_softmax<decltype(tag)>(scores, ld, rows, seq, probs, lse, mask, heads,
                                             stream);
    });
}

extern "C" int tilearn_attention_probs(int dtype, const float* scores, size_t ld, size_t rows,
                                       size_t seq, const float* lse, void* probs,
                                       const tilearn_key_mask* mask, size_t heads,
                                       cudaStream_t stream) {
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch_probs<decltype(tag)>(scores, ld, rows, seq, lse, probs, mask, heads,
                                           stream);
    });
}

extern "C" int tilearn_attention_dscores(int dtype, void* probs_ds, const float* dprobs, size_t ld,
                                         size_t rows, size_t seq, const float* delta, float scale,
                                         const tilearn_key_mask* mask, size_t heads,
                                         cudaStream_t stream) {
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch_dscores<decltype(tag)>(probs_ds, dprobs, ld, rows, seq, delta, scale, mask,
                                             heads, stream);
    });
}

extern "C" int tilearn_attention_delta(int dtype, const void* dout, const void* out, size_t batch,
                                       size_t seq, size_t heads, size_t head_dim, float* delta,
                                       cudaStream_t stream) {
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch_delta<decltype(tag)>(dout, out, batch, seq, heads, head_dim, delta, stream);
    });
}
