// flash_common.cuh: what the FlashAttention kernels of flash_attention.cu (mma.sync, sm_80 and
// later) and flash_attention_sm90.cu (wgmma, sm_90a) share: the cp.async wrappers, the
// swizzled shared-memory tile and its loader, the launch arguments, and how a CTA finds its
// query block and double-buffers its key/value tiles.
//
// Tiles are [rows][D] of a 16-bit type in shared memory with 16-byte chunks XOR-swizzled by row
// (chunk c of row r at c ^ (r & 7)). For D = 64 a row is 128 bytes and that is exactly the
// 128-byte swizzle that wgmma's shared-memory descriptors read (given a 1024-byte aligned tile).
#ifndef TILEARN_FLASH_COMMON_CUH
#define TILEARN_FLASH_COMMON_CUH

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "tilearn_dtype.cuh"

namespace tilearn::flash {

constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFullMask = 0xffffffffu;

// ---- PTX wrappers ----

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronously; zero-filled when !valid (src is then not read).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n)
                 : "memory");
}

// 4 bytes global -> shared, asynchronously; zero-filled when !valid.
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool valid) {
    const int n = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(n)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Two f32 rounded (to nearest even) into one register, `lo` in the low half.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "16-bit types");
    uint32_t u;
    if constexpr (std::is_same_v<T, __half>) {
        const __half2 v = __floats2half2_rn(lo, hi);
        memcpy(&u, &v, sizeof(u));
    } else {
        const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        memcpy(&u, &v, sizeof(u));
    }
    return u;
}

// 2^x (ex2.approx: relative error ~2^-22; 2^-inf = 0; results below 2^-126 flush to 0).
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// ---- shared-memory tiles: [rows][D] of T, 16-byte chunks swizzled by row ----

// Element offset of chunk `c` (8 elements) of row `r`.
template <int D>
__device__ __forceinline__ int swz(int r, int c) {
    return r * D + ((c ^ (r & 7)) << 3);
}

// Rows [row0, row0 + ROWS) of a [seq, stride] matrix whose row 0 starts at `g` into the tile
// `s`; rows at or past `seq` are zero-filled.
template <typename T, int ROWS, int D, int THREADS>
__device__ __forceinline__ void load_tile(T* s, const T* g, size_t stride, int row0, int seq,
                                          int tid) {
    constexpr int kChunks = D / 8;
    static_assert((ROWS * kChunks) % THREADS == 0, "tile chunks must divide among the threads");
#pragma unroll
    for (int i = 0; i < ROWS * kChunks / THREADS; ++i) {
        const int idx = tid + i * THREADS;
        const int r = idx / kChunks;
        const int c = idx % kChunks;
        const int t = row0 + r;
        const bool valid = t < seq;
        const T* src = g + static_cast<size_t>(valid ? t : 0) * stride + c * 8;
        cp_async16(smem_addr(s + swz<D>(r, c)), src, valid);
    }
}

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, 1));
    return fmaxf(v, __shfl_xor_sync(kFullMask, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(kFullMask, v, 1);
    return v + __shfl_xor_sync(kFullMask, v, 2);
}

// Sets every element of an f32 array (any shape) to `v`.
__device__ __forceinline__ void fill(float& x, float v) { x = v; }

template <typename X, int N>
__device__ __forceinline__ void fill(X (&x)[N], float v) {
#pragma unroll
    for (int i = 0; i < N; ++i) fill(x[i], v);
}

// ---- the CTA's work ----

// The launch arguments of all three kernels (each reads the fields it needs).
struct Args {
    const void* q;
    const void* k;
    const void* v;
    void* o_or_dq;         // forward: out; backward: dq
    float* lse_out;        // forward
    const void* dout;      // backward
    const float* lse_in;   // backward
    const float* delta;    // backward
    void* dk;              // backward
    void* dv;              // backward
    const int* positions;  // [batch, seq] restarting position ids, or null (one sequence a row)
    int window;            // sliding window in keys, 0 for none
    const float* alibi;    // [q_heads] ALiBi slopes, or null (no bias)
    float* dq_accum;       // backward: f32 dQ sums of the one-pass Hopper backward, or null
    int batch;
    int seq;
    int q_heads;
    int kv_heads;
    float scale;
};

// The first key that query i (clamped to the last row) of batch row b sees: see the header.
__device__ __forceinline__ int key_start(const Args& a, int b, int i) {
    i = min(i, a.seq - 1);
    int lo = 0;
    if (a.positions != nullptr) lo = i - a.positions[static_cast<size_t>(b) * a.seq + i];
    if (a.window > 0) lo = max(lo, i + 1 - a.window);
    return min(max(lo, 0), i);
}

// The thread's index, warp and lane, and its place in the mma fragments: row g = lane / 4 and
// column pair tq = lane % 4.
struct ThreadIds {
    int tid, warp, lane, g, tq;
};

__device__ __forceinline__ ThreadIds thread_ids() {
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    return {tid, tid >> 5, lane, lane >> 2, lane & 3};
}

// What a forward or dQ CTA works on: one (query block, batch b, query head h), the heaviest
// query blocks (the last ones: most keys) scheduled first.
template <typename T>
struct QueryBlock {
    int q0;            // the block's first query
    int nkb;           // key blocks up to the diagonal (causal: none past the block's last query)
    size_t q_stride;   // elements from one token to the next in q / out / dout / dq
    size_t kv_stride;  // the same in k / v
    size_t q_base;     // (b, token 0, h) in q / out / dout / dq
    const T* k;        // (b, token 0, h's kv head) of k
    const T* v;        // the same of v
    int b, h;          // batch entry and query head: rows (b, h, token) of lse / delta
};

template <typename T, int D, int BR, int BC>
__device__ __forceinline__ QueryBlock<T> query_block(const Args& a) {
    const int seq = a.seq;
    const int heads_total = a.batch * a.q_heads;
    const int nqb = (seq + BR - 1) / BR;
    const int qb = nqb - 1 - static_cast<int>(blockIdx.x / static_cast<unsigned>(heads_total));
    const int bh = static_cast<int>(blockIdx.x % static_cast<unsigned>(heads_total));
    const int b = bh / a.q_heads;
    const int h = bh % a.q_heads;
    const int hk = h / (a.q_heads / a.kv_heads);
    const int q0 = qb * BR;
    const int kv_end = min(seq, q0 + BR);
    const size_t kv_base = (static_cast<size_t>(b) * seq * a.kv_heads + hk) * D;
    return {q0,
            (kv_end + BC - 1) / BC,
            static_cast<size_t>(a.q_heads) * D,
            static_cast<size_t>(a.kv_heads) * D,
            (static_cast<size_t>(b) * seq * a.q_heads + h) * D,
            static_cast<const T*>(a.k) + kv_base,
            static_cast<const T*>(a.v) + kv_base,
            b, h};
}

// Commits this thread's loads of the next stage, then waits for the current stage's and syncs.
__device__ __forceinline__ void cp_async_next_stage() {
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
}

// K and V rows [row0, row0 + BC) into the tiles sK and sV.
template <typename T, int BC, int D, int THREADS>
__device__ __forceinline__ void load_kv(T* sK, T* sV, const T* kg, const T* vg, size_t stride,
                                        int row0, int seq, int tid) {
    load_tile<T, BC, D, THREADS>(sK, kg, stride, row0, seq, tid);
    load_tile<T, BC, D, THREADS>(sV, vg, stride, row0, seq, tid);
}

// The K and V tiles of one key block in shared memory.
template <typename T>
struct KvTiles {
    const T* k;
    const T* v;
};

// Key block kb of a loop over nkb whose K and V tiles are double-buffered in sK and sV (two
// BC x D tiles each; block 0 loaded and committed before the loop): starts loading block kb + 1
// into the other buffers, waits for block kb and returns its tiles.
template <typename T, int BC, int D, int THREADS>
__device__ __forceinline__ KvTiles<T> next_kv_block(T* sK, T* sV, const T* kg, const T* vg,
                                                    size_t stride, int kb, int nkb, int seq,
                                                    int tid) {
    if (kb + 1 < nkb) {
        const int nb = (kb + 1) & 1;
        load_kv<T, BC, D, THREADS>(sK + nb * BC * D, sV + nb * BC * D, kg, vg, stride,
                                   (kb + 1) * BC, seq, tid);
    }
    cp_async_next_stage();
    return {sK + (kb & 1) * BC * D, sV + (kb & 1) * BC * D};
}

}  // namespace tilearn::flash

#endif  // TILEARN_FLASH_COMMON_CUH
