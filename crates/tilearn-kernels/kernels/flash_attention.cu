// flash_attention.cu: fused causal grouped-query attention (FlashAttention-2 style), forward and
// backward, for bf16 and f16 on tensor cores (mma.sync m16n8k16, sm_80 and later). Used by
// crates/tilearn-ops/src/cuda/attention.rs in place of the cuBLASLt path where it applies (16-bit
// types, head_dim 64 or 128, 16-byte aligned tensors); f32 keeps that exact path.
//
// Fused:     forward: one CTA per (query block, batch, query head) loads its Q tile once, walks
//            the key blocks up to the diagonal (blocks above it are never loaded or scored),
//            computes S = Q·Kᵀ, the causal mask, an online softmax (running row max and sum) and
//            O += P·V in registers, and writes O and lse once; S and P never leave the chip.
//            Backward, two kernels, both recomputing P = exp(scale·S − lse) from the forward's
//            lse: dkdv: one CTA per (key block, batch, kv head) walks the GQA group's query heads
//            and, per head, the query blocks from the diagonal on, accumulating
//            dV += Pᵀ·dO and dK += dSᵀ·Q in registers (dP = dO·Vᵀ, dS = P ∘ (dP − delta) ·
//            scale), and writes dK, dV once; dq: one CTA per (query block, batch, query head)
//            walks the key blocks up to the diagonal and accumulates dQ += dS·K. delta =
//            rowsum(dO ∘ O) comes from attention.cu's delta kernel.
//            Key mask (optional, the MASK instantiations): per query i a first visible key
//            lo(i) = max(i − position_ids[b, i], i + 1 − sliding_window), clamped to [0, i]:
//            packed examples (positions restart at 0 per example) and Mistral's sliding
//            window; scores of keys j < lo(i) are masked like those above the diagonal. lo
//            never decreases along a row (positions are a restart sequence), so the forward
//            and dQ start at key block lo(q0) / BC and dK/dV stop at the last query block
//            that sees the CTA's keys: key tiles no row of a tile sees are never loaded. The
//            unmasked instantiations are the plain causal kernels, unchanged.
//            ALiBi (optional, the ALIBI instantiations, always built with MASK): head h adds
//            slope[h] · (j − i) to the scaled score of query i and key j (Bloom, Baichuan-13B;
//            see crates/tilearn-ops/src/alibi.rs), folded into the raw score as
//            (slope / scale) · (j − i) by one fma per score right after S = Q·Kᵀ, in the
//            forward and in both backward kernels' recomputation of P; dS needs nothing more
//            (the bias is a constant of the scores). lse is that of the biased scores.
// Layout:    q / out / dout / dq [batch, seq, q_heads, head_dim], k / v / dk / dv [batch, seq,
//            kv_heads, head_dim] (the projections' layout: no permutes), lse / delta f32
//            [batch, q_heads, seq], position_ids int32 [batch, seq] (or null), ALiBi slopes f32
//            [q_heads] (or null); query head h reads kv head h / (q_heads / kv_heads). Every
//            tensor of the element type starts on a 16-byte boundary (cp.async of 16 bytes).
//            Tiles live in shared memory with 16-byte chunks XOR-swizzled by row (chunk c of row
//            r at c ^ (r & 7)), so ldmatrix and cp.async are free of bank conflicts.
// Precision: bf16 / f16 operands, every product accumulated in f32 on the tensor cores; scores,
//            the softmax (max, sum, exponentials through ex2.approx, relative error ~2^-22),
//            lse, dP and delta in f32. P (forward: for P·V; backward: for Pᵀ·dO) and dS are
//            rounded once to the element type as the A operand of their product, as
//            FlashAttention does (P lies in [0, 1], which f16 holds); out, dq, dk, dv rounded
//            once to the element type; lse = scale·max + log(sum) in f32 (logf).
// Gradients: dq, dk, dv are written (`=`), every element of rows < seq; there are no parameters.
// Determinism: no atomics; every CTA owns its output rows and sums in a fixed order (key blocks
//            ascending; for dK / dV the group's query heads, then query blocks, ascending), so
//            results are bit-identical from run to run.

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "flash_common.cuh"
#include "flash_sm90.h"
#include "tilearn_dtype.cuh"
#include "tilearn_kernels.h"

namespace {

using namespace tilearn::flash;

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, and register i
// receives matrix i (lane l: row l / 4, elements 2 (l % 4) and 2 (l % 4) + 1).
__device__ __forceinline__ void ldsm4(uint32_t addr, uint32_t (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// The same, each matrix transposed (lane l: column l / 4, rows 2 (l % 4) and 2 (l % 4) + 1).
__device__ __forceinline__ void ldsm4_t(uint32_t addr, uint32_t (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// c (16x8 f32) += a (16x16, row-major) · b (16x8, column-major). Fragments (g = lane / 4,
// t = lane % 4): a {(g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..)}; b {(k 2t..2t+1,
// n g), (k 2t+8.., n g)}; c {(g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)}.
template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1);

template <>
__device__ __forceinline__ void mma<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4],
                                                   uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                            uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The A fragment of a 16x16 block whose two 16x8 halves are the accumulators c0 (columns 0-7)
// and c1 (columns 8-15), rounded to T.
template <typename T>
__device__ __forceinline__ void to_a_frag(const float (&c0)[4], const float (&c1)[4],
                                          uint32_t (&a)[4]) {
    a[0] = pack2<T>(c0[0], c0[1]);
    a[1] = pack2<T>(c0[2], c0[3]);
    a[2] = pack2<T>(c1[0], c1[1]);
    a[3] = pack2<T>(c1[2], c1[3]);
}

// ---- shared-memory tiles: see flash_common.cuh (swz, load_tile) ----

// A fragment (16x16) at rows [r0, r0 + 16), columns [16 kk, 16 kk + 16) of a tile.
template <typename T, int D>
__device__ __forceinline__ void load_a(const T* s, int r0, int kk, int lane, uint32_t (&a)[4]) {
    ldsm4(smem_addr(s + swz<D>(r0 + (lane & 15), 2 * kk + (lane >> 4))), a);
}

// B fragments of two n-tiles for a product with the tile's transpose (tile rows = n, columns =
// k: K in Q·Kᵀ): n rows [n0, n0 + 16), k columns [16 kk, 16 kk + 16). b[0], b[1]: n-tile n0;
// b[2], b[3]: n-tile n0 + 8.
template <typename T, int D>
__device__ __forceinline__ void load_b_nk(const T* s, int n0, int kk, int lane,
                                          uint32_t (&b)[4]) {
    const int mi = lane >> 3;
    ldsm4(smem_addr(s + swz<D>(n0 + ((mi >> 1) << 3) + (lane & 7), 2 * kk + (mi & 1))), b);
}

// B fragments of two n-tiles for a product with the tile itself (tile rows = k, columns = n:
// V in P·V): k rows [k0, k0 + 16), n columns [16 np, 16 np + 16). b[0], b[1]: n-tile 16 np;
// b[2], b[3]: n-tile 16 np + 8.
template <typename T, int D>
__device__ __forceinline__ void load_b_kn(const T* s, int k0, int np, int lane,
                                          uint32_t (&b)[4]) {
    const int mi = lane >> 3;
    ldsm4_t(smem_addr(s + swz<D>(k0 + ((mi & 1) << 3) + (lane & 7), 2 * np + (mi >> 1))), b);
}

// ---- warp-level products over one or several m-tiles ----
// A warp's per-m-tile data (accumulators float[n][4] of a 16 x 8n block, A fragments
// uint32_t[4]) stands alone for one m-tile or with a leading m-tile dimension; RANK is the rank
// of one m-tile's data, kMTiles the count and m_tile the m-tile `mt` of either form.
template <int RANK, typename X>
constexpr int kMTiles = std::rank_v<X> == RANK ? 1 : static_cast<int>(std::extent_v<X, 0>);

template <int RANK, typename X>
__device__ __forceinline__ auto& m_tile(X& x, int mt) {
    if constexpr (std::rank_v<X> == RANK) {
        return x;
    } else {
        return x[mt];
    }
}

// a[kk] = the A fragments of k-step kk of the m-tiles at rows r0 + 16 mt of a tile, for all
// D / 16 k-steps.
template <typename T, int D, typename A, int KD>
__device__ __forceinline__ void load_a_frags(const T* s, int r0, int lane, A (&a)[KD]) {
    static_assert(KD == D / 16, "one A fragment per k-step of head_dim");
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
#pragma unroll
        for (int mt = 0; mt < kMTiles<1, A>; ++mt)
            load_a<T, D>(s, r0 + mt * 16, kk, lane, m_tile<1>(a[kk], mt));
    }
}

// acc += a · Bᵀ at k-step kk: acc holds 8 NT columns per m-tile, a the m-tiles' A fragments at
// k-step kk, B is rows [0, 8 NT), columns [16 kk, 16 kk + 16) of the tile `s` (K in Q·Kᵀ). Each
// B fragment is loaded once for all m-tiles.
template <typename T, int D, typename Acc, typename A>
__device__ __forceinline__ void mma_bt_step(Acc& acc, const A& a, const T* s, int kk, int lane) {
    constexpr int NT = static_cast<int>(std::extent_v<Acc, std::rank_v<Acc> - 2>);
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
        uint32_t bf[4];
        load_b_nk<T, D>(s, np * 16, kk, lane, bf);
#pragma unroll
        for (int mt = 0; mt < kMTiles<1, A>; ++mt) {
            mma<T>(m_tile<2>(acc, mt)[2 * np], m_tile<1>(a, mt), bf[0], bf[1]);
            mma<T>(m_tile<2>(acc, mt)[2 * np + 1], m_tile<1>(a, mt), bf[2], bf[3]);
        }
    }
}

// The same over all of head_dim: a[kk] are the A fragments of k-step kk (load_a_frags).
template <typename T, int D, typename Acc, typename A, int KD>
__device__ __forceinline__ void mma_bt(Acc& acc, const A (&a)[KD], const T* s, int lane) {
    static_assert(KD == D / 16, "one A fragment per k-step of head_dim");
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) mma_bt_step<T, D>(acc, a[kk], s, kk, lane);
}

// acc += P · B: p holds 16 KT columns per m-tile (2 KT n-tiles), rounded to T as the A operand;
// B is rows [0, 16 KT) of the tile `s` (V in P·V); acc holds D columns per m-tile.
template <typename T, int D, typename Acc, typename P>
__device__ __forceinline__ void mma_pb(Acc& acc, const P& p, const T* s, int lane) {
    constexpr int MT = kMTiles<2, P>;
    constexpr int KT = static_cast<int>(std::extent_v<P, std::rank_v<P> - 2>) / 2;
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
        uint32_t pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            to_a_frag<T>(m_tile<2>(p, mt)[2 * kk], m_tile<2>(p, mt)[2 * kk + 1], pa[mt]);
#pragma unroll
        for (int np = 0; np < D / 16; ++np) {
            uint32_t bf[4];
            load_b_kn<T, D>(s, kk * 16, np, lane, bf);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma<T>(m_tile<2>(acc, mt)[2 * np], pa[mt], bf[0], bf[1]);
                mma<T>(m_tile<2>(acc, mt)[2 * np + 1], pa[mt], bf[2], bf[3]);
            }
        }
    }
}

// Row `row` of a [seq, stride] matrix starting at `base`, this thread's part (column pair tq of
// each n-tile): fragment row half r (rows g + 8 r) of the 16 x D accumulator `acc`, times `mul`,
// rounded to T.
template <typename T, int ND>
__device__ __forceinline__ void store_row(T* base, size_t stride, int row, int tq,
                                          const float (&acc)[ND][4], int r, float mul = 1.0f) {
    T* dst = base + static_cast<size_t>(row) * stride + 2 * tq;
#pragma unroll
    for (int dt = 0; dt < ND; ++dt) {
        *reinterpret_cast<uint32_t*>(dst + dt * 8) =
            pack2<T>(acc[dt][2 * r] * mul, acc[dt][2 * r + 1] * mul);
    }
}

// ---- forward: one CTA per (query block, batch, query head) ----
// WARPS warps of MT m-tiles (16 query rows each): BR = 16 WARPS MT query rows; key blocks of BC.
template <typename T, int D, int WARPS, int MT, int BC, bool MASK, bool ALIBI>
__global__ void __launch_bounds__(WARPS * 32) flash_fwd_kernel(Args a) {
    static_assert(MASK || !ALIBI, "ALiBi is built on the masked kernels");
    constexpr int kThreads = WARPS * 32;
    constexpr int BR = WARPS * MT * 16;
    constexpr int KD = D / 16;  // k-steps over head_dim
    constexpr int NS = BC / 8;  // n-tiles of a score row block
    constexpr int ND = D / 8;   // n-tiles of an output row block
    extern __shared__ __align__(128) unsigned char smem[];
    T* sQ = reinterpret_cast<T*>(smem);
    T* sK = sQ + BR * D;      // two buffers of BC x D
    T* sV = sK + 2 * BC * D;  // two buffers of BC x D

    const auto [tid, warp, lane, g, tq] = thread_ids();
    const int seq = a.seq;
    const auto [q0, nkb, q_stride, kv_stride, q_base, kg, vg, b, h] =
        query_block<T, D, BR, BC>(a);

    // Key blocks before the block's first visible key are seen by no row of it.
    const int kb_first = MASK ? key_start(a, b, q0) / BC : 0;
    load_tile<T, BR, D, kThreads>(sQ, static_cast<const T*>(a.q) + q_base, q_stride, q0, seq,
                                  tid);
    load_kv<T, BC, D, kThreads>(sK + (kb_first & 1) * BC * D, sV + (kb_first & 1) * BC * D, kg,
                                vg, kv_stride, kb_first * BC, seq, tid);
    cp_async_commit();

    const int row_w = warp * MT * 16;  // this warp's first row in the block
    // The first visible key of this thread's rows and of the warp's first and last rows.
    int lo_r[MT][2];
    int lo_w_first = 0, lo_w_last = 0;
    if constexpr (MASK) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int r = 0; r < 2; ++r) lo_r[mt][r] = key_start(a, b, q0 + row_w + mt * 16 + g + 8 * r);
        }
        lo_w_first = key_start(a, b, q0 + row_w);
        lo_w_last = key_start(a, b, q0 + row_w + MT * 16 - 1);
    }
    const float sl2 = a.scale * kLog2e;
    // ALiBi slope in units of the raw score Q·K (the bias is added before the scale).
    const float alibi_raw = ALIBI ? a.alibi[h] / a.scale : 0.0f;
    float o[MT][ND][4];
    float row_max[MT][2];
    float row_sum[MT][2];
    uint32_t qf[KD][MT][4];
    fill(o, 0.0f);
    fill(row_max, -INFINITY);
    fill(row_sum, 0.0f);

    for (int kb = kb_first; kb < nkb; ++kb) {
        const auto [k_s, v_s] =
            next_kv_block<T, BC, D, kThreads>(sK, sV, kg, vg, kv_stride, kb, nkb, seq, tid);
        if (kb == kb_first) load_a_frags<T, D>(sQ, row_w, lane, qf);
        const int k0 = kb * BC;
        // A warp whose rows all precede the block's first key, or (masked) all start past its
        // last key, has nothing to add.
        if (k0 <= q0 + row_w + MT * 16 - 1 && (!MASK || k0 + BC - 1 >= lo_w_first)) {
            float s[MT][NS][4];
            fill(s, 0.0f);
            mma_bt<T, D>(s, qf, k_s, lane);
            if constexpr (ALIBI) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                    for (int nt = 0; nt < NS; ++nt) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int col = k0 + nt * 8 + 2 * tq + (e & 1);
                            const int row = q0 + row_w + mt * 16 + g + 8 * (e >> 1);
                            s[mt][nt][e] =
                                fmaf(alibi_raw, static_cast<float>(col - row), s[mt][nt][e]);
                        }
                    }
                }
            }
            // Causal mask, key mask and the sequence end, only where some key can pass a row's
            // range or seq.
            if (k0 + BC - 1 > q0 + row_w || k0 + BC > seq || (MASK && k0 < lo_w_last)) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                    for (int nt = 0; nt < NS; ++nt) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int col = k0 + nt * 8 + 2 * tq + (e & 1);
                            const int row = q0 + row_w + mt * 16 + g + 8 * (e >> 1);
                            if (col > row || col >= seq) s[mt][nt][e] = -INFINITY;
                            if constexpr (MASK) {
                                if (col < lo_r[mt][e >> 1]) s[mt][nt][e] = -INFINITY;
                            }
                        }
                    }
                }
            }
            // Online softmax: rescale the running sum and output by exp(scale (m_old - m_new)).
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    float mx = -INFINITY;
#pragma unroll
                    for (int nt = 0; nt < NS; ++nt)
                        mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
                    mx = quad_max(mx);
                    const float m_new = fmaxf(row_max[mt][r], mx);
                    // Without a key mask key 0 is valid for every row, so m_new is finite from
                    // the first block on; with one a row may see no key of this block: the guard
                    // keeps it at p = 0 (and corr = 0 later) instead of NaN.
                    const float m_use = m_new == -INFINITY ? 0.0f : m_new;
                    const float corr = exp2_approx((row_max[mt][r] - m_use) * sl2);
                    row_max[mt][r] = m_new;
                    const float off = m_use * sl2;
                    float sum = 0.0f;
#pragma unroll
                    for (int nt = 0; nt < NS; ++nt) {
#pragma unroll
                        for (int e = 2 * r; e < 2 * r + 2; ++e) {
                            const float p = exp2_approx(fmaf(s[mt][nt][e], sl2, -off));
                            s[mt][nt][e] = p;
                            sum += p;
                        }
                    }
                    row_sum[mt][r] = row_sum[mt][r] * corr + sum;
#pragma unroll
                    for (int dt = 0; dt < ND; ++dt) {
                        o[mt][dt][2 * r] *= corr;
                        o[mt][dt][2 * r + 1] *= corr;
                    }
                }
            }
            // O += P·V, P rounded to T as the A operand.
            mma_pb<T, D>(o, s, v_s, lane);
        }
        __syncthreads();  // the next iteration refills the other buffer, then this one
    }

    T* og = static_cast<T*>(a.o_or_dq) + q_base;
    float* lse_g = a.lse_out + (static_cast<size_t>(b) * a.q_heads + h) * seq;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float l = quad_sum(row_sum[mt][r]);
            const int row = q0 + row_w + mt * 16 + g + 8 * r;
            if (row < seq) {
                store_row<T>(og, q_stride, row, tq, o[mt], r, 1.0f / l);
                if (tq == 0) lse_g[row] = row_max[mt][r] * a.scale + logf(l);
            }
        }
    }
}

// ---- backward dK, dV: one CTA per (key block, batch, kv head) ----

// acc += X · Bᵀ for the warp's 16 rows r0.. of X (K or V): their A fragments are `regs` (REGS)
// or reloaded from the tile `x` at each k-step; B as in mma_bt.
template <typename T, int D, bool REGS, typename Acc, int R>
__device__ __forceinline__ void mma_rows_bt(Acc& acc, const uint32_t (&regs)[R][4], const T* x,
                                            int r0, const T* s, int lane) {
    if constexpr (REGS) {
        mma_bt<T, D>(acc, regs, s, lane);
    } else {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t af[4];
            load_a<T, D>(x, r0, kk, lane, af);
            mma_bt_step<T, D>(acc, af, s, kk, lane);
        }
    }
}

// WARPS warps of 16 keys each (BC = 16 WARPS keys); query blocks of BR rows. KV_REGS keeps the
// warp's K and V A-fragments in registers for the whole loop (else reloaded per query block).
template <typename T, int D, int WARPS, int BR, bool KV_REGS, bool MASK, bool ALIBI>
__global__ void __launch_bounds__(WARPS * 32) flash_bwd_dkdv_kernel(Args a) {
    static_assert(MASK || !ALIBI, "ALiBi is built on the masked kernels");
    constexpr int kThreads = WARPS * 32;
    constexpr int BC = WARPS * 16;
    constexpr int KD = D / 16;
    constexpr int NS = BR / 8;
    constexpr int ND = D / 8;
    extern __shared__ __align__(128) unsigned char smem[];
    T* sK = reinterpret_cast<T*>(smem);
    T* sV = sK + BC * D;
    T* sQ = sV + BC * D;       // two buffers of BR x D
    T* sdO = sQ + 2 * BR * D;  // two buffers of BR x D
    float* sL = reinterpret_cast<float*>(sdO + 2 * BR * D);  // two buffers of BR lse
    float* sDelta = sL + 2 * BR;                              // two buffers of BR delta
    int* sLo = reinterpret_cast<int*>(sDelta + 2 * BR);  // MASK: two buffers of BR key_start

    const auto [tid, warp, lane, g, tq] = thread_ids();
    const int seq = a.seq;
    const int kv_total = a.batch * a.kv_heads;
    // The heaviest key blocks (the first ones: most queries) are scheduled first.
    const int kb = static_cast<int>(blockIdx.x / static_cast<unsigned>(kv_total));
    const int bhk = static_cast<int>(blockIdx.x % static_cast<unsigned>(kv_total));
    const int b = bhk / a.kv_heads;
    const int hk = bhk % a.kv_heads;
    const int group = a.q_heads / a.kv_heads;
    const int k0 = kb * BC;
    const int qb_first = k0 / BR;  // the first query block holding a query >= k0
    // The queries that see a key of this block end before the first i with key_start(i) past
    // the block's last key (key_start never decreases: a binary search over [k0, seq)).
    int q_end = seq;
    if constexpr (MASK) {
        const int k_last = min(k0 + BC, seq) - 1;
        int lo = k0, hi = seq;  // key_start(k0) <= k0 <= k_last: the answer lies in (k0, seq]
        while (lo < hi) {
            const int mid = (lo + hi) / 2;
            if (key_start(a, b, mid) > k_last) hi = mid; else lo = mid + 1;
        }
        q_end = lo;
    }
    const int nq = (q_end + BR - 1) / BR - qb_first;
    const int n_it = group * nq;
    const size_t q_stride = static_cast<size_t>(a.q_heads) * D;
    const size_t kv_stride = static_cast<size_t>(a.kv_heads) * D;
    const size_t kv_base = (static_cast<size_t>(b) * seq * a.kv_heads + hk) * D;
    const T* q_all = static_cast<const T*>(a.q);
    const T* do_all = static_cast<const T*>(a.dout);

    // Iteration `it`: query head hk·group + it / nq, query block qb_first + it % nq. (`tid` is
    // copied: a C++17 lambda cannot capture a structured binding.)
    auto load_it = [&, tid = tid](int it, int buf) {
        const int hh = hk * group + it / nq;
        const int q0 = (qb_first + it % nq) * BR;
        const size_t q_base = (static_cast<size_t>(b) * seq * a.q_heads + hh) * D;
        load_tile<T, BR, D, kThreads>(sQ + buf * BR * D, q_all + q_base, q_stride, q0, seq, tid);
        load_tile<T, BR, D, kThreads>(sdO + buf * BR * D, do_all + q_base, q_stride, q0, seq,
                                      tid);
        const size_t row_base = (static_cast<size_t>(b) * a.q_heads + hh) * seq;
        for (int i = tid; i < 2 * BR; i += kThreads) {
            const int r = i % BR;
            const int t = q0 + r;
            const bool valid = t < seq;
            const float* src = (i < BR ? a.lse_in : a.delta) + row_base + (valid ? t : 0);
            float* dst = (i < BR ? sL : sDelta) + buf * BR + r;
            cp_async4(smem_addr(dst), src, valid);
        }
        if constexpr (MASK) {
            // Plain stores: visible after cp_async_next_stage's barrier; the buffer's previous
            // readers finished before the last iteration's closing barrier.
            for (int r = tid; r < BR; r += kThreads) sLo[buf * BR + r] = key_start(a, b, q0 + r);
        }
    };

    load_kv<T, BC, D, kThreads>(sK, sV, static_cast<const T*>(a.k) + kv_base,
                                static_cast<const T*>(a.v) + kv_base, kv_stride, k0, seq, tid);
    load_it(0, 0);
    cp_async_commit();

    const float sl2 = a.scale * kLog2e;
    const int kw = k0 + warp * 16;  // this warp's first key
    float dk[ND][4];
    float dv[ND][4];
    fill(dk, 0.0f);
    fill(dv, 0.0f);
    uint32_t kf[KV_REGS ? KD : 1][4];
    uint32_t vf[KV_REGS ? KD : 1][4];

    for (int it = 0; it < n_it; ++it) {
        if (it + 1 < n_it) load_it(it + 1, (it + 1) & 1);
        cp_async_next_stage();
        if constexpr (KV_REGS) {
            if (it == 0) {
                load_a_frags<T, D>(sK, warp * 16, lane, kf);
                load_a_frags<T, D>(sV, warp * 16, lane, vf);
            }
        }
        const int buf = it & 1;
        const int q0 = (qb_first + it % nq) * BR;
        const T* q_s = sQ + buf * BR * D;
        const T* do_s = sdO + buf * BR * D;
        const float* l_s = sL + buf * BR;
        const float* d_s = sDelta + buf * BR;
        const int* lo_s = sLo + buf * BR;
        // A warp whose keys all follow the block's last query, or (masked) all precede the
        // first visible key of every query of the block, has nothing to add.
        if (q0 + BR - 1 >= kw && (!MASK || lo_s[0] <= kw + 15)) {
            // Sᵀ = K·Qᵀ (rows: this warp's 16 keys; columns: the block's BR queries).
            float st[NS][4];
            fill(st, 0.0f);
            mma_rows_bt<T, D, KV_REGS>(st, kf, sK, warp * 16, q_s, lane);
            // Pᵀ = exp(scale·Sᵀ − lse[query]), zero for key > query and for queries >= seq.
            const bool need_mask =
                q0 < kw + 15 || q0 + BR > seq || (MASK && lo_s[BR - 1] > kw);
            // ALiBi slope of this iteration's query head, in raw score units.
            const float alibi_raw = ALIBI ? a.alibi[hk * group + it / nq] / a.scale : 0.0f;
#pragma unroll
            for (int nt = 0; nt < NS; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int il = nt * 8 + 2 * tq + (e & 1);
                    float sv = st[nt][e];
                    if constexpr (ALIBI) {
                        const int key = kw + g + 8 * (e >> 1);
                        sv = fmaf(alibi_raw, static_cast<float>(key - (q0 + il)), sv);
                    }
                    float p = exp2_approx(fmaf(sv, sl2, -l_s[il] * kLog2e));
                    if (need_mask) {
                        const int i = q0 + il;
                        const int j = kw + g + 8 * (e >> 1);
                        if (j > i || i >= seq) p = 0.0f;
                        if constexpr (MASK) {
                            if (j < lo_s[il]) p = 0.0f;
                        }
                    }
                    st[nt][e] = p;
                }
            }
            // dV += Pᵀ·dO.
            mma_pb<T, D>(dv, st, do_s, lane);
            // dPᵀ = V·dOᵀ.
            float dpt[NS][4];
            fill(dpt, 0.0f);
            mma_rows_bt<T, D, KV_REGS>(dpt, vf, sV, warp * 16, do_s, lane);
            // dSᵀ = Pᵀ ∘ (dPᵀ − delta[query]) · scale (zero wherever P is).
#pragma unroll
            for (int nt = 0; nt < NS; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int il = nt * 8 + 2 * tq + (e & 1);
                    dpt[nt][e] = st[nt][e] * (dpt[nt][e] - d_s[il]) * a.scale;
                }
            }
            // dK += dSᵀ·Q.
            mma_pb<T, D>(dk, dpt, q_s, lane);
        }
        __syncthreads();  // the next iteration refills the other buffer, then this one
    }

    T* dkg = static_cast<T*>(a.dk) + kv_base;
    T* dvg = static_cast<T*>(a.dv) + kv_base;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int j = kw + g + 8 * r;
        if (j < seq) {
            store_row<T>(dkg, kv_stride, j, tq, dk, r);
            store_row<T>(dvg, kv_stride, j, tq, dv, r);
        }
    }
}

// ---- backward dQ: one CTA per (query block, batch, query head) ----
// WARPS warps of 16 queries (BR = 16 WARPS); key blocks of BC.
template <typename T, int D, int WARPS, int BC, bool MASK, bool ALIBI>
__global__ void __launch_bounds__(WARPS * 32) flash_bwd_dq_kernel(Args a) {
    static_assert(MASK || !ALIBI, "ALiBi is built on the masked kernels");
    constexpr int kThreads = WARPS * 32;
    constexpr int BR = WARPS * 16;
    constexpr int KD = D / 16;
    constexpr int NS = BC / 8;
    constexpr int ND = D / 8;
    extern __shared__ __align__(128) unsigned char smem[];
    T* sQ = reinterpret_cast<T*>(smem);
    T* sdO = sQ + BR * D;
    T* sK = sdO + BR * D;     // two buffers of BC x D
    T* sV = sK + 2 * BC * D;  // two buffers of BC x D

    const auto [tid, warp, lane, g, tq] = thread_ids();
    const int seq = a.seq;
    const auto [q0, nkb, q_stride, kv_stride, q_base, kg, vg, b, h] =
        query_block<T, D, BR, BC>(a);

    load_tile<T, BR, D, kThreads>(sQ, static_cast<const T*>(a.q) + q_base, q_stride, q0, seq,
                                  tid);
    load_tile<T, BR, D, kThreads>(sdO, static_cast<const T*>(a.dout) + q_base, q_stride, q0, seq,
                                  tid);
    const int kb_first = MASK ? key_start(a, b, q0) / BC : 0;
    load_kv<T, BC, D, kThreads>(sK + (kb_first & 1) * BC * D, sV + (kb_first & 1) * BC * D, kg,
                                vg, kv_stride, kb_first * BC, seq, tid);
    cp_async_commit();

    const float sl2 = a.scale * kLog2e;
    const float alibi_raw = ALIBI ? a.alibi[h] / a.scale : 0.0f;  // raw score units
    const int row_w = q0 + warp * 16;  // this warp's first query
    const size_t row_base = (static_cast<size_t>(b) * a.q_heads + h) * seq;
    float lse2[2];
    float delta[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row_w + g + 8 * r;
        lse2[r] = row < seq ? a.lse_in[row_base + row] * kLog2e : 0.0f;
        delta[r] = row < seq ? a.delta[row_base + row] : 0.0f;
    }
    float dq[ND][4];
    fill(dq, 0.0f);
    uint32_t qf[KD][4];
    uint32_t dof[KD][4];
    // The first visible key of this thread's rows and of the warp's first and last rows.
    int lo_r[2] = {0, 0};
    int lo_w_first = 0, lo_w_last = 0;
    if constexpr (MASK) {
        lo_r[0] = key_start(a, b, row_w + g);
        lo_r[1] = key_start(a, b, row_w + g + 8);
        lo_w_first = key_start(a, b, row_w);
        lo_w_last = key_start(a, b, row_w + 15);
    }

    for (int kb = kb_first; kb < nkb; ++kb) {
        const auto [k_s, v_s] =
            next_kv_block<T, BC, D, kThreads>(sK, sV, kg, vg, kv_stride, kb, nkb, seq, tid);
        if (kb == kb_first) {
            load_a_frags<T, D>(sQ, warp * 16, lane, qf);
            load_a_frags<T, D>(sdO, warp * 16, lane, dof);
        }
        const int k0 = kb * BC;
        if (k0 <= row_w + 15 && (!MASK || k0 + BC - 1 >= lo_w_first)) {
            // S = Q·Kᵀ, then P = exp(scale·S − lse), masked.
            float s[NS][4];
            float dp[NS][4];
            fill(s, 0.0f);
            fill(dp, 0.0f);
            mma_bt<T, D>(s, qf, k_s, lane);
            const bool need_mask =
                k0 + BC - 1 > row_w || k0 + BC > seq || (MASK && k0 < lo_w_last);
#pragma unroll
            for (int nt = 0; nt < NS; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float sv = s[nt][e];
                    if constexpr (ALIBI) {
                        const int col = k0 + nt * 8 + 2 * tq + (e & 1);
                        const int row = row_w + g + 8 * (e >> 1);
                        sv = fmaf(alibi_raw, static_cast<float>(col - row), sv);
                    }
                    float p = exp2_approx(fmaf(sv, sl2, -lse2[e >> 1]));
                    if (need_mask) {
                        const int col = k0 + nt * 8 + 2 * tq + (e & 1);
                        const int row = row_w + g + 8 * (e >> 1);
                        if (col > row || col >= seq) p = 0.0f;
                        if constexpr (MASK) {
                            if (col < lo_r[e >> 1]) p = 0.0f;
                        }
                    }
                    s[nt][e] = p;
                }
            }
            // dP = dO·Vᵀ.
            mma_bt<T, D>(dp, dof, v_s, lane);
            // dS = P ∘ (dP − delta) · scale.
#pragma unroll
            for (int nt = 0; nt < NS; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    dp[nt][e] = s[nt][e] * (dp[nt][e] - delta[e >> 1]) * a.scale;
            }
            // dQ += dS·K.
            mma_pb<T, D>(dq, dp, k_s, lane);
        }
        __syncthreads();
    }

    T* dqg = static_cast<T*>(a.o_or_dq) + q_base;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row_w + g + 8 * r;
        if (row < seq) store_row<T>(dqg, q_stride, row, tq, dq, r);
    }
}

// ---- launch ----

bool aligned16(const void* p) { return p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 == 0; }

bool aligned4(const void* p) { return p != nullptr && reinterpret_cast<uintptr_t>(p) % 4 == 0; }

// Every tensor of the pass present and aligned: 16 bytes (cp.async of 16) for those of the
// element type, 4 for the f32 lse and delta.
bool pointers_ok(const Args& a, bool backward) {
    const bool both = aligned16(a.q) && aligned16(a.k) && aligned16(a.v) && aligned16(a.o_or_dq);
    if (!backward) return both && aligned4(a.lse_out);
    return both && aligned16(a.dout) && aligned16(a.dk) && aligned16(a.dv) && aligned4(a.lse_in) &&
           aligned4(a.delta) && (a.dq_accum == nullptr || aligned16(a.dq_accum));
}

// Validates the sizes and fills the int fields of `a`; false when they are out of range.
bool shape_ok(size_t batch, size_t seq, size_t q_heads, size_t kv_heads, float scale, Args* a) {
    constexpr size_t kMax = 0x3fffffff;  // far below INT_MAX: q0 + block sizes stay in int
    if (kv_heads == 0 || q_heads % kv_heads != 0) return false;
    if (batch > kMax || seq > kMax || q_heads > kMax) return false;
    if (batch * q_heads > kMax) return false;
    if (!(scale > 0.0f)) return false;
    a->batch = static_cast<int>(batch);
    a->seq = static_cast<int>(seq);
    a->q_heads = static_cast<int>(q_heads);
    a->kv_heads = static_cast<int>(kv_heads);
    a->scale = scale;
    return true;
}

// The grid of `blocks` CTAs, or false past the grid's x limit.
bool grid_ok(size_t blocks_per_head, size_t heads, unsigned* grid) {
    if (blocks_per_head == 0 || blocks_per_head > 0x7fffffffu / heads) return false;
    *grid = static_cast<unsigned>(blocks_per_head * heads);
    return true;
}

template <typename K>
cudaError_t launch(K kernel, unsigned grid, int threads, size_t smem, const Args& a,
                   cudaStream_t stream) {
    if (smem > 48 * 1024) {
        const cudaError_t e = cudaFuncSetAttribute(
            kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
        if (e != cudaSuccess) return e;
    }
    kernel<<<grid, threads, smem, stream>>>(a);
    return cudaGetLastError();
}

template <typename T, int D, int WARPS, int MT, int BC, bool MASK, bool ALIBI>
int run_forward(const Args& a, cudaStream_t stream) {
    constexpr int BR = WARPS * MT * 16;
    const size_t smem = static_cast<size_t>(BR + 4 * BC) * D * sizeof(T);
    unsigned grid;
    if (!grid_ok((a.seq + BR - 1) / BR, static_cast<size_t>(a.batch) * a.q_heads, &grid))
        return static_cast<int>(cudaErrorInvalidValue);
    return static_cast<int>(
        launch(flash_fwd_kernel<T, D, WARPS, MT, BC, MASK, ALIBI>, grid, WARPS * 32, smem, a, stream));
}

template <typename T, int D, int KV_WARPS, int KV_BR, bool KV_REGS, int Q_WARPS, int Q_BC,
          bool MASK, bool ALIBI>
int run_backward(const Args& a, cudaStream_t stream) {
    constexpr int KV_BC = KV_WARPS * 16;
    constexpr int Q_BR = Q_WARPS * 16;
    unsigned grid_kv, grid_q;
    if (!grid_ok((a.seq + KV_BC - 1) / KV_BC, static_cast<size_t>(a.batch) * a.kv_heads,
                 &grid_kv) ||
        !grid_ok((a.seq + Q_BR - 1) / Q_BR, static_cast<size_t>(a.batch) * a.q_heads, &grid_q))
        return static_cast<int>(cudaErrorInvalidValue);
    const size_t smem_kv = static_cast<size_t>(2 * KV_BC + 4 * KV_BR) * D * sizeof(T) +
                           4 * KV_BR * sizeof(float) + (MASK ? 2 * KV_BR * sizeof(int) : 0);
    cudaError_t e = launch(flash_bwd_dkdv_kernel<T, D, KV_WARPS, KV_BR, KV_REGS, MASK, ALIBI>, grid_kv,
                           KV_WARPS * 32, smem_kv, a, stream);
    if (e != cudaSuccess) return static_cast<int>(e);
    const size_t smem_q = static_cast<size_t>(2 * Q_BR + 4 * Q_BC) * D * sizeof(T);
    e = launch(flash_bwd_dq_kernel<T, D, Q_WARPS, Q_BC, MASK, ALIBI>, grid_q, Q_WARPS * 32, smem_q, a,
               stream);
    return static_cast<int>(e);
}

// The forward or the backward in the tile configuration of head_dim (registers without spills
// at -O3 for sm_80 and sm_90a); f32 and other head_dims launch nothing:
//   head_dim 64:  forward 4 warps x 2 m-tiles (128 queries) x 64 keys, 48 KB;
//                 dK/dV 64 keys x 64 queries, K/V fragments in registers, 49 KB;
//                 dQ 64 queries x 64 keys, 48 KB.
//   head_dim 128: forward 64 queries x 64 keys, 80 KB; dK/dV 64 keys x 32 queries, 64.5 KB;
//                 dQ 64 queries x 32 keys, 64 KB.
// A key mask (positions or a window) takes the MASK instantiations (dK/dV + 512 / 256 bytes);
// ALiBi slopes the MASK + ALIBI ones (whatever the mask), so the plain causal kernels and the
// masked ones stay exactly as they were and only three variants are compiled.
template <typename T, bool MASK, bool ALIBI>
int run_masked(bool backward, size_t head_dim, const Args& a, cudaStream_t stream) {
    if constexpr (std::is_same_v<T, float>) {
        return static_cast<int>(cudaErrorInvalidValue);
    } else {
        switch (head_dim) {
            case 64:
                return backward ? run_backward<T, 64, 4, 64, true, 4, 64, MASK, ALIBI>(a, stream)
                                : run_forward<T, 64, 4, 2, 64, MASK, ALIBI>(a, stream);
            case 128:
                return backward ? run_backward<T, 128, 4, 32, false, 4, 32, MASK, ALIBI>(a, stream)
                                : run_forward<T, 128, 4, 1, 64, MASK, ALIBI>(a, stream);
            default:
                return static_cast<int>(cudaErrorInvalidValue);
        }
    }
}

template <typename T>
int run(bool backward, size_t head_dim, const Args& a, cudaStream_t stream) {
    if (a.alibi != nullptr) return run_masked<T, true, true>(backward, head_dim, a, stream);
    if (a.positions != nullptr || a.window > 0)
        return run_masked<T, true, false>(backward, head_dim, a, stream);
    return run_masked<T, false, false>(backward, head_dim, a, stream);
}

// The entry points' checks, in this order: a supported dtype and head_dim; an empty problem is
// done; valid sizes (filled into `a`); the pass's tensors aligned. Then the launch.
int checked_run(int dtype, bool backward, Args a, size_t batch, size_t seq, size_t q_heads,
                size_t kv_heads, size_t head_dim, float scale, const tilearn_key_mask* mask,
                cudaStream_t stream) {
    if (!tilearn_flash_attention_supported(dtype, head_dim))
        return static_cast<int>(cudaErrorInvalidValue);
    if (batch == 0 || seq == 0 || q_heads == 0) return static_cast<int>(cudaSuccess);
    if (!shape_ok(batch, seq, q_heads, kv_heads, scale, &a) || !pointers_ok(a, backward))
        return static_cast<int>(cudaErrorInvalidValue);
    if (mask != nullptr) {
        if (mask->sliding_window > 0x3fffffff ||
            (mask->positions != nullptr && !aligned4(mask->positions)) ||
            (mask->alibi_slopes != nullptr && !aligned4(mask->alibi_slopes)))
            return static_cast<int>(cudaErrorInvalidValue);
        a.positions = mask->positions;
        a.window = static_cast<int>(mask->sliding_window);
        a.alibi = mask->alibi_slopes;
    }
    // Hopper: the wgmma kernels of flash_attention_sm90.cu where they apply.
    const bool masked = a.alibi != nullptr || a.positions != nullptr || a.window > 0;
    if (tilearn::flash::sm90_applies(dtype, head_dim, masked))
        return tilearn::flash::sm90_run(dtype, backward, head_dim, a, stream);
    return tilearn::dispatch(dtype, [&](auto tag) {
        return run<decltype(tag)>(backward, head_dim, a, stream);
    });
}

}  // namespace

extern "C" int tilearn_flash_attention_supported(int dtype, size_t head_dim) {
    const bool type_ok = dtype == TILEARN_DTYPE_BF16 || dtype == TILEARN_DTYPE_F16;
    return type_ok && (head_dim == 64 || head_dim == 128) ? 1 : 0;
}

extern "C" int tilearn_flash_attention_uses_wgmma(int dtype, size_t head_dim, int masked) {
    return tilearn::flash::sm90_applies(dtype, head_dim, masked != 0) ? 1 : 0;
}

extern "C" int tilearn_flash_attention_one_pass(int dtype, size_t head_dim, int masked) {
    // What decides the one-pass workspace.
    return tilearn::flash::sm90_one_pass_applies(dtype, head_dim, masked != 0) ? 1 : 0;
}

extern "C" int tilearn_flash_attention_forward(int dtype, const void* q, const void* k,
                                               const void* v, void* out, float* lse,
                                               size_t batch, size_t seq, size_t q_heads,
                                               size_t kv_heads, size_t head_dim, float scale,
                                               const tilearn_key_mask* mask, cudaStream_t stream) {
    const Args a{q, k, v, out, lse};
    return checked_run(dtype, false, a, batch, seq, q_heads, kv_heads, head_dim, scale, mask,
                       stream);
}

extern "C" int tilearn_flash_attention_backward(int dtype, const void* dout, const void* q,
                                                const void* k, const void* v, const float* lse,
                                                const float* delta, void* dq, void* dk, void* dv,
                                                size_t batch, size_t seq, size_t q_heads,
                                                size_t kv_heads, size_t head_dim, float scale,
                                                const tilearn_key_mask* mask,
                                                float* dq_accum, cudaStream_t stream) {
    Args a{q, k, v, dq, nullptr, dout, lse, delta, dk, dv};
    a.dq_accum = dq_accum;
    return checked_run(dtype, true, a, batch, seq, q_heads, kv_heads, head_dim, scale, mask,
                       stream);
}

extern "C" size_t tilearn_flash_attention_dq_accum_len(size_t batch, size_t seq, size_t q_heads,
                                                       size_t head_dim) {
    const size_t rows = (seq + 63) / 64 * 64;
    size_t n = 0;
    if (__builtin_mul_overflow(batch, q_heads, &n) || __builtin_mul_overflow(n, rows, &n) ||
        __builtin_mul_overflow(n, head_dim, &n))
        return 0;
    return n;
}
