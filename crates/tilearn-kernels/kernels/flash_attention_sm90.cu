// flash_attention_sm90.cu: flash_attention.cu's causal grouped-query attention, forward and
// backward, on Hopper's warpgroup tensor-core instructions (wgmma, sm_90a), for head_dim 64 and
// 128, bf16 and f16, without a key mask or ALiBi (those and sm_80 keep the mma.sync kernels).
// head_dim 128 keeps every tile row as two 64-wide panels (PANELS = 2), so the head_dim-64
// loaders, descriptors and products serve both halves; the forward then walks key blocks of 64,
// and the backward is the two-kernel one (no one-pass form); TILEARN_FLASH_SM90_HD128=0 keeps
// head_dim 128 on mma.sync.
// flash_attention.cu's launcher calls sm90_run (flash_sm90.h) when the device is compute
// capability 9.0 and the problem is one of these; TILEARN_FLASH_SM80=1 keeps the mma.sync
// kernels.
//
// Fused:     the same three passes as flash_attention.cu; a CTA is one or two warpgroups (128
//            threads each), each warpgroup owning 64 rows of the CTA's block. Forward (one
//            warpgroup): one CTA per (64-query block, batch, query head) walks the 128-key blocks
//            up to the diagonal: S = Q·Kᵀ (wgmma, Q and K from shared memory), the causal mask and
//            online softmax in registers, O += P·V (wgmma, P from registers, V from shared
//            memory); O and lse written once. dK/dV (two warpgroups): one CTA per (128-key block,
//            batch, kv head) walks the GQA group's query heads and their 64-query blocks from the
//            diagonal on: Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ, Pᵀ and dSᵀ in registers, dV += Pᵀ·dO and
//            dK += dSᵀ·Q (A from registers). dQ (two warpgroups): one CTA per (128-query block,
//            batch, query head) walks the 64-key blocks up to the diagonal: S = Q·Kᵀ, dP = dO·Vᵀ,
//            dQ += dS·K. The streamed tiles (K/V, or Q/dO/lse/delta for dK/dV) rotate through
//            two or three buffers, one step ahead; blocks above the diagonal are never loaded.
//            The head_dim-64 forward brings K and V in with TMA (fwd_tma_kernel: one thread, the
//            bytes counted by an mbarrier; TILEARN_FLASH_SM90_FWD_TMA=0 keeps fwd_kernel's
//            cp.async, the same bits, =1 demands TMA), and so does the one-pass backward's Q and
//            dO (TILEARN_FLASH_SM90_BWD_TMA, the same values); everything else loads by cp.async
//            from every thread.
//            The backward computes exactly what flash_attention.cu's does, in the same order
//            (same tiles of 64, same roundings): its results are bit-identical to it, at head_dim
//            128 too (each panel's k-steps in turn into one accumulator).
//            One-pass backward (when the caller passes dq_accum; dkdv_ws_kernel): one CTA per
//            128-key block forms dK, dV and dQ with three warpgroups that meet at no barrier.
//            Warpgroups 0 and 1 run the dK/dV steps above and leave each step's dSᵀ (already
//            rounded for dK) in shared memory; warpgroup 2 loads the query stages three steps
//            ahead and forms each step's dQ = dS·K over the CTA's 128 keys (both operands from
//            shared memory), and one of its threads adds the 64 x 64 f32 block into dq_accum
//            with a bulk reduce-add (in L2, asynchronous); mbarriers pass stages and dSᵀ tiles
//            between them. A small kernel rounds dq_accum into dq. Five products instead of
//            seven and one kernel instead of two; on an H200 the backward takes 0.88 of the
//            earlier barrier-per-step one-pass kernel's time and 0.78-0.82 of the two-kernel's.
// Layout:    as flash_attention.cu: q / out / dout / dq [batch, seq, q_heads, 64], k / v / dk /
//            dv [batch, seq, kv_heads, 64], lse / delta f32 [batch, q_heads, seq]; every tile a
//            1024-byte aligned [rows][64] block with 128-byte swizzle (wgmma.cuh). dq_accum: f32
//            blocks of 64 queries x 64 in fragment order (dq_fragment_index), [batch, q_heads,
//            ceil(seq / 64)] of them.
// Precision: as flash_attention.cu: f32 accumulation, softmax, lse, dP and delta; P and dS rounded
//            once to the element type as an A operand; outputs rounded once. The one-pass dQ sums
//            the same products in f32, in the order the CTAs' adds arrive.
// Gradients: dq, dk, dv written (`=`), every element of rows < seq; dq_accum overwritten.
// Determinism: the two-kernel backward has no atomics; each CTA owns its outputs and sums in a
//            fixed order (key blocks ascending; for dK / dV the group's heads, then query blocks,
//            ascending): bit-identical from run to run. The one-pass backward's dK and dV are the
//            same bits; its dq varies with the order of the reduce-adds (f32 rounding).

#include <cudaTypedefs.h>

#include <atomic>
#include <cstdlib>

#include "flash_common.cuh"
#include "flash_sm90.h"
#include "wgmma.cuh"

// wgmma exists only in the sm_90a pass; the other passes (sm_80, compute_80 PTX) compile the
// kernels empty, and the host launches them only on a compute-capability-9.0 device.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TILEARN_HAS_WGMMA 1
#else
#define TILEARN_HAS_WGMMA 0
#endif

namespace {

using namespace tilearn::flash;
namespace wg = tilearn::wgmma;

constexpr int kD = 64;          // head_dim
constexpr int kTile = kD * 2;   // bytes of one tile row (16-bit types)

// The dynamic shared memory, its start rounded up to 1024 bytes (the 128-byte swizzle's atom);
// the launch asks for kAlignSlack bytes more than the tiles need.
constexpr size_t kAlignSlack = 1024;

#if TILEARN_HAS_WGMMA  // device helpers: the sm_90a pass alone uses them

template <typename T>
__device__ __forceinline__ T* smem_tiles() {
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t base = smem_addr(smem);
    return reinterpret_cast<T*>(smem + ((1024u - (base & 1023u)) & 1023u));
}

// This thread's place in its warpgroup: warpgroup index, the first row of its warp inside the
// warpgroup's 64, and the fragment row g / column pair t.
struct WgIds {
    int tid, wgi, wrow, g, t;
};

__device__ __forceinline__ WgIds wg_ids() {
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    return {tid, tid >> 7, ((tid >> 5) & 3) * 16, lane >> 2, lane & 3};
}

// Accumulator element i of a 64 x N block: row (within the warp's 16) and column.
__device__ __forceinline__ int acc_row(const WgIds& id, int i) { return id.g + 8 * ((i >> 1) & 1); }
__device__ __forceinline__ int acc_col(const WgIds& id, int i) {
    return 8 * (i >> 2) + 2 * id.t + (i & 1);
}

// The A fragment of k step kk (columns 16 kk .. 16 kk + 15) of an accumulator, rounded to T.
template <typename T, int N>
__device__ __forceinline__ void acc_to_a(const float (&d)[N], int kk, uint32_t (&a)[4]) {
    a[0] = pack2<T>(d[8 * kk + 0], d[8 * kk + 1]);
    a[1] = pack2<T>(d[8 * kk + 2], d[8 * kk + 3]);
    a[2] = pack2<T>(d[8 * kk + 4], d[8 * kk + 5]);
    a[3] = pack2<T>(d[8 * kk + 6], d[8 * kk + 7]);
}

// d = A · Bᵀ over head_dim (4 k steps): A rows from tile `a` (K-major), B rows from tile `b`
// (K-major), both [rows][64]; issued and committed, not waited for. `accumulate`: add to d
// (the second 64 columns of a head_dim-128 product) instead of starting from 0.
template <typename T, int N>
__device__ __forceinline__ void gemm_abt(float (&d)[N], uint32_t a, uint32_t b,
                                         bool accumulate = false) {
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk)
        wg::wgmma_ss<T, 0, 0>(d, wg::desc_k_major(a, kk), wg::desc_k_major(b, kk),
                              accumulate || kk > 0);
}

// d += P · B over K rows of B (K / 16 k steps): P from the accumulator p (64 x K), B the
// MN-major tile `b` ([K rows][64]).
// The A fragments are all formed before the first wgmma, so that the compiler need not stall
// the warpgroup between them.
template <typename T, int K, int NP>
__device__ __forceinline__ void to_a_frags(const float (&p)[NP], uint32_t (&a)[K / 16][4]) {
    static_assert(NP == K / 2, "p holds a 64 x K block");
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) acc_to_a<T>(p, kk, a[kk]);
}

template <typename T, int K>
__device__ __forceinline__ void gemm_pb(float (&d)[32], const uint32_t (&a)[K / 16][4], uint32_t b) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) wg::wgmma_rs<T, 1>(d, a[kk], wg::desc_mn_major(b, kk), 1);
}

// Writes a warpgroup's 64 x 64 accumulator as rows row0 + r (those < seq) of a [seq, stride]
// matrix at `base`, rounded to T.
template <typename T>
__device__ __forceinline__ void store_acc(T* base, size_t stride, int row0, int seq,
                                          const float (&d)[32], const WgIds& id) {
#pragma unroll
    for (int i = 0; i < 32; i += 2) {
        const int row = row0 + id.wrow + acc_row(id, i);
        if (row < seq)
            *reinterpret_cast<uint32_t*>(base + static_cast<size_t>(row) * stride + acc_col(id, i)) =
                pack2<T>(d[i], d[i + 1]);
    }
}

#endif  // TILEARN_HAS_WGMMA

// ---- the kernels' shapes ----
// WGS warpgroups per CTA (128 WGS threads), each owning 64 rows of the CTA's block (queries for
// the forward and dQ, keys for dK/dV). Tiles rotate through kStages shared-memory buffers (the
// forward: kFwdStages), loaded one step ahead after the barrier that opens a step: the buffer
// refilled at step j was last read at step j - 2 (j - 1 with two buffers), which every
// warpgroup has waited for before that barrier.

constexpr int kStages = 3;
constexpr int kFwdBc = 128;  // keys per forward step
constexpr int kDqBc = 64;    // keys per dQ step
constexpr int kKvBr = 64;    // queries per dK/dV step

template <int WGS>
__host__ __device__ constexpr int threads_of() { return 128 * WGS; }

// The forward keeps two K/V buffers (the top-of-step barrier already orders the refill of the
// buffer read a step before) and asks for three CTAs an SM: 74 KB of shared memory and at most
// 168 registers each. Three interleaved warpgroups hide each other's softmax: 12-13 % faster
// than two CTAs of three buffers and 201 registers (H200; 0.401 against 0.459 ms at TinyLlama's
// shape, 2.58 against 2.92 at 1 x 16 K; the same bits).
constexpr int kFwdStages = 2;
constexpr int kFwdCtasPerSm = 3;

// head_dim 128 (PANELS = 2: every tile row two 64-element panels, each its own [rows][64]
// swizzled tile, so the head_dim-64 descriptors and loaders serve both halves): S sums the two
// panels' products, O is two 64 x 64 accumulators. Keys per step halve to 64 (S 32 registers,
// O 64) and the CTA's tiles double: 82 KB, two CTAs an SM. Measured on an H200 at Llama-2-7B's
// heads (1 x 4096, 32/32): 0.32 ms against mma.sync's 0.49; TILEARN_FLASH_SM90_HD128=0 turns
// it off (see sm90_applies).
template <int PANELS>
__host__ __device__ constexpr int fwd_bc() { return PANELS == 1 ? kFwdBc : 64; }

template <int PANELS>
__host__ __device__ constexpr int fwd_ctas_per_sm() { return PANELS == 1 ? kFwdCtasPerSm : 2; }

template <int WGS, int PANELS = 1>
constexpr size_t fwd_smem() {
    return (64 * WGS + 2 * kFwdStages * fwd_bc<PANELS>()) * kTile * PANELS + kAlignSlack;
}

template <int WGS, int PANELS = 1>
constexpr size_t dq_smem() {
    return (2 * 64 * WGS + 2 * kStages * kDqBc) * kTile * PANELS + kAlignSlack;
}

// The one-pass backward's dQ block: 64 queries x 64 f32, the reduce-add's source (two of them,
// alternating by step, so that one step's add runs while the next is computed).
constexpr int kDqBlock = kKvBr * kD;

template <int WGS, int PANELS = 1>
constexpr size_t dkdv_smem() {
    return (2 * 64 * WGS + 2 * kStages * kKvBr) * PANELS * kTile +
           2 * kStages * kKvBr * sizeof(float) + kAlignSlack;
}

#if TILEARN_HAS_WGMMA
// The causal mask of a 64 x 4N block of scores (keys from k0, the warpgroup's rows from row_wg):
// keys after their query get `masked`; this also hides keys >= seq from every row < seq.
template <int N>
__device__ __forceinline__ void mask_causal(float (&s)[N], int k0, int row_wg, const WgIds& id,
                                            float masked) {
    if (k0 + 4 * N - 1 <= row_wg) return;  // the block's last key precedes every row
#pragma unroll
    for (int i = 0; i < N; ++i) {
        if (k0 + acc_col(id, i) > row_wg + id.wrow + acc_row(id, i)) s[i] = masked;
    }
}
#endif

#if TILEARN_HAS_WGMMA
// The K / V tiles of a forward or dQ CTA's key blocks, BC keys each, streamed through STAGES
// shared-memory buffers one block ahead (kernel shapes above). A buffer holds PANELS tiles of
// BC x kD (head_dim = PANELS x 64: panel p is columns 64 p .. 64 p + 63).
template <typename T, int BC, int STAGES, int THREADS, int PANELS = 1>
struct KvStream {
    T* k_bufs;   // STAGES x PANELS tiles of BC x kD
    T* v_bufs;
    const T* k;  // the CTA's (batch, kv head) column of k / v
    const T* v;
    size_t stride;
    int nkb;     // key blocks the CTA walks
    int seq;
    int tid;

    // Starts loading block kb (nothing past the last) and commits a cp.async group either way.
    __device__ __forceinline__ void load(int kb) const {
        if (kb < nkb) {
#pragma unroll
            for (int p = 0; p < PANELS; ++p)
                load_kv<T, BC, kD, THREADS>(k_bufs + ((kb % STAGES) * PANELS + p) * BC * kD,
                                            v_bufs + ((kb % STAGES) * PANELS + p) * BC * kD,
                                            k + p * kD, v + p * kD, stride, kb * BC, seq, tid);
        }
        cp_async_commit();
    }

    // Opens step kb: waits for block kb, makes it visible to wgmma, syncs the CTA (after which
    // the buffer of block kb + 1 is free, see above) and starts loading kb + 1. Returns the
    // shared addresses of block kb's K and V tiles (panel 0; panel p is p x BC x kTile bytes on).
    __device__ __forceinline__ uint2 open_step(int kb) const {
        cp_async_wait<0>();
        wg::fence_smem_for_async();
        __syncthreads();
        load(kb + 1);
        return make_uint2(smem_addr(k_bufs + (kb % STAGES) * PANELS * BC * kD),
                          smem_addr(v_bufs + (kb % STAGES) * PANELS * BC * kD));
    }
};
#endif

#if TILEARN_HAS_WGMMA
// The forward's online softmax over one block of scores s (64 x 4N, keys from k0): the causal
// mask, each row's new running maximum and sum, s replaced by P (unnormalised, f32); returns in
// corr what O must be multiplied by before P·V is added. Key 0 is visible to every row and block
// 0 comes first, so the running maximum is finite from the first block on.
template <int N>
__device__ __forceinline__ void softmax_scores(float (&s)[N], float (&row_max)[2],
                                               float (&row_sum)[2], float (&corr)[2], int k0,
                                               int row_wg, float sl2, const WgIds& id) {
    mask_causal(s, k0, row_wg, id, -INFINITY);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = -INFINITY;
#pragma unroll
        for (int i = 2 * r; i < N; i += 4) mx = fmaxf(mx, fmaxf(s[i], s[i + 1]));
        mx = quad_max(mx);
        const float m_new = fmaxf(row_max[r], mx);
        corr[r] = exp2_approx((row_max[r] - m_new) * sl2);
        row_max[r] = m_new;
        const float off = m_new * sl2;
        float sum = 0.0f;
#pragma unroll
        for (int i = 2 * r; i < N; i += 4) {
            s[i] = exp2_approx(fmaf(s[i], sl2, -off));
            s[i + 1] = exp2_approx(fmaf(s[i + 1], sl2, -off));
            sum += s[i] + s[i + 1];
        }
        row_sum[r] = row_sum[r] * corr[r] + sum;
    }
}

// O *= corr, row by row.
template <int PANELS>
__device__ __forceinline__ void rescale_o(float (&o)[PANELS][32], const float (&corr)[2]) {
#pragma unroll
    for (int p = 0; p < PANELS; ++p) {
#pragma unroll
        for (int i = 0; i < 32; ++i) o[p][i] *= corr[(i >> 1) & 1];
    }
}

// The forward's epilogue: lse and O / rowsum of the warpgroup's rows (those < seq).
template <typename T, int PANELS>
__device__ __forceinline__ void fwd_store(const Args& a, const QueryBlock<T>& blk,
                                          float (&o)[PANELS][32], const float (&row_max)[2],
                                          const float (&row_sum)[2], int row_wg,
                                          const WgIds& id) {
    const int seq = a.seq;
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float sum = quad_sum(row_sum[r]);
        inv[r] = 1.0f / sum;
        const int row = row_wg + id.wrow + id.g + 8 * r;
        if (id.t == 0 && row < seq)
            a.lse_out[(static_cast<size_t>(blk.b) * a.q_heads + blk.h) * seq + row] =
                row_max[r] * a.scale + logf(sum);
    }
#pragma unroll
    for (int p = 0; p < PANELS; ++p) {
#pragma unroll
        for (int i = 0; i < 32; ++i) o[p][i] *= inv[(i >> 1) & 1];
        store_acc<T>(static_cast<T*>(a.o_or_dq) + blk.q_base + p * kD, blk.q_stride, row_wg, seq,
                     o[p], id);
    }
}
#endif

#if TILEARN_HAS_WGMMA
// One forward step of a warpgroup: S = Q·Kᵀ over the key block at k0 (K and V: `tiles`, panel 0;
// Q: q_tile, panels q_panel bytes apart), the online softmax, O = O·corr + P·V; every product
// waited for within the step.
template <typename T, int PANELS>
__device__ __forceinline__ void fwd_step(float (&o)[PANELS][32], float (&row_max)[2],
                                         float (&row_sum)[2], uint32_t q_tile, uint32_t q_panel,
                                         uint2 tiles, int k0, int row_wg, float sl2,
                                         const WgIds& id) {
    constexpr int kBc = fwd_bc<PANELS>();
    constexpr uint32_t kKvPanel = kBc * kTile;  // bytes from one K (or V) panel to the next
    float s[kBc / 2];
    wg::fence();
#pragma unroll
    for (int p = 0; p < PANELS; ++p)
        gemm_abt<T>(s, q_tile + p * q_panel, tiles.x + p * kKvPanel, p > 0);
    wg::commit();
    wg::wait<0>();
    wg::fence_regs(s);
    float corr[2];
    softmax_scores(s, row_max, row_sum, corr, k0, row_wg, sl2, id);
    rescale_o(o, corr);
    uint32_t pa[kBc / 16][4];
    to_a_frags<T, kBc>(s, pa);
    wg::fence();
#pragma unroll
    for (int p = 0; p < PANELS; ++p) gemm_pb<T, kBc>(o[p], pa, tiles.y + p * kKvPanel);
    wg::commit();
    wg::wait<0>();
#pragma unroll
    for (int p = 0; p < PANELS; ++p) wg::fence_regs(o[p]);
}
#endif

// ---- forward: one CTA per (64 WGS-query block, batch, query head), key blocks of 128 ----
// (head_dim 128, PANELS = 2: key blocks of 64, the products over both panels; see fwd_bc.)

template <typename T, int WGS, int PANELS = 1>
__global__ void __launch_bounds__(128 * WGS, fwd_ctas_per_sm<PANELS>() / WGS) fwd_kernel(Args a) {
#if TILEARN_HAS_WGMMA
    constexpr int kThr = threads_of<WGS>();
    constexpr int kBr = 64 * WGS;
    constexpr int kBc = fwd_bc<PANELS>();
    T* sQ = smem_tiles<T>();
    T* sK = sQ + PANELS * kBr * kD;
    T* sV = sK + kFwdStages * PANELS * kBc * kD;
    const WgIds id = wg_ids();
    const int seq = a.seq;
    const QueryBlock<T> blk = query_block<T, kD * PANELS, kBr, kBc>(a);
    const int q0 = blk.q0, nkb = blk.nkb;
    const KvStream<T, kBc, kFwdStages, kThr, PANELS> kv{sK, sV, blk.k, blk.v, blk.kv_stride,
                                                        nkb, seq, id.tid};
#pragma unroll
    for (int p = 0; p < PANELS; ++p)
        load_tile<T, kBr, kD, kThr>(sQ + p * kBr * kD,
                                    static_cast<const T*>(a.q) + blk.q_base + p * kD, blk.q_stride,
                                    q0, seq, id.tid);
    kv.load(0);

    const int row_wg = q0 + id.wgi * 64;  // the warpgroup's first query
    const uint32_t q_tile = smem_addr(sQ + id.wgi * 64 * kD);
    constexpr uint32_t kQPanel = kBr * kTile;
    const float sl2 = a.scale * kLog2e;
    float o[PANELS][32];
    float row_max[2] = {-INFINITY, -INFINITY};
    float row_sum[2] = {0.0f, 0.0f};
    fill(o, 0.0f);

    for (int kb = 0; kb < nkb; ++kb) {
        const uint2 tiles = kv.open_step(kb);
        fwd_step<T, PANELS>(o, row_max, row_sum, q_tile, kQPanel, tiles, kb * kBc, row_wg, sl2, id);
    }

    fwd_store<T, PANELS>(a, blk, o, row_max, row_sum, row_wg, id);
#endif
}

// ---- backward dQ: one CTA per (64 WGS-query block, batch, query head), key blocks of 64 ----
// Per warpgroup and key block: S and dP issued as two groups, P formed while dP finishes, then
// dQ += dS·K. (Leaving dQ running into the next block's S and dP measured no faster.)
// head_dim 128 (PANELS = 2): every tile two 64-wide panels, as in the forward; S and dP sum the
// panels' products, dQ is two 64 x 64 accumulators (one per panel of K).

template <typename T, int WGS, int PANELS = 1>
__global__ void __launch_bounds__(128 * WGS, 1) dq_kernel(Args a) {
#if TILEARN_HAS_WGMMA
    constexpr int kThr = threads_of<WGS>();
    constexpr int kBr = 64 * WGS;
    constexpr uint32_t kQPanel = kBr * kTile;     // bytes from one Q (or dO) panel to the next
    constexpr uint32_t kKvPanel = kDqBc * kTile;  // the same for K and V
    T* sQ = smem_tiles<T>();
    T* sDo = sQ + PANELS * kBr * kD;
    T* sK = sDo + PANELS * kBr * kD;
    T* sV = sK + kStages * PANELS * kDqBc * kD;
    const WgIds id = wg_ids();
    const int seq = a.seq;
    const QueryBlock<T> blk = query_block<T, kD * PANELS, kBr, kDqBc>(a);
    const int q0 = blk.q0, nkb = blk.nkb;
    const KvStream<T, kDqBc, kStages, kThr, PANELS> kv{sK, sV, blk.k, blk.v, blk.kv_stride,
                                                       nkb, seq, id.tid};
#pragma unroll
    for (int p = 0; p < PANELS; ++p) {
        load_tile<T, kBr, kD, kThr>(sQ + p * kBr * kD,
                                    static_cast<const T*>(a.q) + blk.q_base + p * kD, blk.q_stride,
                                    q0, seq, id.tid);
        load_tile<T, kBr, kD, kThr>(sDo + p * kBr * kD,
                                    static_cast<const T*>(a.dout) + blk.q_base + p * kD,
                                    blk.q_stride, q0, seq, id.tid);
    }
    kv.load(0);

    const int row_wg = q0 + id.wgi * 64;
    const uint32_t q_tile = smem_addr(sQ + id.wgi * 64 * kD);
    const uint32_t do_tile = smem_addr(sDo + id.wgi * 64 * kD);
    const float sl2 = a.scale * kLog2e;
    // lse (in log2 units) and delta of this thread's two rows; rows past seq never reach memory.
    float lse2[2], delta[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = min(row_wg + id.wrow + id.g + 8 * r, seq - 1);
        const size_t at = (static_cast<size_t>(blk.b) * a.q_heads + blk.h) * seq + row;
        lse2[r] = a.lse_in[at] * kLog2e;
        delta[r] = a.delta[at];
    }
    float dq[PANELS][32];
    fill(dq, 0.0f);

    for (int kb = 0; kb < nkb; ++kb) {
        const uint2 tiles = kv.open_step(kb);
        const uint32_t k_tile = tiles.x, v_tile = tiles.y;
        float s[32], dp[32];
        wg::fence();
#pragma unroll
        for (int p = 0; p < PANELS; ++p)
            gemm_abt<T>(s, q_tile + p * kQPanel, k_tile + p * kKvPanel, p > 0);
        wg::commit();
#pragma unroll
        for (int p = 0; p < PANELS; ++p)
            gemm_abt<T>(dp, do_tile + p * kQPanel, v_tile + p * kKvPanel, p > 0);
        wg::commit();
        wg::wait<1>();  // S
        wg::fence_regs(s);
#pragma unroll
        for (int i = 0; i < 32; ++i) s[i] = exp2_approx(fmaf(s[i], sl2, -lse2[(i >> 1) & 1]));
        mask_causal(s, kb * kDqBc, row_wg, id, 0.0f);
        wg::wait<0>();  // dP
        wg::fence_regs(dp);
#pragma unroll
        for (int i = 0; i < 32; ++i) s[i] = s[i] * (dp[i] - delta[(i >> 1) & 1]) * a.scale;  // dS
        uint32_t dsa[kDqBc / 16][4];
        to_a_frags<T, kDqBc>(s, dsa);
        wg::fence();
#pragma unroll
        for (int p = 0; p < PANELS; ++p) gemm_pb<T, kDqBc>(dq[p], dsa, k_tile + p * kKvPanel);
        wg::commit();
        wg::wait<0>();
    }
    wg::wait<0>();
#pragma unroll
    for (int p = 0; p < PANELS; ++p) {
        wg::fence_regs(dq[p]);
        store_acc<T>(static_cast<T*>(a.o_or_dq) + blk.q_base + p * kD, blk.q_stride, row_wg, seq,
                     dq[p], id);
    }
#endif
}

// ---- backward dK/dV: one CTA per (64 WGS-key block, batch, kv head), query blocks of 64 ----
// Per warpgroup and step (dkdv_products): Sᵀ and dPᵀ issued as two groups; dV += Pᵀ·dO issued as
// soon as P is formed (while dPᵀ finishes), dK += dSᵀ·Q after it.

#if TILEARN_HAS_WGMMA
// One query block's inputs in shared memory: Q and dO tiles (PANELS panels each, see
// dkdv_kernel), lse (natural units) and delta, zero past seq (see dkdv_products).
template <typename T>
struct QStage {
    T* q;
    T* dout;
    float* lse;
    float* delta;
};

template <typename T, int PANELS, int STAGES = kStages>
__device__ __forceinline__ QStage<T> q_stage(T* base, float* fbase, int step) {
    const int i = step % STAGES;
    constexpr int kTileElems = PANELS * kKvBr * kD;
    return {base + i * 2 * kTileElems, base + (i * 2 + 1) * kTileElems, fbase + i * 2 * kKvBr,
            fbase + (i * 2 + 1) * kKvBr};
}

// Query block qb of head h's lse and delta into a stage by cp.async, zero past seq: threads
// 0-63 copy lse, 64-127 delta, a value each.
template <typename T>
__device__ __forceinline__ void load_lse_delta(const Args& a, const QStage<T>& st, int b, int h,
                                               int qb, int tid) {
    if (tid >= 2 * kKvBr) return;
    const int r = tid % kKvBr;
    const int row = qb * kKvBr + r;
    const size_t at = (static_cast<size_t>(b) * a.q_heads + h) * a.seq + min(row, a.seq - 1);
    if (tid < kKvBr) cp_async4(smem_addr(st.lse + r), a.lse_in + at, row < a.seq);
    else cp_async4(smem_addr(st.delta + r), a.delta + at, row < a.seq);
}

// Loads query block qb of head h into a stage, all by cp.async (THREADS >= 128: the first 64
// threads copy lse, the next 64 delta).
template <typename T, int THREADS, int PANELS>
__device__ __forceinline__ void load_q_stage(const Args& a, const QStage<T>& st, int b, int h,
                                             int qb, int tid) {
    static_assert(THREADS >= 2 * kKvBr, "lse and delta take a thread per row each");
    const int seq = a.seq;
    const size_t q_stride = static_cast<size_t>(a.q_heads) * kD * PANELS;
    const size_t base = (static_cast<size_t>(b) * seq * a.q_heads + h) * kD * PANELS;
    const int q0 = qb * kKvBr;
#pragma unroll
    for (int p = 0; p < PANELS; ++p) {
        load_tile<T, kKvBr, kD, THREADS>(st.q + p * kKvBr * kD,
                                         static_cast<const T*>(a.q) + base + p * kD, q_stride, q0,
                                         seq, tid);
        load_tile<T, kKvBr, kD, THREADS>(st.dout + p * kKvBr * kD,
                                         static_cast<const T*>(a.dout) + base + p * kD, q_stride,
                                         q0, seq, tid);
    }
    load_lse_delta(a, st, b, h, qb, tid);
}

// What a dK/dV CTA works on: KEYS keys from k0 of (batch b, kv head hk), the heaviest key
// blocks (the first ones: the most queries see them) scheduled first; its steps are the GQA
// group's query heads, each over the query blocks from the one holding query k0 (earlier queries
// see none of these keys) to the end.
struct KeyBlock {
    int b, hk, group;
    int k0;            // the block's first key
    size_t kv_stride;  // elements from one token to the next in k / v / dk / dv
    size_t kv_base;    // (b, token 0, hk) in k / v / dk / dv
    int qb_first;      // the first query block of every head's steps
    int nqb;           // query blocks per head
    int steps;         // group x nqb
};

template <int PANELS, int KEYS>
__device__ __forceinline__ KeyBlock key_block(const Args& a) {
    const int heads_total = a.batch * a.kv_heads;
    const int kb = static_cast<int>(blockIdx.x / static_cast<unsigned>(heads_total));
    const int bh = static_cast<int>(blockIdx.x % static_cast<unsigned>(heads_total));
    const int b = bh / a.kv_heads;
    const int hk = bh % a.kv_heads;
    const int group = a.q_heads / a.kv_heads;
    const int k0 = kb * KEYS;
    const int qb_first = k0 / kKvBr;
    const int nqb = (a.seq + kKvBr - 1) / kKvBr - qb_first;
    return {b,
            hk,
            group,
            k0,
            static_cast<size_t>(a.kv_heads) * kD * PANELS,
            (static_cast<size_t>(b) * a.seq * a.kv_heads + hk) * kD * PANELS,
            qb_first,
            nqb,
            group * nqb};
}

// One step of a dK/dV warpgroup: its 64 keys (from key_wg; tiles k_tile / v_tile, PANELS panels
// KEYS rows apart) against the stage's 64 queries (from q0). dV += Pᵀ·dO and dK += dSᵀ·Q, dK's
// product left in flight (committed, not waited for); dSᵀ, rounded as dK's A operand, in `dsa`.
// P is 0 above the diagonal and for queries past seq (their Q, dO, lse and delta are zero).
template <typename T, int PANELS, int KEYS>
__device__ __forceinline__ void dkdv_products(const QStage<T>& st, uint32_t k_tile,
                                              uint32_t v_tile, int key_wg, int q0, int seq,
                                              float scale, const WgIds& id,
                                              float (&dk)[PANELS][32], float (&dv)[PANELS][32],
                                              uint32_t (&dsa)[kKvBr / 16][4]) {
    constexpr uint32_t kKvPanel = KEYS * kTile;  // bytes from one K (or V) panel to the next
    constexpr uint32_t kQPanel = kKvBr * kTile;  // the same for a stage's Q and dO
    const uint32_t q_tile = smem_addr(st.q);
    const uint32_t do_tile = smem_addr(st.dout);
    const float sl2 = scale * kLog2e;
    float s[32], dp[32];
    wg::fence();
#pragma unroll
    for (int p = 0; p < PANELS; ++p)  // Sᵀ: rows keys, columns queries
        gemm_abt<T>(s, k_tile + p * kKvPanel, q_tile + p * kQPanel, p > 0);
    wg::commit();
#pragma unroll
    for (int p = 0; p < PANELS; ++p)  // dPᵀ
        gemm_abt<T>(dp, v_tile + p * kKvPanel, do_tile + p * kQPanel, p > 0);
    wg::commit();
    wg::wait<1>();  // Sᵀ
    wg::fence_regs(s);
    const bool diag = key_wg + id.wrow + 15 > q0;
    const bool tail = q0 + kKvBr > seq;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        const int c = acc_col(id, i);
        float p = exp2_approx(fmaf(s[i], sl2, -(st.lse[c] * kLog2e)));
        if (diag && key_wg + id.wrow + acc_row(id, i) > q0 + c) p = 0.0f;
        if (tail && q0 + c >= seq) p = 0.0f;
        s[i] = p;
    }
    uint32_t pa[kKvBr / 16][4];
    to_a_frags<T, kKvBr>(s, pa);
    wg::fence();
#pragma unroll
    for (int p = 0; p < PANELS; ++p) gemm_pb<T, kKvBr>(dv[p], pa, do_tile + p * kQPanel);
    wg::commit();
    wg::wait<1>();  // dPᵀ
    wg::fence_regs(dp);
#pragma unroll
    for (int i = 0; i < 32; ++i) dp[i] = s[i] * (dp[i] - st.delta[acc_col(id, i)]) * scale;
    to_a_frags<T, kKvBr>(dp, dsa);
    wg::fence();
#pragma unroll
    for (int p = 0; p < PANELS; ++p) gemm_pb<T, kKvBr>(dk[p], dsa, q_tile + p * kQPanel);
    wg::commit();
}

// dst[0, n) += src[0, n) (f32, n bytes, a multiple of 16; both 16-byte aligned): one thread's
// asynchronous bulk reduce-add from shared into global memory, in L2, committed as a group.
__device__ __forceinline__ void bulk_reduce_add(float* dst, const float* src, uint32_t n) {
    asm volatile(
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
        "cp.async.bulk.commit_group;\n" ::"l"(dst),
        "r"(smem_addr(src)), "r"(n)
        : "memory");
}

// Waits until at most N of this thread's bulk groups still read their shared-memory source.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}

// Waits until all of this thread's bulk groups are complete.
__device__ __forceinline__ void bulk_wait_all() {
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

// Where query block qb of (batch b, query head h) keeps its dQ sums in dq_accum: 64 x 64 f32 in
// fragment order (see dq_fragment_index).
__device__ __forceinline__ float* dq_accum_block(const Args& a, int b, int h, int qb) {
    const int nqb = (a.seq + kKvBr - 1) / kKvBr;
    return a.dq_accum + ((static_cast<size_t>(b) * a.q_heads + h) * nqb + qb) * kDqBlock;
}
#endif

// The one-pass backward's dQ sums are kept in fragment order, so that the dQ warpgroup stores
// them to shared memory without bank conflicts and the reduce-add moves one contiguous block:
// column half hf (columns 32 hf .. 32 hf + 31), warp w, accumulator pair j of the half, lane l
// hold the float2 at ((hf * 4 + w) * 8 + j) * 32 + l, which is row 16 w + l / 4 + 8 (j % 2),
// columns 32 hf + 8 (j / 2) + 2 (l % 4) + {0, 1} of the block.
__host__ __device__ constexpr int dq_fragment_index(int hf, int warp, int j, int lane) {
    return ((hf * 4 + warp) * 8 + j) * 32 + lane;
}

// The deterministic (two-kernel) backward's dK/dV kernel. head_dim 128 (PANELS = 2): every tile
// two 64-wide panels, as in the forward; Sᵀ and dPᵀ sum the panels' products, dK and dV are two
// 64 x 64 accumulators each (one per panel of Q and dO): 128 of the 255 registers a thread may
// hold.
template <typename T, int WGS, int PANELS = 1>
__global__ void __launch_bounds__(128 * WGS, 1) dkdv_kernel(Args a) {
#if TILEARN_HAS_WGMMA
    constexpr int kThr = threads_of<WGS>();
    constexpr int kBc = 64 * WGS;  // keys per CTA
    T* sK = smem_tiles<T>();
    T* sV = sK + PANELS * kBc * kD;
    T* sQ = sV + PANELS * kBc * kD;  // kStages stages of (Q, dO)
    float* sF = reinterpret_cast<float*>(sQ + 2 * kStages * PANELS * kKvBr * kD);
    const WgIds id = wg_ids();
    const int seq = a.seq;
    const KeyBlock kbk = key_block<PANELS, kBc>(a);
    const int b = kbk.b, hk = kbk.hk, group = kbk.group, k0 = kbk.k0;
    const size_t kv_stride = kbk.kv_stride, kv_base = kbk.kv_base;
    const int qb_first = kbk.qb_first, nqb = kbk.nqb, steps = kbk.steps;
    auto load_step = [&](int step) {
        if (step < steps)
            load_q_stage<T, kThr, PANELS>(a, q_stage<T, PANELS>(sQ, sF, step), b,
                                          hk * group + step / nqb, qb_first + step % nqb, id.tid);
        cp_async_commit();
    };
#pragma unroll
    for (int p = 0; p < PANELS; ++p) {
        load_tile<T, kBc, kD, kThr>(sK + p * kBc * kD,
                                    static_cast<const T*>(a.k) + kv_base + p * kD, kv_stride, k0,
                                    seq, id.tid);
        load_tile<T, kBc, kD, kThr>(sV + p * kBc * kD,
                                    static_cast<const T*>(a.v) + kv_base + p * kD, kv_stride, k0,
                                    seq, id.tid);
    }
    load_step(0);

    const int key_wg = k0 + id.wgi * 64;  // the warpgroup's first key
    const uint32_t k_tile = smem_addr(sK + id.wgi * 64 * kD);
    const uint32_t v_tile = smem_addr(sV + id.wgi * 64 * kD);
    float dk[PANELS][32], dv[PANELS][32];
    fill(dk, 0.0f);
    fill(dv, 0.0f);
    for (int step = 0; step < steps; ++step) {
        cp_async_wait<0>();
        wg::fence_smem_for_async();
        __syncthreads();
        load_step(step + 1);
        const int q0 = (qb_first + step % nqb) * kKvBr;
        uint32_t dsa[kKvBr / 16][4];
        dkdv_products<T, PANELS, kBc>(q_stage<T, PANELS>(sQ, sF, step), k_tile, v_tile, key_wg,
                                      q0, seq, a.scale, id, dk, dv, dsa);
        wg::wait<0>();
    }
#pragma unroll
    for (int p = 0; p < PANELS; ++p) {
        wg::fence_regs(dk[p]);
        wg::fence_regs(dv[p]);
        store_acc<T>(static_cast<T*>(a.dk) + kv_base + p * kD, kv_stride, key_wg, seq, dk[p], id);
        store_acc<T>(static_cast<T*>(a.dv) + kv_base + p * kD, kv_stride, key_wg, seq, dv[p], id);
    }
#endif
}

// ---- one-pass backward, warp-specialised: two math warpgroups and a dQ warpgroup ----
// dkdv_kernel's steps (dkdv_products: dK and dV are the deterministic backward's bits) with dQ
// formed in the same pass, and the CTA's three warpgroups never meet at a barrier inside the
// loop (the one-pass kernel before it synchronised every step). Warpgroups 0 and 1 (the keys'
// rows, as in dkdv_kernel) form Sᵀ, dPᵀ, dV, dK and each step's dSᵀ; warpgroup 2 loads the query stages kWsLead steps ahead and forms each
// step's dQ = dS·K over all 128 keys and 64 columns (one m64n64 product instead of two
// m64n32 ones reading dS twice), stores it and adds it into dq_accum. Hand-offs are mbarriers in
// shared memory: `full` (a stage's Q, dO, lse and delta have landed: one cp.async arrival per
// thread of warpgroup 2, and with TMA one more from the thread that asks for the Q and dO boxes
// and sets the bytes to wait for), `empty` (both math warpgroups are done with a stage: one arrival per warp),
// `ds_full` / `ds_empty` (a step's dSᵀ tile written / read by the dQ products). ptxas fits the
// kernel in the launch's 168 registers a thread (no spills); the setmaxnreg requests below move
// physical registers to the math warpgroups at run time, not what ptxas allocates.

#if TILEARN_HAS_WGMMA
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count)
                 : "memory");
}

// A plain arrival (release: this thread's earlier shared-memory writes are seen by the waiters).
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

// An arrival made when this thread's earlier cp.async copies have landed (counted in the init
// count: .noinc).
__device__ __forceinline__ void mbar_arrive_on_copies(uint64_t* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar))
                 : "memory");
}

// Waits until the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred done;\nWAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n}\n" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
}

// One arrival per warp, after every lane's earlier work (lane 0 arrives).
__device__ __forceinline__ void mbar_arrive_warp(uint64_t* bar) {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbar_arrive(bar);
}

// The dQ warpgroup's own barrier (id 1; __syncthreads is 0).
__device__ __forceinline__ void dq_warpgroup_sync() {
    asm volatile("bar.sync 1, 128;\n" ::: "memory");
}

// Box (c0, c1, c2) of `map` into shared memory at `dst`, its bytes counted by `bar`.
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, int c0, int c1,
                                            int c2, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(smem_addr(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(bar))
        : "memory");
}

// This thread's arrival on `bar`, which then also waits for `bytes` bytes of copies.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
                 "r"(bytes)
                 : "memory");
}

constexpr int kWsLead = 3;  // steps the loads run ahead of the math (kWsStages - 1)
// setmaxnreg's registers per thread: 2 x 200 + 104 = 3 x 168, the launch's share.
constexpr int kWsMathRegs = 200;
constexpr int kWsDqRegs = 104;
#endif

constexpr int kWsStages = 4;              // query stages (Q, dO, lse, delta) in flight
constexpr int kWsKeys = 128;              // keys per CTA: two math warpgroups of 64
constexpr int kWsThreads = 3 * 128;

constexpr size_t dkdv_ws_smem() {
    return (2 * kWsKeys + 2 * kWsStages * kKvBr + 2 * kWsKeys) * kTile  // K, V; stages; 2 dSᵀ
           + 2 * kDqBlock * sizeof(float)                              // two dQ blocks
           + 2 * kWsStages * kKvBr * sizeof(float)                     // lse, delta per stage
           + (2 * kWsStages + 4) * sizeof(uint64_t) + kAlignSlack;
}

// Q and dO of one launch as [batch][seq][q_heads x 64] tensors, boxes of one head's 64 rows (a
// query stage of the one-pass backward).
struct QdoMaps {
    CUtensorMap q;
    CUtensorMap dout;
};

// kTma: the query stages' Q and dO tiles by TMA (one thread, their bytes counted by the stage's
// `full` barrier; `maps` describes them), lse and delta by cp.async as before (a value a thread;
// a TMA box of them would need seq to be a multiple of 4); else everything by cp.async and
// `maps` is unused. dK and dV are the same bits either way, dQ the same sums. Why: warpgroup 2
// shares the schedulers with the math warps, and the kernel issues on 56 % of cycles with one
// eligible warp (Nsight Compute, 1 x 16 K), so its 16 cp.async a step and their address
// arithmetic cost the math time; by TMA the backward takes 0.94-0.96 of the time (H200).
template <typename T, bool kTma>
__global__ void __launch_bounds__(kWsThreads, 1)
    dkdv_ws_kernel(Args a, const __grid_constant__ QdoMaps maps) {
#if TILEARN_HAS_WGMMA
    static_assert(kWsLead == kWsStages - 1, "the loads run one stage short of the buffers ahead");
    constexpr uint32_t kQdoBytes = 2 * kKvBr * kD * sizeof(T);  // a stage's Q and dO boxes
    constexpr int kBc = kWsKeys;
    T* sK = smem_tiles<T>();
    T* sV = sK + kBc * kD;
    T* sQ = sV + kBc * kD;                      // kWsStages stages of (Q, dO)
    T* sDs = sQ + 2 * kWsStages * kKvBr * kD;   // two dSᵀ tiles [kBc keys][64 queries]
    float* sDq = reinterpret_cast<float*>(sDs + 2 * kBc * kD);  // two dQ blocks
    float* sF = sDq + 2 * kDqBlock;             // each stage's lse (natural units) and delta
    uint64_t* full = reinterpret_cast<uint64_t*>(sF + 2 * kWsStages * kKvBr);
    uint64_t* empty = full + kWsStages;
    uint64_t* ds_full = empty + kWsStages;
    uint64_t* ds_empty = ds_full + 2;
    const WgIds id = wg_ids();
    const int seq = a.seq;
    const KeyBlock kbk = key_block<1, kBc>(a);
    const int b = kbk.b, hk = kbk.hk, group = kbk.group, k0 = kbk.k0;
    const size_t kv_stride = kbk.kv_stride, kv_base = kbk.kv_base;
    const int qb_first = kbk.qb_first, nqb = kbk.nqb, steps = kbk.steps;

    if (id.tid == 0) {
        for (int s = 0; s < kWsStages; ++s) {
            // Every loading thread's cp.async arrival, and with TMA one more that sets the
            // bytes expected.
            mbar_init(&full[s], kTma ? 129 : 128);
            mbar_init(&empty[s], 8);
        }
        for (int p = 0; p < 2; ++p) {
            mbar_init(&ds_full[p], 8);
            mbar_init(&ds_empty[p], 4);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (id.wgi == 2) {
        // ---- the loads and the dQ products ----
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kWsDqRegs));
        const int tid = id.tid - 256;
        load_tile<T, kBc, kD, 128>(sK, static_cast<const T*>(a.k) + kv_base, kv_stride, k0, seq,
                                   tid);
        load_tile<T, kBc, kD, 128>(sV, static_cast<const T*>(a.v) + kv_base, kv_stride, k0, seq,
                                   tid);
        cp_async_commit();
        // Step j's stage; `full` completes when every thread's cp.async copies have landed
        // (and, with TMA, the Q and dO boxes' bytes).
        auto produce = [&](int j) {
            const int s = j % kWsStages;
            if (j >= kWsStages) mbar_wait(&empty[s], ((j / kWsStages) - 1) & 1);
            const QStage<T> st = q_stage<T, 1, kWsStages>(sQ, sF, j);
            const int h = hk * group + j / nqb, qb = qb_first + j % nqb;
            if constexpr (kTma) {
                if (tid == 0) {
                    mbar_arrive_expect_tx(&full[s], kQdoBytes);
                    tma_load_3d(st.q, &maps.q, h * kD, qb * kKvBr, b, &full[s]);
                    tma_load_3d(st.dout, &maps.dout, h * kD, qb * kKvBr, b, &full[s]);
                }
                __syncwarp();
                load_lse_delta(a, st, b, h, qb, tid);
            } else {
                load_q_stage<T, 128, 1>(a, st, b, h, qb, tid);
            }
            cp_async_commit();
            mbar_arrive_on_copies(&full[s]);
        };
        // kWsLead groups after K and V's, empty ones past the last step, so that the wait
        // below is for K and V alone.
        for (int j = 0; j < kWsLead; ++j) {
            if (j < steps) produce(j);
            else cp_async_commit();
        }
        cp_async_wait<kWsLead>();
        wg::fence_smem_for_async();
        __syncthreads();  // K and V visible to every warpgroup

        const uint32_t k_all = smem_addr(sK);
        const int warp = (tid >> 5) & 3;
        for (int j = 0; j < steps; ++j) {
            if (j + kWsLead < steps) produce(j + kWsLead);
            mbar_wait(&ds_full[j & 1], (j >> 1) & 1);
            const uint32_t ds_tile = smem_addr(sDs + (j & 1) * kBc * kD);
            float dq[32];
            wg::fence();
#pragma unroll
            for (int kk = 0; kk < kBc / 16; ++kk)
                wg::wgmma_ss<T, 1, 1>(dq, wg::desc_mn_major(ds_tile, kk),
                                      wg::desc_mn_major(k_all, kk), kk > 0);
            wg::commit();
            wg::wait<0>();
            wg::fence_regs(dq);
            mbar_arrive_warp(&ds_empty[j & 1]);
            // The add of step j - 2 has read sDq[j % 2]; then every thread writes its 16 pairs
            // in dq_fragment_index order (pair p is column half p / 8, pair p % 8 of that half).
            if (tid == 0) bulk_wait_read<1>();
            dq_warpgroup_sync();
            float2* out = reinterpret_cast<float2*>(sDq + (j & 1) * kDqBlock);
#pragma unroll
            for (int p = 0; p < 16; ++p)
                out[dq_fragment_index(p >> 3, warp, p & 7, tid & 31)] =
                    make_float2(dq[2 * p], dq[2 * p + 1]);
            wg::fence_smem_for_async();
            dq_warpgroup_sync();
            if (tid == 0)
                bulk_reduce_add(
                    dq_accum_block(a, b, hk * group + j / nqb, qb_first + j % nqb),
                    sDq + (j & 1) * kDqBlock, kDqBlock * sizeof(float));
        }
        if (tid == 0) bulk_wait_all();
        return;
    }

    // ---- the math warpgroups: dK and dV of their 64 keys ----
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kWsMathRegs));
    __syncthreads();  // K and V visible
    const int key_wg = k0 + id.wgi * 64;
    const uint32_t k_tile = smem_addr(sK + id.wgi * 64 * kD);
    const uint32_t v_tile = smem_addr(sV + id.wgi * 64 * kD);
    float dk[1][32], dv[1][32];
    fill(dk, 0.0f);
    fill(dv, 0.0f);
    for (int j = 0; j < steps; ++j) {
        const int stage = j % kWsStages;
        mbar_wait(&full[stage], (j / kWsStages) & 1);
        wg::fence_smem_for_async();  // the landed copies, for wgmma
        const int q0 = (qb_first + j % nqb) * kKvBr;
        uint32_t dsa[kKvBr / 16][4];
        dkdv_products<T, 1, kBc>(q_stage<T, 1, kWsStages>(sQ, sF, j), k_tile, v_tile, key_wg, q0,
                                 seq, a.scale, id, dk, dv, dsa);
        // dSᵀ, rounded as dK's operand, into this warpgroup's rows of sDs[j % 2] once the dQ
        // products of step j - 2 have read it.
        if (j >= 2) mbar_wait(&ds_empty[j & 1], ((j >> 1) - 1) & 1);
        T* ds_out = sDs + (j & 1) * kBc * kD;
#pragma unroll
        for (int kk = 0; kk < kKvBr / 16; ++kk)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int i = 8 * kk + 2 * q;
                const int c = acc_col(id, i);
                *reinterpret_cast<uint32_t*>(
                    ds_out + swz<kD>(id.wgi * 64 + id.wrow + acc_row(id, i), c >> 3) + (c & 7)) =
                    dsa[kk][q];
            }
        wg::fence_smem_for_async();
        mbar_arrive_warp(&ds_full[j & 1]);
        wg::wait<0>();
        mbar_arrive_warp(&empty[stage]);  // this warp is done with the stage
    }
    wg::fence_regs(dk[0]);
    wg::fence_regs(dv[0]);
    store_acc<T>(static_cast<T*>(a.dk) + kv_base, kv_stride, key_wg, seq, dk[0], id);
    store_acc<T>(static_cast<T*>(a.dv) + kv_base, kv_stride, key_wg, seq, dv[0], id);
#endif
}

// ---- forward with TMA loads (head_dim 64, the default; TILEARN_FLASH_SM90_FWD_TMA=0 keeps
// fwd_kernel) ----
// fwd_kernel's CTA, step and products, with each K / V block brought in by the Tensor Memory
// Accelerator: one thread asks for the two 128 x 64 boxes (already in the 128-byte swizzle the
// wgmma descriptors read) and an mbarrier counts their bytes, instead of every thread issuing
// 16 cp.async and their address arithmetic a step. Keys past seq come in as zeros (the tensor
// maps' bounds are each batch entry's sequence), as load_kv's zero fill. The forward is bound by
// instruction issue (Nsight Compute: 57 % of issue slots, one eligible warp of three), so the
// loads' instructions were worth removing: ptxas 154 registers (fwd_kernel 167), no spills;
// out and lse bit-identical to fwd_kernel's.

// K and V of one launch as [batch][seq][kv_heads x 64] tensors, boxes of one head's 128 rows.
struct KvMaps {
    CUtensorMap k;
    CUtensorMap v;
};


// fwd_kernel's tiles and the two stages' mbarriers.
constexpr size_t fwd_tma_smem() { return fwd_smem<1>() + kFwdStages * sizeof(uint64_t); }

template <typename T>
__global__ void __launch_bounds__(128, kFwdCtasPerSm)
    fwd_tma_kernel(Args a, const __grid_constant__ KvMaps maps) {
#if TILEARN_HAS_WGMMA
    constexpr int kBc = kFwdBc;
    constexpr uint32_t kStageBytes = 2 * kBc * kD * sizeof(T);  // a K and a V box
    T* sQ = smem_tiles<T>();
    T* sK = sQ + 64 * kD;
    T* sV = sK + kFwdStages * kBc * kD;
    uint64_t* full = reinterpret_cast<uint64_t*>(sV + kFwdStages * kBc * kD);
    const WgIds id = wg_ids();
    const int seq = a.seq;
    const QueryBlock<T> blk = query_block<T, kD, 64, kBc>(a);
    const int q0 = blk.q0, nkb = blk.nkb;
    const int hk = blk.h / (a.q_heads / a.kv_heads);
    if (id.tid == 0) {
        for (int st = 0; st < kFwdStages; ++st) mbar_init(&full[st], 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    // Block kb into buffer kb % kFwdStages (one thread; nothing past the last block).
    auto load = [&](int kb) {
        if (id.tid != 0 || kb >= nkb) return;
        uint64_t* bar = &full[kb % kFwdStages];
        mbar_arrive_expect_tx(bar, kStageBytes);
        tma_load_3d(sK + (kb % kFwdStages) * kBc * kD, &maps.k, hk * kD, kb * kBc, blk.b, bar);
        tma_load_3d(sV + (kb % kFwdStages) * kBc * kD, &maps.v, hk * kD, kb * kBc, blk.b, bar);
    };
    load_tile<T, 64, kD, 128>(sQ, static_cast<const T*>(a.q) + blk.q_base, blk.q_stride, q0, seq,
                              id.tid);
    cp_async_commit();
    load(0);
    cp_async_wait<0>();
    wg::fence_smem_for_async();

    const uint32_t q_tile = smem_addr(sQ);
    const float sl2 = a.scale * kLog2e;
    float o[1][32];
    float row_max[2] = {-INFINITY, -INFINITY};
    float row_sum[2] = {0.0f, 0.0f};
    fill(o, 0.0f);

    for (int kb = 0; kb < nkb; ++kb) {
        // Every thread is past step kb - 1, whose products are complete: the buffer of block
        // kb + 1 (read at step kb - 1) is free, and (at kb = 0) Q is visible to wgmma.
        __syncthreads();
        load(kb + 1);
        mbar_wait(&full[kb % kFwdStages], (kb / kFwdStages) & 1);
        const uint2 tiles = make_uint2(smem_addr(sK + (kb % kFwdStages) * kBc * kD),
                                       smem_addr(sV + (kb % kFwdStages) * kBc * kD));
        fwd_step<T, 1>(o, row_max, row_sum, q_tile, 0, tiles, kb * kBc, q0, sl2, id);
    }

    fwd_store<T, 1>(a, blk, o, row_max, row_sum, q0, id);
#endif
}

// ---- one-pass backward: dq from dq_accum ----
// One CTA per (64-query block, batch, query head): the block's 64 x 64 f32 sums (fragment
// order, see dq_fragment_index) through shared memory into rows of dq, rounded once to T.

constexpr int kConvThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kConvThreads) dq_from_accum_kernel(Args a) {
    __shared__ float tile[kKvBr][kD + 4];  // +4: the row-major reads below conflict-free
    const int nqb = (a.seq + kKvBr - 1) / kKvBr;
    const int qb = static_cast<int>(blockIdx.x % static_cast<unsigned>(nqb));
    const int bh = static_cast<int>(blockIdx.x / static_cast<unsigned>(nqb));
    const float2* src = reinterpret_cast<const float2*>(a.dq_accum) +
                        static_cast<size_t>(blockIdx.x) * (kDqBlock / 2);
    for (int p = threadIdx.x; p < kDqBlock / 2; p += kConvThreads) {
        const float2 v = src[p];
        // p = dq_fragment_index(hf, warp, j, lane), taken apart.
        static_assert(dq_fragment_index(1, 2, 5, 9) == (1 << 10 | 2 << 8 | 5 << 5 | 9));
        const int lane = p & 31, j = (p >> 5) & 7, warp = (p >> 8) & 3, hf = p >> 10;
        const int row = 16 * warp + (lane >> 2) + 8 * (j & 1);
        const int col = 32 * hf + 8 * (j >> 1) + 2 * (lane & 3);
        tile[row][col] = v.x;
        tile[row][col + 1] = v.y;
    }
    __syncthreads();
    const int row = threadIdx.x >> 2;
    const int c0 = (threadIdx.x & 3) * 16;
    const int t = qb * kKvBr + row;
    if (t >= a.seq) return;
    const int b = bh / a.q_heads, h = bh % a.q_heads;
    T* dst = static_cast<T*>(a.o_or_dq) +
             ((static_cast<size_t>(b) * a.seq + t) * a.q_heads + h) * kD + c0;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        uint4 v;
        const float* x = &tile[row][c0 + 8 * half];
        v.x = pack2<T>(x[0], x[1]);
        v.y = pack2<T>(x[2], x[3]);
        v.z = pack2<T>(x[4], x[5]);
        v.w = pack2<T>(x[6], x[7]);
        reinterpret_cast<uint4*>(dst)[half] = v;
    }
}

// ---- launch ----

template <typename K, typename... Extra>
cudaError_t launch(K kernel, size_t blocks, int threads, size_t smem, const Args& a,
                   cudaStream_t stream, const Extra&... extra) {
    if (blocks == 0 || blocks > 0x7fffffffu) return cudaErrorInvalidValue;
    const cudaError_t e = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e != cudaSuccess) return e;
    kernel<<<static_cast<unsigned>(blocks), threads, smem, stream>>>(a, extra...);
    return cudaGetLastError();
}

// cuTensorMapEncodeTiled, looked up in the driver once (null where the driver lacks it).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
    static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                             cudaEnableDefault, &found) != cudaSuccess ||
            found != cudaDriverEntryPointSuccess)
            fn = nullptr;
        return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    }();
    return encode;
}

// `base` ([batch][seq][heads x 64] of T: q, k, v or dout) as TMA boxes of 64 x `rows` (one
// head's block of tokens) in the 128-byte swizzle; rows past seq read as zeros. False if the
// driver cannot encode it (or `base` is not 16-byte aligned).
template <typename T>
bool rows_tensor_map(CUtensorMap* map, const void* base, int heads, cuuint32_t rows,
                     const Args& a) {
    const auto encode = tensor_map_encoder();
    if (encode == nullptr) return false;
    const cuuint64_t row = static_cast<cuuint64_t>(heads) * kD;
    const cuuint64_t dims[3] = {row, static_cast<cuuint64_t>(a.seq),
                                static_cast<cuuint64_t>(a.batch)};
    const cuuint64_t strides[2] = {row * sizeof(T), row * a.seq * sizeof(T)};
    const cuuint32_t box[3] = {kD, rows, 1};
    const cuuint32_t unit[3] = {1, 1, 1};
    const CUtensorMapDataType type = std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                                : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    return encode(map, type, 3, const_cast<void*>(base), dims, strides, box, unit,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// How a head_dim-64 kernel loads its streamed tiles, read from `var`
// (TILEARN_FLASH_SM90_FWD_TMA: the forward's K and V; TILEARN_FLASH_SM90_BWD_TMA: the one-pass
// backward's Q and dO): unset, TMA where the driver encodes the tensor maps, else cp.async;
// `0`, cp.async (the same bits); `1`, TMA or an error (tests and benchmarks that must know which
// kernel ran).
enum class TmaLoads { Auto, CpAsync, Tma };

TmaLoads tma_loads(const char* var) {
    const char* v = std::getenv(var);
    if (v == nullptr || v[0] == '\0') return TmaLoads::Auto;
    return v[0] == '0' ? TmaLoads::CpAsync : TmaLoads::Tma;
}

// The one-pass backward's dK/dV/dQ kernel, its Q and dO by TMA unless `tma_loads` says cp.async.
// TMA: 0.94 of the cp.async kernel's time at 1 x 16 K (6.27 against 6.71 ms in gemm-bench),
// 0.96 at TinyLlama's shape, the same at llama-134m's (H200, same call).
template <typename T>
cudaError_t launch_dkdv_ws(const Args& a, cudaStream_t stream) {
    const size_t blocks =
        (a.seq + kWsKeys - 1) / kWsKeys * static_cast<size_t>(a.batch) * a.kv_heads;
    QdoMaps maps{};
    if (const TmaLoads loads = tma_loads("TILEARN_FLASH_SM90_BWD_TMA");
        loads != TmaLoads::CpAsync) {
        if (rows_tensor_map<T>(&maps.q, a.q, a.q_heads, kKvBr, a) &&
            rows_tensor_map<T>(&maps.dout, a.dout, a.q_heads, kKvBr, a))
            return launch(dkdv_ws_kernel<T, true>, blocks, kWsThreads, dkdv_ws_smem(), a, stream,
                          maps);
        if (loads == TmaLoads::Tma) return cudaErrorNotSupported;
    }
    return launch(dkdv_ws_kernel<T, false>, blocks, kWsThreads, dkdv_ws_smem(), a, stream, maps);
}

// Measured on an H200 (bf16, head_dim 64, forward / backward ms, mma.sync kernels in brackets):
// TinyLlama's shape (8 x 2048, 32/4 heads): one-warpgroup forward 0.455 (0.489), two-warpgroup
// 0.519; two-warpgroup backward 1.229 (1.836), one-warpgroup 1.277. Hence the choice below.
// One-pass backward (harness, 2026-12-03): warp-specialised 1.078 ms at TinyLlama's shape and
// 7.54 at 1 x 16 K, against 1.231 and 8.17 for the earlier kernel whose two warpgroups formed dQ
// between a barrier per step, and 1.292 and 9.39 for the two-kernel backward.
constexpr int kFwdWgs = 1;
constexpr int kBwdWgs = 2;

template <typename T>
cudaError_t run(bool backward, size_t head_dim, const Args& a, cudaStream_t stream) {
    const size_t q_rows = static_cast<size_t>(a.batch) * a.q_heads;
    const size_t kv_rows = static_cast<size_t>(a.batch) * a.kv_heads;
    if (!backward) {
        const size_t blocks = (a.seq + 64 * kFwdWgs - 1) / (64 * kFwdWgs) * q_rows;
        if (head_dim == 2 * kD)
            return launch(fwd_kernel<T, kFwdWgs, 2>, blocks, threads_of<kFwdWgs>(),
                          fwd_smem<kFwdWgs, 2>(), a, stream);
        // TMA loads: 0.86 of fwd_kernel's time at 1 x 16 K, 0.86 at TinyLlama's shape, 0.91 at
        // llama-134m's (H200, harness, the same bits).
        if (const TmaLoads loads = tma_loads("TILEARN_FLASH_SM90_FWD_TMA");
            loads != TmaLoads::CpAsync) {
            KvMaps maps;
            if (rows_tensor_map<T>(&maps.k, a.k, a.kv_heads, kFwdBc, a) &&
                rows_tensor_map<T>(&maps.v, a.v, a.kv_heads, kFwdBc, a))
                return launch(fwd_tma_kernel<T>, blocks, 128, fwd_tma_smem(), a, stream, maps);
            if (loads == TmaLoads::Tma) return cudaErrorNotSupported;
        }
        return launch(fwd_kernel<T, kFwdWgs>, blocks, threads_of<kFwdWgs>(), fwd_smem<kFwdWgs>(),
                      a, stream);
    }
    const size_t blocks_per_head = (a.seq + 64 * kBwdWgs - 1) / (64 * kBwdWgs);
    if (head_dim == 2 * kD) {
        // head_dim 128: the two-kernel backward (one_pass_applies is false, so no caller lends
        // dq_accum here; were one given, it is left alone). dK/dV: 242 registers, 166 KB of
        // shared memory; dQ: 162 registers, 165 KB; no spills. H200, 1 x 4096 with 32/32 heads:
        // 0.953 ms against mma.sync's 1.735 (cuDNN's backward 0.971). One pass would need
        // dQ's 32 more accumulators beside dK and dV's 128 and more shared memory than the SM has
        // (the two dQ blocks double to 64 KB): not built.
        const cudaError_t e =
            launch(dkdv_kernel<T, kBwdWgs, 2>, blocks_per_head * kv_rows,
                   threads_of<kBwdWgs>(), dkdv_smem<kBwdWgs, 2>(), a, stream);
        if (e != cudaSuccess) return e;
        return launch(dq_kernel<T, kBwdWgs, 2>, blocks_per_head * q_rows, threads_of<kBwdWgs>(),
                      dq_smem<kBwdWgs, 2>(), a, stream);
    }
    if (head_dim != static_cast<size_t>(kD)) return cudaErrorInvalidValue;
    if (a.dq_accum != nullptr) {
        // One pass: dK, dV and the dQ sums, then dq from the sums.
        const size_t q_blocks = (a.seq + kKvBr - 1) / kKvBr * q_rows;
        cudaError_t e =
            cudaMemsetAsync(a.dq_accum, 0, q_blocks * kDqBlock * sizeof(float), stream);
        if (e != cudaSuccess) return e;
        e = launch_dkdv_ws<T>(a, stream);
        if (e != cudaSuccess) return e;
        return launch(dq_from_accum_kernel<T>, q_blocks, kConvThreads, 0, a, stream);
    }
    const cudaError_t e = launch(dkdv_kernel<T, kBwdWgs>, blocks_per_head * kv_rows,
                                 threads_of<kBwdWgs>(), dkdv_smem<kBwdWgs>(), a, stream);
    if (e != cudaSuccess) return e;
    return launch(dq_kernel<T, kBwdWgs>, blocks_per_head * q_rows, threads_of<kBwdWgs>(),
                  dq_smem<kBwdWgs>(), a, stream);
}

// Whether the environment variable `name` is set to something other than "" or "0". Read at
// every launch (a getenv, far below a launch's cost) so that a benchmark can switch.
bool env_flag(const char* name) {
    const char* v = std::getenv(name);
    return v != nullptr && v[0] != '\0' && v[0] != '0';
}

// TILEARN_FLASH_SM80=1 keeps the mma.sync kernels on Hopper too (comparisons, or a way out).
bool forced_off() { return env_flag("TILEARN_FLASH_SM80"); }

// head_dim 128 runs on the wgmma kernels (forward and the two-kernel backward) unless
// TILEARN_FLASH_SM90_HD128=0 keeps it on mma.sync (comparisons, or a way out).
bool hd128_on() {
    const char* v = std::getenv("TILEARN_FLASH_SM90_HD128");
    return v == nullptr || v[0] != '0';
}

// Whether `device` is compute capability 9.0, asked of the driver once per device (attention
// launches 44 times a TinyLlama step). Cached as 0 unknown, 1 no, 2 yes; racing first calls
// store the same answer.
bool is_sm90(int device) {
    constexpr int kCachedDevices = 64;
    static std::atomic<int> cache[kCachedDevices];
    if (device >= 0 && device < kCachedDevices) {
        const int known = cache[device].load(std::memory_order_relaxed);
        if (known != 0) return known == 2;
    }
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess)
        return false;
    const bool yes = major == 9 && minor == 0;
    if (device >= 0 && device < kCachedDevices)
        cache[device].store(yes ? 2 : 1, std::memory_order_relaxed);
    return yes;
}

}  // namespace

namespace tilearn::flash {

bool sm90_applies(int dtype, size_t head_dim, bool masked) {
    const bool shape =
        head_dim == static_cast<size_t>(kD) || (head_dim == static_cast<size_t>(2 * kD) && hd128_on());
    if (masked || !shape || forced_off()) return false;
    if (dtype != TILEARN_DTYPE_BF16 && dtype != TILEARN_DTYPE_F16) return false;
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return false;
    return is_sm90(device);
}

bool sm90_one_pass_applies(int dtype, size_t head_dim, bool masked) {
    return head_dim == static_cast<size_t>(kD) && sm90_applies(dtype, head_dim, masked);
}

int sm90_run(int dtype, bool backward, size_t head_dim, const Args& a, cudaStream_t stream) {
    cudaError_t e = cudaErrorInvalidValue;
    if (dtype == TILEARN_DTYPE_BF16) e = run<__nv_bfloat16>(backward, head_dim, a, stream);
    if (dtype == TILEARN_DTYPE_F16) e = run<__half>(backward, head_dim, a, stream);
    return static_cast<int>(e);
}

}  // namespace tilearn::flash
