// norm.cu: RMSNorm forward and backward (Hugging Face LlamaRMSNorm),
//   y = w * x * rstd,  rstd = 1 / sqrt(mean(x^2) + eps)   (mean over the last axis),
// and LayerNorm with weight and bias (PyTorch nn.LayerNorm, Bloom; see the end of this header),
//   y = (x - mean) * rstd * w + b,  rstd = 1 / sqrt(mean((x - mean)^2) + eps).
//
// Fused:     forward: the sum of squares, rstd and the scaling by w in one pass per row (rstd
//            is saved for the backward). Backward: dx and the per-row contribution to dweight in
//            one pass per row; a second small kernel reduces the dweight partials.
// Layout:    x, out, dout, dx are row-major [rows, dim]; weight and dweight are [dim]; rstd is
//            [rows]. One thread block per row in the forward; one block per chunk of consecutive
//            rows in the backward. The backward's fast path (16-byte aligned tensors, dim a
//            multiple of 16 bytes' elements, at most 8 such vectors per lane: dim <= 2048 in
//            bf16/f16, 1024 in f32) gives each row to one warp: a lane loads its 16-byte
//            vectors of dy and x (and the residual gradient it adds into) once into registers,
//            the row's dot product is a warp shuffle (no block barrier per row), and each lane
//            keeps its columns' dweight sums in its warp's slice of shared memory; the block's
//            warps take the chunk's rows round-robin and their sums are added in warp order at
//            the end. Other shapes take the scalar block-per-chunk kernel.
// Precision: inputs f32, bf16 or f16 (one launcher per op, `dtype` picks the kernel template);
//            all arithmetic and accumulation in f32; rstd and dweight are always f32; out / dx are
//            stored in the input type. The 16-bit forwards round like PyTorch's LlamaRMSNorm
//            (x * rstd cast back to the input dtype, then times the weight):
//            out = T(w * T(x * rstd)) for T = bf16 or f16 (for f32 the inner cast is exact).
// Gradients: dx is written (`=`); dweight is accumulated (`+=`), deterministically: each block
//            sums its rows' dy * x * rstd into its own partial (shared memory, or its own slice
//            of scratch for very wide rows; the fast path: per warp in shared memory, then the
//            warps in order), then the partials are added in chunk order (the fast reduction: 32
//            groups of chunks per column, summed in order, then the groups in order). No float
//            atomics, so the result is bit-identical run to run. The chunking and the path
//            depend only on (rows, dim, dtype, alignment).
// Residual-fused variants (so the Llama block's residual adds need no launch of their own):
//   add_rmsnorm_forward:   resid += y (in place: the residual stream update h = x + y), then
//                          out = RMSNorm(resid) from the stored (rounded) resid, so the result
//                          is bit-identical to residual_add_inplace followed by rmsnorm_forward.
//                          bf16/f16: resid = T(resid + y) (one rounding, like the add kernel).
//   rmsnorm_backward_add:  dresid += dx (`+=`) instead of dx `=`; dweight as above. bf16/f16:
//                          the f32 dx is added to the widened dresid and rounded once (one
//                          rounding fewer than rmsnorm_backward + residual_add_inplace).
// LayerNorm (layernorm_forward / layernorm_backward), same layout, launch shape and chunking:
//   forward:  one block per row: mean, then the variance of (x - mean) from the row held in
//             registers' reach (two passes over x, no E[x^2] - mean^2 cancellation), then
//             out = T((x - mean) * rstd * w + b), one rounding as PyTorch's f32-accumulating
//             layer_norm kernel; mean and rstd saved (f32 [rows]).
//   backward: per row xhat = (x - mean) * rstd, g = dy * w,
//             dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) written (`=`), rounded once;
//             dweight += sum dy * xhat and dbias += sum dy accumulated (`+=`) through the same
//             deterministic chunk partials (2 * dim of them per chunk) and ordered reduction.

#include <initializer_list>
#include <type_traits>

#include "tilearn_dtype.cuh"
#include "tilearn_kernels.h"

namespace {

constexpr size_t kMaxChunks = 512;          // dweight partials: at most this many rows of scratch
constexpr unsigned kBwdWarps = 4;           // warps per block of the fast backward
// Blocks an SM of the fast backward: bf16 rows of 2048 (8 vectors a lane) with the residual
// gradient fit in 168 registers (ptxas, sm_90a: no spills); at 4 they spill.
constexpr int kBwdBlocksPerSm = 3;
constexpr int kMaxBwdVecs = 8;              // 16-byte vectors per lane of the fast backward
// Widest row whose dweight partial lives in shared memory: 47 KiB of dynamic shared memory, so
// with block_sum's 128 static bytes a block stays under the 48 KiB that needs no opt-in.
constexpr size_t kMaxSharedDweight = 12032;

using tilearn::from_f32;
using tilearn::to_f32;

// Sum over the block in a fixed order (warp butterflies, then the warp sums in warp order).
// blockDim.x must be a multiple of 32. Every thread gets the total.
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

unsigned threads_for(size_t dim) {
    if (dim <= 512) return 64;
    if (dim <= 2048) return 128;
    if (dim <= 8192) return 256;
    return 512;
}

template <typename T>
__global__ void rmsnorm_forward_kernel(const T* __restrict__ x, const T* __restrict__ weight,
                                       size_t dim, float eps, T* __restrict__ out,
                                       float* __restrict__ rstd) {
    const size_t row = blockIdx.x;
    const T* xr = x + row * dim;
    T* outr = out + row * dim;
    float ss = 0.0f;
    for (size_t i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = to_f32(xr[i]);
        ss += v * v;
    }
    ss = block_sum(ss);
    const float r = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
    for (size_t i = threadIdx.x; i < dim; i += blockDim.x) {
        const float normed = to_f32(from_f32<T>(to_f32(xr[i]) * r));
        outr[i] = from_f32<T>(to_f32(weight[i]) * normed);
    }
    if (threadIdx.x == 0) rstd[row] = r;
}

// resid += y, then RMSNorm of the updated resid. Each thread reads back only the elements it
// wrote itself (same index mapping in both loops), so no extra barrier is needed.
template <typename T>
__global__ void add_rmsnorm_forward_kernel(T* __restrict__ resid, const T* __restrict__ y,
                                           const T* __restrict__ weight, size_t dim, float eps,
                                           T* __restrict__ out, float* __restrict__ rstd) {
    const size_t row = blockIdx.x;
    T* hr = resid + row * dim;
    const T* yr = y + row * dim;
    T* outr = out + row * dim;
    float ss = 0.0f;
    for (size_t i = threadIdx.x; i < dim; i += blockDim.x) {
        const T h = from_f32<T>(to_f32(hr[i]) + to_f32(yr[i]));
        hr[i] = h;
        const float v = to_f32(h);
        ss += v * v;
    }
    ss = block_sum(ss);
    const float r = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
    for (size_t i = threadIdx.x; i < dim; i += blockDim.x) {
        const float normed = to_f32(from_f32<T>(to_f32(hr[i]) * r));
        outr[i] = from_f32<T>(to_f32(weight[i]) * normed);
    }
    if (threadIdx.x == 0) rstd[row] = r;
}

// One block per chunk of `rows_per_chunk` rows. dx = rstd * (w*dy - x * rstd^2 * mean(w*dy*x)).
// The chunk's dweight partial lives in shared memory (kSharedAcc) or in its scratch row.
// kAccumulate: dx += (the residual-stream gradient) instead of dx =.
template <typename T, bool kSharedAcc, bool kAccumulate>
__global__ void rmsnorm_backward_kernel(const T* __restrict__ dout, const T* __restrict__ x,
                                        const T* __restrict__ weight,
                                        const float* __restrict__ rstd, size_t rows, size_t dim,
                                        size_t rows_per_chunk, T* __restrict__ dx,
                                        float* __restrict__ partials) {
    extern __shared__ float shared_acc[];
    float* acc = kSharedAcc ? shared_acc : partials + blockIdx.x * dim;
    // Each thread only ever touches its own columns i = threadIdx.x + k * blockDim.x of acc.
    for (size_t i = threadIdx.x; i < dim; i += blockDim.x) acc[i] = 0.0f;
    const size_t begin = blockIdx.x * rows_per_chunk;
    const size_t end = begin + rows_per_chunk < rows ? begin + rows_per_chunk : rows;
    for (size_t row = begin; row < end; ++row) {
        const T* dyr = dout + row * dim;
        const T* xr = x + row * dim;
        T* dxr = dx + row * dim;
        const float r = rstd[row];
        float dot = 0.0f;
        for (size_t i = threadIdx.x; i < dim; i += blockDim.x)
            dot += to_f32(weight[i]) * to_f32(dyr[i]) * to_f32(xr[i]);
        dot = block_sum(dot);
        const float c = dot * r * r / static_cast<float>(dim);
        for (size_t i = threadIdx.x; i < dim; i += blockDim.x) {
            const float dy = to_f32(dyr[i]);
            const float xv = to_f32(xr[i]);
            const float g = r * (to_f32(weight[i]) * dy - xv * c);
            // __fadd_rn is never contracted into an FMA with the product above, so the f32
            // accumulate is bit-identical to writing g and adding it in a separate kernel.
            dxr[i] = from_f32<T>(kAccumulate ? __fadd_rn(to_f32(dxr[i]), g) : g);
            acc[i] += dy * xv * r;
        }
    }
    if (kSharedAcc) {
        float* mine = partials + blockIdx.x * dim;
        for (size_t i = threadIdx.x; i < dim; i += blockDim.x) mine[i] = acc[i];
    }
}

// dweight[j] += sum over chunks c (in order) of partials[c, j].
__global__ void reduce_partials_kernel(const float* __restrict__ partials, size_t chunks,
                                       size_t dim, float* __restrict__ dweight) {
    const size_t j = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (j >= dim) return;
    float s = 0.0f;
    for (size_t c = 0; c < chunks; ++c) s += partials[c * dim + j];
    dweight[j] += s;
}

// Fast backward: one warp per row (see the header). kVecs 16-byte vectors per lane cover the
// row (dim = kVecs * 32 * Vec16<T>::kLen at most; lanes past the end hold nothing). The same
// formulas as rmsnorm_backward_kernel; only the summation order of the dot product and of the
// chunk's dweight partial differ.
// Each lane keeps its columns' dweight sums in the warp's slice of shared memory (float4s in lane
// order, conflict-free; see bwd_acc_index), not in registers: with dy, x and (kAccumulate) the
// residual gradient of the row all loaded at once, registers then allow several blocks an SM,
// and the residual gradient's load no longer waits for the row's dot product.
// Makes the compiler treat v's words as unknown from here on (no instruction): what was
// computed from v before is computed again from v after, instead of kept in registers.
template <typename T>
__device__ __forceinline__ void opaque(tilearn::Vec16<T>& v) {
    uint32_t* w = reinterpret_cast<uint32_t*>(v.v);
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(w[i]));
}

template <typename T, int kVecs>
__host__ __device__ constexpr size_t bwd_acc_floats() {
    return static_cast<size_t>(kVecs) * 32 * tilearn::Vec16<T>::kLen;  // per warp
}

// Where column i * kLen + e (vector i = 32 k + lane of the row, element e) keeps its sum in a
// warp's slice: float4 (k * kLen / 4 + e / 4) * 32 + lane, component e % 4.
template <typename T>
__device__ __forceinline__ size_t bwd_acc_index(size_t i, int e) {
    constexpr int kLen = tilearn::Vec16<T>::kLen;
    const size_t k = i / 32, lane = i % 32;
    return ((k * (kLen / 4) + e / 4) * 32 + lane) * 4 + e % 4;
}

template <typename T, int kVecs, bool kAccumulate>
__global__ void __launch_bounds__(kBwdWarps * 32, kBwdBlocksPerSm)
rmsnorm_backward_warp_kernel(const T* __restrict__ dout, const T* __restrict__ x,
                             const T* __restrict__ weight, const float* __restrict__ rstd,
                             size_t rows, size_t dim, size_t rows_per_chunk, T* __restrict__ dx,
                             float* __restrict__ partials) {
    using V = tilearn::Vec16<T>;
    constexpr int kLen = V::kLen;
    constexpr int kQuads = kLen / 4;  // float4s of sums a vector
    constexpr size_t kSlice = bwd_acc_floats<T, kVecs>();
    extern __shared__ float warp_acc[];  // [kBwdWarps, kSlice]
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const size_t vecs = dim / kLen;
    float4* acc = reinterpret_cast<float4*>(warp_acc + warp * kSlice) + lane;
#pragma unroll
    for (int q = 0; q < kVecs * kQuads; ++q) acc[q * 32] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const size_t begin = blockIdx.x * rows_per_chunk;
    const size_t end = begin + rows_per_chunk < rows ? begin + rows_per_chunk : rows;
    for (size_t row = begin + warp; row < end; row += kBwdWarps) {
        const V* dyr = reinterpret_cast<const V*>(dout + row * dim);
        const V* xr = reinterpret_cast<const V*>(x + row * dim);
        const V* wr = reinterpret_cast<const V*>(weight);
        V* out = reinterpret_cast<V*>(dx + row * dim);
        const float r = rstd[row];
        V dy[kVecs], xv[kVecs], prev[kVecs];
#pragma unroll
        for (int k = 0; k < kVecs; ++k) {
            const size_t i = lane + static_cast<size_t>(k) * 32;
            if (i < vecs) {
                dy[k] = dyr[i];
                xv[k] = xr[i];
                if (kAccumulate) prev[k] = out[i];
            }
        }
        float dot = 0.0f;
#pragma unroll
        for (int k = 0; k < kVecs; ++k) {
            const size_t i = lane + static_cast<size_t>(k) * 32;
            if (i < vecs) {
                const V w = wr[i];
#pragma unroll
                for (int e = 0; e < kLen; ++e)
                    dot += to_f32(w.v[e]) * to_f32(dy[k].v[e]) * to_f32(xv[k].v[e]);
            }
        }
        for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        const float c = dot * r * r / static_cast<float>(dim);
#pragma unroll
        for (int k = 0; k < kVecs; ++k) {
            const size_t i = lane + static_cast<size_t>(k) * 32;
            if (i < vecs) {
                // Widen dy and x again here rather than keep the dot product's f32 copies
                // alive across the shuffles (twice the registers of the 16-bit vectors).
                opaque(dy[k]);
                opaque(xv[k]);
                const V w = wr[i];
                V g;
                float sums[kLen];
#pragma unroll
                for (int q = 0; q < kQuads; ++q) {
                    const float4 a = acc[(k * kQuads + q) * 32];
                    sums[4 * q] = a.x;
                    sums[4 * q + 1] = a.y;
                    sums[4 * q + 2] = a.z;
                    sums[4 * q + 3] = a.w;
                }
#pragma unroll
                for (int e = 0; e < kLen; ++e) {
                    const float d = to_f32(dy[k].v[e]);
                    const float xe = to_f32(xv[k].v[e]);
                    const float ge = r * (to_f32(w.v[e]) * d - xe * c);
                    // As in the scalar kernel: __fadd_rn is never contracted into an FMA.
                    g.v[e] = from_f32<T>(kAccumulate ? __fadd_rn(to_f32(prev[k].v[e]), ge) : ge);
                    sums[e] += d * xe * r;
                }
#pragma unroll
                for (int q = 0; q < kQuads; ++q)
                    acc[(k * kQuads + q) * 32] = make_float4(sums[4 * q], sums[4 * q + 1],
                                                             sums[4 * q + 2], sums[4 * q + 3]);
                out[i] = g;
            }
        }
    }
    // The chunk's partial: the warps' sums added in warp order.
    __syncthreads();
    float* mine = partials + blockIdx.x * dim;
    for (size_t j = threadIdx.x; j < dim; j += blockDim.x) {
        const size_t at = bwd_acc_index<T>(j / kLen, static_cast<int>(j % kLen));
        float sum = warp_acc[at];
        for (unsigned w = 1; w < kBwdWarps; ++w) sum += warp_acc[w * kSlice + at];
        mine[j] = sum;
    }
}

// dweight[j] += the sum of partials[c, j] over the chunks: thread (tx, ty) of a 32 x 32 block
// sums the chunks c = ty, ty + 32, ... of column j = block * 32 + tx in order, then thread
// (tx, 0) adds the 32 group sums in group order (coalesced: a warp reads 32 adjacent columns).
__global__ void reduce_partials_wide_kernel(const float* __restrict__ partials, size_t chunks,
                                            size_t dim, float* __restrict__ dweight) {
    __shared__ float group[32][33];
    const size_t j = static_cast<size_t>(blockIdx.x) * 32 + threadIdx.x;
    float s = 0.0f;
    if (j < dim)
        for (size_t c = threadIdx.y; c < chunks; c += 32) s += partials[c * dim + j];
    group[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && j < dim) {
        float total = 0.0f;
        for (int g = 0; g < 32; ++g) total += group[g][threadIdx.x];
        dweight[j] += total;
    }
}

// Fast forwards (the backward's conditions: 16-byte aligned, whole vectors, <= kMaxBwdVecs per
// lane): one warp per row, the row held in registers, the sum of squares a warp shuffle.
// kAdd: resid += y first (the stored, rounded sum is what is normalised, as in the block
// kernels). Both forwards share this code, so the fused and the plain forward give the same
// bits on the same residual (the gradient-checkpointing recompute relies on it).
template <typename T, int kVecs, bool kAdd>
__global__ void __launch_bounds__(kBwdWarps * 32)
rmsnorm_forward_warp_kernel(T* __restrict__ x, const T* __restrict__ y,
                            const T* __restrict__ weight, size_t rows, size_t dim, float eps,
                            T* __restrict__ out, float* __restrict__ rstd) {
    using V = tilearn::Vec16<T>;
    constexpr int kLen = V::kLen;
    const size_t row = static_cast<size_t>(blockIdx.x) * kBwdWarps + threadIdx.x / 32;
    if (row >= rows) return;
    const unsigned lane = threadIdx.x % 32;
    const size_t vecs = dim / kLen;
    V* xr = reinterpret_cast<V*>(x + row * dim);
    V h[kVecs];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
        const size_t i = lane + static_cast<size_t>(k) * 32;
        if (i < vecs) {
            h[k] = xr[i];
            if (kAdd) {
                const V yv = reinterpret_cast<const V*>(y + row * dim)[i];
#pragma unroll
                for (int e = 0; e < kLen; ++e)
                    h[k].v[e] = from_f32<T>(to_f32(h[k].v[e]) + to_f32(yv.v[e]));
                xr[i] = h[k];
            }
#pragma unroll
            for (int e = 0; e < kLen; ++e) {
                const float v = to_f32(h[k].v[e]);
                ss += v * v;
            }
        }
    }
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float r = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
        const size_t i = lane + static_cast<size_t>(k) * 32;
        if (i < vecs) {
            const V w = reinterpret_cast<const V*>(weight)[i];
            V o;
#pragma unroll
            for (int e = 0; e < kLen; ++e) {
                const float normed = to_f32(from_f32<T>(to_f32(h[k].v[e]) * r));
                o.v[e] = from_f32<T>(to_f32(w.v[e]) * normed);
            }
            reinterpret_cast<V*>(out + row * dim)[i] = o;
        }
    }
    if (lane == 0) rstd[row] = r;
}

// Vectors per lane of the warp-per-row kernels for rows of `dim` elements of T at these
// addresses, or 0 when they do not apply (the block kernels run).
template <typename T>
int warp_row_vecs(size_t dim, std::initializer_list<const void*> ptrs) {
    constexpr size_t kLen = tilearn::Vec16<T>::kLen;
    if (dim == 0 || dim % kLen != 0) return 0;
    for (const void* p : ptrs)
        if (!tilearn::aligned16(p)) return 0;
    const size_t per_lane = (dim / kLen + 31) / 32;
    for (int v = 1; v <= kMaxBwdVecs; v *= 2)
        if (per_lane <= static_cast<size_t>(v)) return v;
    return 0;
}

// Calls f(std::integral_constant<int, V>) for V = vecs in {1, 2, 4, 8} (from warp_row_vecs), so a
// launcher instantiates its warp kernel for the vector count at hand.
template <typename F>
void with_vecs(int vecs, F&& f) {
    switch (vecs) {
        case 1: f(std::integral_constant<int, 1>{}); break;
        case 2: f(std::integral_constant<int, 2>{}); break;
        case 4: f(std::integral_constant<int, 4>{}); break;
        default: f(std::integral_constant<int, 8>{}); break;
    }
}

unsigned warp_row_blocks(size_t rows) {
    return static_cast<unsigned>((rows + kBwdWarps - 1) / kBwdWarps);
}

template <typename T>
__global__ void layernorm_forward_kernel(const T* __restrict__ x, const T* __restrict__ weight,
                                         const T* __restrict__ bias, size_t dim, float eps,
                                         T* __restrict__ out, float* __restrict__ mean,
                                         float* __restrict__ rstd) {
    const size_t row = blockIdx.x;
    const T* xr = x + row * dim;
    T* outr = out + row * dim;
    const float inv_dim = 1.0f / static_cast<float>(dim);
    float s = 0.0f;
    for (size_t i = threadIdx.x; i < dim; i += blockDim.x) s += to_f32(xr[i]);
    const float mu = block_sum(s) * inv_dim;
    float ss = 0.0f;
    for (size_t i = threadIdx.x; i < dim; i += blockDim.x) {
        const float d = to_f32(xr[i]) - mu;
        ss += d * d;
    }
    const float r = rsqrtf(block_sum(ss) * inv_dim + eps);
    for (size_t i = threadIdx.x; i < dim; i += blockDim.x)
        outr[i] = from_f32<T>((to_f32(xr[i]) - mu) * r * to_f32(weight[i]) + to_f32(bias[i]));
    if (threadIdx.x == 0) {
        mean[row] = mu;
        rstd[row] = r;
    }
}

// One block per chunk of rows, as rmsnorm_backward_kernel; the chunk's dweight and dbias
// partials live in shared memory (kSharedAcc: [2, dim]) or in its two scratch rows
// (partials[blockIdx.x] and partials[gridDim.x + blockIdx.x]).
template <typename T, bool kSharedAcc>
__global__ void layernorm_backward_kernel(const T* __restrict__ dout, const T* __restrict__ x,
                                          const T* __restrict__ weight,
                                          const float* __restrict__ mean,
                                          const float* __restrict__ rstd, size_t rows,
                                          size_t dim, size_t rows_per_chunk, T* __restrict__ dx,
                                          float* __restrict__ partials) {
    extern __shared__ float shared_acc[];
    float* acc_w = kSharedAcc ? shared_acc : partials + blockIdx.x * dim;
    float* acc_b = kSharedAcc ? shared_acc + dim : partials + (gridDim.x + blockIdx.x) * dim;
    for (size_t i = threadIdx.x; i < dim; i += blockDim.x) acc_w[i] = acc_b[i] = 0.0f;
    const float inv_dim = 1.0f / static_cast<float>(dim);
    const size_t begin = blockIdx.x * rows_per_chunk;
    const size_t end = begin + rows_per_chunk < rows ? begin + rows_per_chunk : rows;
    for (size_t row = begin; row < end; ++row) {
        const T* dyr = dout + row * dim;
        const T* xr = x + row * dim;
        T* dxr = dx + row * dim;
        const float mu = mean[row];
        const float r = rstd[row];
        float sg = 0.0f, sgx = 0.0f;
        for (size_t i = threadIdx.x; i < dim; i += blockDim.x) {
            const float g = to_f32(dyr[i]) * to_f32(weight[i]);
            sg += g;
            sgx += g * (to_f32(xr[i]) - mu) * r;
        }
        const float mean_g = block_sum(sg) * inv_dim;
        const float mean_gx = block_sum(sgx) * inv_dim;
        for (size_t i = threadIdx.x; i < dim; i += blockDim.x) {
            const float dy = to_f32(dyr[i]);
            const float xhat = (to_f32(xr[i]) - mu) * r;
            dxr[i] = from_f32<T>(r * (dy * to_f32(weight[i]) - mean_g - xhat * mean_gx));
            acc_w[i] += dy * xhat;
            acc_b[i] += dy;
        }
    }
    if (kSharedAcc) {
        float* mine_w = partials + blockIdx.x * dim;
        float* mine_b = partials + (gridDim.x + blockIdx.x) * dim;
        for (size_t i = threadIdx.x; i < dim; i += blockDim.x) {
            mine_w[i] = acc_w[i];
            mine_b[i] = acc_b[i];
        }
    }
}

size_t rows_per_chunk(size_t rows) { return (rows + kMaxChunks - 1) / kMaxChunks; }

size_t chunk_count(size_t rows) {
    if (rows == 0) return 0;
    const size_t per = rows_per_chunk(rows);
    return (rows + per - 1) / per;
}

bool shape_ok(size_t rows, size_t dim) {
    return rows <= 0x7fffffffu && (dim == 0 || rows <= SIZE_MAX / dim);
}

template <typename T>
int launch_forward(const void* x, const void* weight, size_t rows, size_t dim, float eps,
                   void* out, float* rstd, cudaStream_t stream) {
    if (!shape_ok(rows, dim) || !(eps >= 0.0f) || eps == INFINITY)
        return static_cast<int>(cudaErrorInvalidValue);
    if (rows == 0) return static_cast<int>(cudaSuccess);
    if (dim == 0 || x == nullptr || weight == nullptr || out == nullptr || rstd == nullptr)
        return static_cast<int>(cudaErrorInvalidValue);
    const int vecs = warp_row_vecs<T>(dim, {x, weight, out});
    if (vecs > 0) {
        // The warp kernel's x is writable for the fused add; here it is only read (kAdd false).
        T* xs = const_cast<T*>(static_cast<const T*>(x));
        with_vecs(vecs, [&](auto k) {
            rmsnorm_forward_warp_kernel<T, decltype(k)::value, false>
                <<<warp_row_blocks(rows), kBwdWarps * 32, 0, stream>>>(
                    xs, nullptr, static_cast<const T*>(weight), rows, dim, eps,
                    static_cast<T*>(out), rstd);
        });
        return static_cast<int>(cudaGetLastError());
    }
    rmsnorm_forward_kernel<T><<<static_cast<unsigned>(rows), threads_for(dim), 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(weight), dim, eps, static_cast<T*>(out),
        rstd);
    return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch_add_forward(void* resid, const void* y, const void* weight, size_t rows, size_t dim,
                       float eps, void* out, float* rstd, cudaStream_t stream) {
    if (!shape_ok(rows, dim) || !(eps >= 0.0f) || eps == INFINITY)
        return static_cast<int>(cudaErrorInvalidValue);
    if (rows == 0) return static_cast<int>(cudaSuccess);
    if (dim == 0 || resid == nullptr || y == nullptr || weight == nullptr || out == nullptr ||
        rstd == nullptr)
        return static_cast<int>(cudaErrorInvalidValue);
    const int vecs = warp_row_vecs<T>(dim, {resid, y, weight, out});
    if (vecs > 0) {
        with_vecs(vecs, [&](auto k) {
            rmsnorm_forward_warp_kernel<T, decltype(k)::value, true>
                <<<warp_row_blocks(rows), kBwdWarps * 32, 0, stream>>>(
                    static_cast<T*>(resid), static_cast<const T*>(y),
                    static_cast<const T*>(weight), rows, dim, eps, static_cast<T*>(out), rstd);
        });
        return static_cast<int>(cudaGetLastError());
    }
    add_rmsnorm_forward_kernel<T><<<static_cast<unsigned>(rows), threads_for(dim), 0, stream>>>(
        static_cast<T*>(resid), static_cast<const T*>(y), static_cast<const T*>(weight), dim, eps,
        static_cast<T*>(out), rstd);
    return static_cast<int>(cudaGetLastError());
}

template <typename T, bool kAccumulate>
int launch_backward(const void* dout, const void* x, const void* weight, const float* rstd,
                    size_t rows, size_t dim, void* dx, float* dweight, float* scratch,
                    size_t scratch_len, cudaStream_t stream) {
    if (!shape_ok(rows, dim)) return static_cast<int>(cudaErrorInvalidValue);
    if (rows == 0) return static_cast<int>(cudaSuccess);
    if (dim == 0 || dout == nullptr || x == nullptr || weight == nullptr || rstd == nullptr ||
        dx == nullptr || dweight == nullptr || scratch == nullptr ||
        scratch_len < tilearn_rmsnorm_backward_scratch_len(rows, dim))
        return static_cast<int>(cudaErrorInvalidValue);
    const size_t chunks = chunk_count(rows);
    const unsigned threads = threads_for(dim);
    const T* dy = static_cast<const T*>(dout);
    const T* xs = static_cast<const T*>(x);
    const T* w = static_cast<const T*>(weight);
    T* dxs = static_cast<T*>(dx);
    const int vecs = warp_row_vecs<T>(dim, {dout, x, weight, dx});
    if (vecs > 0) {
        const size_t per = rows_per_chunk(rows);
        with_vecs(vecs, [&](auto k) {
            // <= 32 KiB: kBwdWarps x 8 vectors x 32 lanes x 16 bytes' worth of f32 sums.
            const size_t smem = kBwdWarps * bwd_acc_floats<T, decltype(k)::value>() * sizeof(float);
            rmsnorm_backward_warp_kernel<T, decltype(k)::value, kAccumulate>
                <<<static_cast<unsigned>(chunks), kBwdWarps * 32, smem, stream>>>(
                    dy, xs, w, rstd, rows, dim, per, dxs, scratch);
        });
        const cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess) return static_cast<int>(err);
        reduce_partials_wide_kernel<<<static_cast<unsigned>((dim + 31) / 32), dim3(32, 32), 0,
                                      stream>>>(scratch, chunks, dim, dweight);
        return static_cast<int>(cudaGetLastError());
    }
    if (dim <= kMaxSharedDweight) {
        rmsnorm_backward_kernel<T, true, kAccumulate>
            <<<static_cast<unsigned>(chunks), threads, dim * sizeof(float), stream>>>(
                dy, xs, w, rstd, rows, dim, rows_per_chunk(rows), dxs, scratch);
    } else {
        rmsnorm_backward_kernel<T, false, kAccumulate>
            <<<static_cast<unsigned>(chunks), threads, 0, stream>>>(
                dy, xs, w, rstd, rows, dim, rows_per_chunk(rows), dxs, scratch);
    }
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return static_cast<int>(err);
    const unsigned reduce_threads = 256;
    const size_t reduce_blocks = (dim + reduce_threads - 1) / reduce_threads;
    reduce_partials_kernel<<<static_cast<unsigned>(reduce_blocks), reduce_threads, 0, stream>>>(
        scratch, chunks, dim, dweight);
    return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch_layernorm_forward(const void* x, const void* weight, const void* bias, size_t rows,
                             size_t dim, float eps, void* out, float* mean, float* rstd,
                             cudaStream_t stream) {
    if (!shape_ok(rows, dim) || !(eps >= 0.0f) || eps == INFINITY)
        return static_cast<int>(cudaErrorInvalidValue);
    if (rows == 0) return static_cast<int>(cudaSuccess);
    if (dim == 0 || x == nullptr || weight == nullptr || bias == nullptr || out == nullptr ||
        mean == nullptr || rstd == nullptr)
        return static_cast<int>(cudaErrorInvalidValue);
    layernorm_forward_kernel<T><<<static_cast<unsigned>(rows), threads_for(dim), 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(weight), static_cast<const T*>(bias), dim,
        eps, static_cast<T*>(out), mean, rstd);
    return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch_layernorm_backward(const void* dout, const void* x, const void* weight,
                              const float* mean, const float* rstd, size_t rows, size_t dim,
                              void* dx, float* dweight, float* dbias, float* scratch,
                              size_t scratch_len, cudaStream_t stream) {
    if (!shape_ok(rows, dim)) return static_cast<int>(cudaErrorInvalidValue);
    if (rows == 0) return static_cast<int>(cudaSuccess);
    if (dim == 0 || dout == nullptr || x == nullptr || weight == nullptr || mean == nullptr ||
        rstd == nullptr || dx == nullptr || dweight == nullptr || dbias == nullptr ||
        scratch == nullptr || scratch_len < tilearn_layernorm_backward_scratch_len(rows, dim))
        return static_cast<int>(cudaErrorInvalidValue);
    const size_t chunks = chunk_count(rows);
    const unsigned threads = threads_for(dim);
    const T* dy = static_cast<const T*>(dout);
    const T* xs = static_cast<const T*>(x);
    const T* w = static_cast<const T*>(weight);
    T* dxs = static_cast<T*>(dx);
    if (2 * dim <= kMaxSharedDweight) {
        layernorm_backward_kernel<T, true>
            <<<static_cast<unsigned>(chunks), threads, 2 * dim * sizeof(float), stream>>>(
                dy, xs, w, mean, rstd, rows, dim, rows_per_chunk(rows), dxs, scratch);
    } else {
        layernorm_backward_kernel<T, false><<<static_cast<unsigned>(chunks), threads, 0, stream>>>(
            dy, xs, w, mean, rstd, rows, dim, rows_per_chunk(rows), dxs, scratch);
    }
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return static_cast<int>(err);
    const unsigned reduce_threads = 256;
    const size_t reduce_blocks = (dim + reduce_threads - 1) / reduce_threads;
    reduce_partials_kernel<<<static_cast<unsigned>(reduce_blocks), reduce_threads, 0, stream>>>(
        scratch, chunks, dim, dweight);
    err = cudaGetLastError();
    if (err != cudaSuccess) return static_cast<int>(err);
    reduce_partials_kernel<<<static_cast<unsigned>(reduce_blocks), reduce_threads, 0, stream>>>(
        scratch + chunks * dim, chunks, dim, dbias);
    return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" size_t tilearn_rmsnorm_backward_scratch_len(size_t rows, size_t dim) {
    if (!shape_ok(rows, dim)) return SIZE_MAX;
    return chunk_count(rows) * dim;
}

extern "C" size_t tilearn_rmsnorm_backward_scratch_len_max(size_t max_rows, size_t dim) {
    if (!shape_ok(max_rows, dim)) return SIZE_MAX;
    // chunk_count(rows) <= min(rows, kMaxChunks) for every rows, though it is not monotone in
    // rows (513 rows make 257 chunks, 512 rows 512), so the bound is not the max_rows length.
    const size_t chunks = max_rows < kMaxChunks ? max_rows : kMaxChunks;
    return chunks * dim;
}

extern "C" int tilearn_rmsnorm_forward(int dtype, const void* x, const void* weight, size_t rows,
                                       size_t dim, float eps, void* out, float* rstd,
                                       cudaStream_t stream) {
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch_forward<decltype(tag)>(x, weight, rows, dim, eps, out, rstd, stream);
    });
}

extern "C" int tilearn_rmsnorm_backward(int dtype, const void* dout, const void* x,
                                        const void* weight, const float* rstd, size_t rows,
                                        size_t dim, void* dx, float* dweight, float* scratch,
                                        size_t scratch_len, cudaStream_t stream) {
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch_backward<decltype(tag), false>(dout, x, weight, rstd, rows, dim, dx,
                                                     dweight, scratch, scratch_len, stream);
    });
}

extern "C" int tilearn_add_rmsnorm_forward(int dtype, void* resid, const void* y,
                                           const void* weight, size_t rows, size_t dim, float eps,
                                           void* out, float* rstd, cudaStream_t stream) {
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch_add_forward<decltype(tag)>(resid, y, weight, rows, dim, eps, out, rstd,
                                                 stream);
    });
}

extern "C" int tilearn_rmsnorm_backward_add(int dtype, const void* dout, const void* x,
                                            const void* weight, const float* rstd, size_t rows,
                                            size_t dim, void* dresid, float* dweight,
                                            float* scratch, size_t scratch_len,
                                            cudaStream_t stream) {
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch_backward<decltype(tag), true>(dout, x, weight, rstd, rows, dim, dresid,
                                                    dweight, scratch, scratch_len, stream);
    });
}

extern "C" size_t tilearn_layernorm_backward_scratch_len(size_t rows, size_t dim) {
    const size_t one = tilearn_rmsnorm_backward_scratch_len(rows, dim);
    return one > SIZE_MAX / 2 ? SIZE_MAX : 2 * one;
}

extern "C" size_t tilearn_layernorm_backward_scratch_len_max(size_t max_rows, size_t dim) {
    const size_t one = tilearn_rmsnorm_backward_scratch_len_max(max_rows, dim);
    return one > SIZE_MAX / 2 ? SIZE_MAX : 2 * one;
}

extern "C" int tilearn_layernorm_forward(int dtype, const void* x, const void* weight,
                                         const void* bias, size_t rows, size_t dim, float eps,
                                         void* out, float* mean, float* rstd,
                                         cudaStream_t stream) {
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch_layernorm_forward<decltype(tag)>(x, weight, bias, rows, dim, eps, out, mean,
                                                       rstd, stream);
    });
}

extern "C" int tilearn_layernorm_backward(int dtype, const void* dout, const void* x,
                                          const void* weight, const float* mean,
                                          const float* rstd, size_t rows, size_t dim, void* dx,
                                          float* dweight, float* dbias, float* scratch,
                                          size_t scratch_len, cudaStream_t stream) {
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch_layernorm_backward<decltype(tag)>(dout, x, weight, mean, rstd, rows, dim,
                                                        dx, dweight, dbias, scratch, scratch_len,
                                                        stream);
    });
}
