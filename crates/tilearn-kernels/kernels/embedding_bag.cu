// embedding_bag.cu: the fused multi-table embedding bag of tilearn-recsys (FBGEMM-style
// table-batched embeddings): the pooled forward, and the backward fused with a sparse optimizer
// that updates every touched row in place.
//
//   forward:  out[b, col_t + c] = scale_t(len) * sum_{j in bag(t, b)} W[row(t, ids[j]), c]
//   backward: g_r = 0 + sum over the chunks of row r's run (its entries in entry order, cut
//             into chunks of TILEARN_BAG_GRAD_CHUNK = 32 from the run's start), in chunk order,
//             of the chunk's sum from 0 in entry order of dout[b_j, col_t + c] * scale;
//             row r updated by the rule (SGD, row-wise Adagrad or SparseAdam) from g_r.
//
// Fused:     forward: gather + pooling + the mean's scale, one pass, no intermediate. Backward:
//            (1) a kernel writes each entry's stacked-row key (row_base_t + id) and its bag;
//            (2) CUB's stable radix sort orders the bags by key (entry order kept within a
//            key); (3) CUB's run-length encode gives each distinct row's run, and one exclusive
//            scan of (count, scratch chunks) packed in a u64 its first entry and first chunk;
//            (4) phase A: one warp per chunk of a run longer than one chunk writes the chunk's
//            sum into a scratch row, so a zipf-hot row with thousands of entries is summed by
//            many warps instead of serialising one; (5) phase B: one group of lanes per
//            distinct row (a power of two >= 4 covering the widest row in float4s: 8 rows per
//            warp at dim 16) adds its chunk sums in chunk order (a one-chunk run: its entries
//            directly) and applies the optimizer to the row and its state in place. Entries
//            (sample, pooling scale) are staged in shared memory with one load per lane, so
//            the sums issue independent dout loads. Row-wise Adagrad keeps the gradient in
//            registers between its two passes for dim <= 512 (float4) / 128 (scalar). No dense
//            gradient of a table is materialised; the scratch is about entries * (32 + max_dim / 4)
//            bytes (the chunk sums: at most 2 * entries / 33 rows of max_dim floats).
// Layout:    weights: one flat f32 buffer, table after table, each [rows_t, dim_t] row-major;
//            tables: TILEARN_BAG_TABLE_WORDS u32 per table (header); offsets: [T * B + 1] u32,
//            table-major (bag t * B + b); ids: [entries] u32 row numbers inside their table;
//            out / dout: [B, total_dim] f32, table t at columns col_t .. col_t + dim_t. Row
//            state: row-wise Adagrad one f32 per stacked row, Adam two f32 per weight element.
//            A lane moves 16 bytes (float4) when the table's dim, weight offset, column offset
//            and total_dim are multiples of 4; one f32 otherwise.
// Precision: f32 storage and arithmetic; every multiply and add is rounded separately
//            (__fmul_rn / __fadd_rn: no FMA contraction), division and sqrt are IEEE (no fast
//            math), in the order of tilearn-recsys' CPU reference, so the forward, SGD and
//            SparseAdam match it bit for bit; row-wise Adagrad's sum of squares is an xor tree
//            over the row's lanes (differs from the CPU's serial sum by rounding only).
// Output:    forward writes out (=). Backward+update overwrites touched weight rows and their
//            state in place (=); untouched rows and state are not accessed. Deterministic: no
//            float atomics, each chunk sum and each row is owned by one warp or lane group,
//            which adds in the fixed order above, so reruns are bit-identical. Ids outside their table (which
//            the Rust wrappers rule out) are skipped, never read or written out of bounds.

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_run_length_encode.cuh>
#include <cub/device/device_scan.cuh>

#include "tilearn_kernels.h"

namespace {

constexpr unsigned kThreads = 256;
constexpr unsigned kWarpsPerBlock = kThreads / 32;
constexpr size_t kScratchAlign = 256;

struct Table {
    uint32_t rows, dim, pooling, col, row_base;
    size_t weight_offset;
    bool vec4;  // 16-byte accesses possible for this table
};

__device__ __forceinline__ Table load_table(const uint32_t* __restrict__ tables, size_t t,
                                            size_t total_dim) {
    const uint32_t* w = tables + t * TILEARN_BAG_TABLE_WORDS;
    Table tab;
    tab.rows = w[TILEARN_BAG_TABLE_ROWS];
    tab.dim = w[TILEARN_BAG_TABLE_DIM];
    tab.pooling = w[TILEARN_BAG_TABLE_POOLING];
    tab.col = w[TILEARN_BAG_TABLE_COL_OFFSET];
    tab.row_base = w[TILEARN_BAG_TABLE_ROW_BASE];
    tab.weight_offset = static_cast<size_t>(w[TILEARN_BAG_TABLE_WEIGHT_OFFSET_LO]) |
                        (static_cast<size_t>(w[TILEARN_BAG_TABLE_WEIGHT_OFFSET_HI]) << 32);
    tab.vec4 = tab.dim % 4 == 0 && tab.weight_offset % 4 == 0 && tab.col % 4 == 0 &&
               total_dim % 4 == 0;
    return tab;
}

// The pooling factor of a bag of len entries, as tilearn_recsys::Pooling::scale.
__device__ __forceinline__ float pooling_scale(uint32_t pooling, uint32_t len) {
    if (pooling == TILEARN_POOLING_SUM) return 1.0f;
    return len == 0 ? 0.0f : __fdiv_rn(1.0f, static_cast<float>(len));
}

template <int kVec>
struct Vec {
    float v[kVec];
};

template <int kVec>
__device__ __forceinline__ Vec<kVec> load(const float* p) {
    Vec<kVec> r;
    if constexpr (kVec == 4) {
        const float4 x = *reinterpret_cast<const float4*>(p);
        r.v[0] = x.x; r.v[1] = x.y; r.v[2] = x.z; r.v[3] = x.w;
    } else {
        r.v[0] = *p;
    }
    return r;
}

template <int kVec>
__device__ __forceinline__ void store(float* p, const Vec<kVec>& r) {
    if constexpr (kVec == 4) {
        *reinterpret_cast<float4*>(p) = make_float4(r.v[0], r.v[1], r.v[2], r.v[3]);
    } else {
        *p = r.v[0];
    }
}

// Lanes that serve one bag of a table: enough to cover its row once (a power of two <= 32),
// so a dim-16 table packs 8 bags into a warp instead of idling 28 lanes.
__device__ __forceinline__ unsigned lanes_for(const Table& tab) {
    const unsigned packs = tab.vec4 ? tab.dim / 4 : tab.dim;
    unsigned lanes = 1;
    while (lanes < 32 && lanes < packs) lanes <<= 1;
    return lanes;
}

template <int kVec>
__device__ void pool_bag(const float* __restrict__ weights, const Table& tab,
                         const uint32_t* __restrict__ ids, uint32_t begin, uint32_t end,
                         unsigned lane, unsigned lanes, float* __restrict__ out_row) {
    const float scale = pooling_scale(tab.pooling, end - begin);
    for (uint32_t c = lane * kVec; c < tab.dim; c += lanes * kVec) {
        Vec<kVec> acc;
#pragma unroll
        for (int k = 0; k < kVec; ++k) acc.v[k] = 0.0f;
        for (uint32_t j = begin; j < end; ++j) {
            const uint32_t id = ids[j];
            if (id >= tab.rows) continue;  // unreachable through the Rust wrappers
            const Vec<kVec> w =
                load<kVec>(weights + tab.weight_offset + static_cast<size_t>(id) * tab.dim + c);
#pragma unroll
            for (int k = 0; k < kVec; ++k) acc.v[k] = __fadd_rn(acc.v[k], w.v[k]);
        }
#pragma unroll
        for (int k = 0; k < kVec; ++k) acc.v[k] = __fmul_rn(acc.v[k], scale);
        store<kVec>(out_row + tab.col + c, acc);
    }
}

// Grid: (x: groups of bags, y: table). Block: kThreads lanes in groups of lanes_for(table).
__global__ void forward_kernel(const float* __restrict__ weights,
                               const uint32_t* __restrict__ tables, size_t total_dim,
                               const uint32_t* __restrict__ offsets,
                               const uint32_t* __restrict__ ids, size_t batch,
                               float* __restrict__ out) {
    const size_t t = blockIdx.y;
    const Table tab = load_table(tables, t, total_dim);
    const unsigned lanes = lanes_for(tab);
    const size_t b = static_cast<size_t>(blockIdx.x) * (kThreads / lanes) + threadIdx.x / lanes;
    if (b >= batch) return;
    const unsigned lane = threadIdx.x % lanes;
    const size_t bag = t * batch + b;
    float* out_row = out + b * total_dim;
    if (tab.vec4)
        pool_bag<4>(weights, tab, ids, offsets[bag], offsets[bag + 1], lane, lanes, out_row);
    else
        pool_bag<1>(weights, tab, ids, offsets[bag], offsets[bag + 1], lane, lanes, out_row);
}

// ---- backward ----

// Entries per chunk of a row's run: the summation order documented in tilearn_kernels.h. A
// warp stages a chunk's entries in one step, one lane per entry.
constexpr uint32_t kChunk = TILEARN_BAG_GRAD_CHUNK;
static_assert(kChunk == 32, "a chunk's entries are staged one per lane of a warp");
// Row-wise Adagrad keeps each lane's gradient columns in registers between its two passes
// (instead of summing the run again) while dim <= 32 lanes * vector width * kRegSlots.
constexpr int kRegSlots = 4;
// Phase B serves a distinct row with a group of lanes: a power of two from kMinGroupLanes to 32
// covering the widest table's row once in float4s (so dim-16 tables put 8 rows in a warp
// instead of idling 28 lanes; millions of distinct rows make phase B throughput-bound).
constexpr unsigned kMinGroupLanes = 4;  // bounds the shared staging: kThreads / 4 groups

unsigned group_lanes(size_t max_dim) {
    unsigned lanes = kMinGroupLanes;
    while (lanes < 32 && lanes * 4 < max_dim) lanes <<= 1;
    return lanes;
}

// The chunks of a run of n entries that go through the partial-sum scratch: a run of one chunk
// is summed directly by its row's warp, without scratch.
__host__ __device__ __forceinline__ uint32_t scratch_chunks(uint32_t n) {
    return n > kChunk ? (n + kChunk - 1) / kChunk : 0;
}

// An upper bound of the scratch chunks of `entries` entries: a run of n > K entries has
// ceil(n / K) <= 2n / (K + 1) chunks, so all runs together have at most 2 * entries / (K + 1).
size_t max_scratch_chunks(size_t entries) { return 2 * entries / (kChunk + 1); }

// One thread per bag: its entries' sort keys (stacked row, or the sentinel total_rows for an
// id outside its table) and bag numbers, the sort's values: the stable sort keeps entry order
// within a key, and the bag is all the update needs of an entry.
__global__ void keys_kernel(const uint32_t* __restrict__ tables, size_t num_tables,
                            size_t total_rows, const uint32_t* __restrict__ offsets,
                            const uint32_t* __restrict__ ids, size_t batch,
                            uint32_t* __restrict__ keys, uint32_t* __restrict__ bags) {
    const size_t num_bags = num_tables * batch;
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    for (size_t bag = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; bag < num_bags;
         bag += stride) {
        const uint32_t* w = tables + (bag / batch) * TILEARN_BAG_TABLE_WORDS;
        const uint32_t rows = w[TILEARN_BAG_TABLE_ROWS];
        const uint32_t base = w[TILEARN_BAG_TABLE_ROW_BASE];
        for (uint32_t j = offsets[bag]; j < offsets[bag + 1]; ++j) {
            const uint32_t id = ids[j];
            keys[j] = id < rows ? base + id : static_cast<uint32_t>(total_rows);
            bags[j] = static_cast<uint32_t>(bag);
        }
    }
}

// One thread per run: its entry count (low 32 bits) and scratch chunk count (high 32 bits), so
// that one exclusive scan gives each run's first sorted entry and first scratch chunk. Slots
// past *num_runs keep stale values; their prefix sums are never read.
__global__ void pack_runs_kernel(const uint32_t* __restrict__ run_counts,
                                 const uint32_t* __restrict__ num_runs,
                                 uint64_t* __restrict__ packed) {
    const uint32_t runs = *num_runs;
    const uint32_t stride = gridDim.x * blockDim.x;
    for (uint32_t r = blockIdx.x * blockDim.x + threadIdx.x; r < runs; r += stride) {
        const uint32_t n = run_counts[r];
        packed[r] = static_cast<uint64_t>(n) | (static_cast<uint64_t>(scratch_chunks(n)) << 32);
    }
}

// The table of a stacked row: the last t with row_base_t <= row (row bases increase; a binary
// search, so 26 tables cost 5 dependent loads instead of up to 25).
__device__ __forceinline__ size_t table_of(const uint32_t* __restrict__ tables,
                                           size_t num_tables, uint32_t row) {
    size_t lo = 0, hi = num_tables - 1;  // row_base_0 = 0 <= row
    while (lo < hi) {
        const size_t mid = lo + (hi - lo + 1) / 2;
        if (tables[mid * TILEARN_BAG_TABLE_WORDS + TILEARN_BAG_TABLE_ROW_BASE] <= row)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

// Up to one chunk of entries, staged by a warp in shared memory: each entry's sample (its row
// of dout) and pooling scale, so that the sum needs no dependent loads per entry.
struct Staged {
    uint32_t sample[kChunk];
    float scale[kChunk];
};

// Lane l stages sorted entry begin + l (when < end); every lane of the warp must call this.
__device__ __forceinline__ void stage_entries(Staged& s, const uint32_t* __restrict__ sorted_bags,
                                              const uint32_t* __restrict__ offsets, size_t batch,
                                              uint32_t pooling, uint32_t begin, uint32_t end,
                                              unsigned lane) {
    if (begin + lane < end) {
        const uint32_t bag = sorted_bags[begin + lane];
        s.sample[lane] = static_cast<uint32_t>(bag % batch);
        s.scale[lane] = pooling_scale(pooling, offsets[bag + 1] - offsets[bag]);
    }
    __syncwarp();
}

// Columns c .. c + kVec of the staged entries' sum, from 0 in entry order: sum of
// dout[sample, col + c] * scale.
template <int kVec>
__device__ __forceinline__ Vec<kVec> staged_sum(const Staged& s, uint32_t n,
                                                const float* __restrict__ dout, size_t total_dim,
                                                uint32_t col, uint32_t c) {
    Vec<kVec> g;
#pragma unroll
    for (int k = 0; k < kVec; ++k) g.v[k] = 0.0f;
#pragma unroll 4
    for (uint32_t e = 0; e < n; ++e) {
        const Vec<kVec> d =
            load<kVec>(dout + static_cast<size_t>(s.sample[e]) * total_dim + col + c);
        const float scale = s.scale[e];
#pragma unroll
        for (int k = 0; k < kVec; ++k) g.v[k] = __fadd_rn(g.v[k], __fmul_rn(d.v[k], scale));
    }
    return g;
}

// Phase A: one warp per scratch chunk (a chunk of a run longer than kChunk entries) writes its
// entries' sum into its partial row (`stride` floats per chunk). Warps past the chunk count,
// and chunks of the sentinel run or of a table wider than stride, exit.
__global__ void chunk_kernel(const uint32_t* __restrict__ tables, size_t num_tables,
                             size_t total_rows, size_t total_dim, size_t batch,
                             const uint32_t* __restrict__ offsets,
                             const uint32_t* __restrict__ unique_keys,
                             const uint32_t* __restrict__ run_counts,
                             const uint64_t* __restrict__ run_info,
                             const uint32_t* __restrict__ num_runs,
                             const uint32_t* __restrict__ sorted_bags,
                             const float* __restrict__ dout, float* __restrict__ partials,
                             size_t stride) {
    __shared__ Staged staged[kWarpsPerBlock];
    const size_t w = static_cast<size_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
    const uint32_t runs = *num_runs;  // >= 1: entries > 0
    const size_t chunks = (run_info[runs - 1] >> 32) + scratch_chunks(run_counts[runs - 1]);
    if (w >= chunks) return;
    // The run owning chunk w: the last run whose first chunk is <= w (a run without scratch
    // chunks shares its first chunk number with the next run, which comes later).
    uint32_t lo = 0, hi = runs - 1;  // run 0's first chunk is 0 <= w
    while (lo < hi) {
        const uint32_t mid = lo + (hi - lo + 1) / 2;
        if ((run_info[mid] >> 32) <= w)
            lo = mid;
        else
            hi = mid - 1;
    }
    const uint32_t key = unique_keys[lo];
    if (key >= total_rows) return;  // the sentinel run of out-of-range ids
    const Table tab = load_table(tables, table_of(tables, num_tables, key), total_dim);
    if (tab.dim > stride) return;  // unreachable: the caller's max_dim covers every table
    const uint64_t info = run_info[lo];
    const uint32_t run_begin = static_cast<uint32_t>(info);
    const uint32_t run_end = run_begin + run_counts[lo];
    const uint32_t begin = run_begin + static_cast<uint32_t>(w - (info >> 32)) * kChunk;
    const uint32_t end = begin + kChunk < run_end ? begin + kChunk : run_end;
    const unsigned lane = threadIdx.x % 32;
    Staged& s = staged[threadIdx.x / 32];
    stage_entries(s, sorted_bags, offsets, batch, tab.pooling, begin, end, lane);
    float* partial = partials + w * stride;
    if (tab.vec4) {
        for (uint32_t c = lane * 4; c < tab.dim; c += 32 * 4)
            store<4>(partial + c, staged_sum<4>(s, end - begin, dout, total_dim, tab.col, c));
    } else {
        for (uint32_t c = lane; c < tab.dim; c += 32)
            store<1>(partial + c, staged_sum<1>(s, end - begin, dout, total_dim, tab.col, c));
    }
}

// Where a row's gradient comes from: a one-chunk run's staged entries, or a longer run's chunk
// sums in the scratch.
struct RowGrad {
    const Staged* staged;
    uint32_t entries;      // staged entries (chunks == 0)
    const float* partial;  // the run's first chunk sum (chunks > 0)
    uint32_t chunks;
    size_t stride;
    const float* dout;
    size_t total_dim;
    uint32_t col;
};

// The row's gradient at columns c .. c + kVec: 0 plus its chunk sums in chunk order (one chunk:
// the staged entries' sum, which equals 0 + that sum bit for bit).
template <int kVec>
__device__ __forceinline__ Vec<kVec> row_grad(const RowGrad& src, uint32_t c) {
    if (src.chunks == 0)
        return staged_sum<kVec>(*src.staged, src.entries, src.dout, src.total_dim, src.col, c);
    Vec<kVec> g;
#pragma unroll
    for (int k = 0; k < kVec; ++k) g.v[k] = 0.0f;
#pragma unroll 8
    for (uint32_t i = 0; i < src.chunks; ++i) {
        const Vec<kVec> p = load<kVec>(src.partial + i * src.stride + c);
#pragma unroll
        for (int k = 0; k < kVec; ++k) g.v[k] = __fadd_rn(g.v[k], p.v[k]);
    }
    return g;
}

// The update of one row by a group of `lanes` lanes (lane: the lane's number in its group;
// mask: the group's lanes in the warp, for its shuffles and barriers).
template <int kVec>
__device__ void update_row(const RowGrad& src, const Table& tab, uint32_t row, unsigned lane,
                           unsigned lanes, unsigned mask, float* __restrict__ weights,
                           float* __restrict__ state1, float* __restrict__ state2,
                           const tilearn_sparse_rule& rule) {
    const size_t base = tab.weight_offset + static_cast<size_t>(row) * tab.dim;
    if (rule.kind == TILEARN_SPARSE_ROWWISE_ADAGRAD) {
        // Pass 1: the row's sum of squares (lane partials in column order, then a fixed xor
        // tree over the group), the gradient held in registers when the row fits them.
        const bool hold = tab.dim <= lanes * kVec * kRegSlots;
        Vec<kVec> held[kRegSlots];
        float sum_sq = 0.0f;
        if (hold) {
#pragma unroll
            for (int s = 0; s < kRegSlots; ++s) {
                const uint32_t c = (s * lanes + lane) * kVec;
                if (c < tab.dim) {
                    held[s] = row_grad<kVec>(src, c);
#pragma unroll
                    for (int k = 0; k < kVec; ++k)
                        sum_sq = __fadd_rn(sum_sq, __fmul_rn(held[s].v[k], held[s].v[k]));
                }
            }
        } else {
            for (uint32_t c = lane * kVec; c < tab.dim; c += lanes * kVec) {
                const Vec<kVec> g = row_grad<kVec>(src, c);
#pragma unroll
                for (int k = 0; k < kVec; ++k) sum_sq = __fadd_rn(sum_sq, __fmul_rn(g.v[k], g.v[k]));
            }
        }
        for (unsigned m = lanes / 2; m > 0; m >>= 1)
            sum_sq = __fadd_rn(sum_sq, __shfl_xor_sync(mask, sum_sq, m));
        float* acc = state1 + tab.row_base + row;
        const float g2 = __fadd_rn(*acc, __fdiv_rn(sum_sq, static_cast<float>(tab.dim)));
        const float neg_multiplier = -__fdiv_rn(rule.lr, __fadd_rn(sqrtf(g2), rule.eps));
        __syncwarp(mask);  // every lane has read *acc
        if (lane == 0) *acc = g2;
        // Pass 2: the update, from the held gradient or (wide rows) the gradient again.
        if (hold) {
#pragma unroll
            for (int s = 0; s < kRegSlots; ++s) {
                const uint32_t c = (s * lanes + lane) * kVec;
                if (c < tab.dim) {
                    Vec<kVec> w = load<kVec>(weights + base + c);
#pragma unroll
                    for (int k = 0; k < kVec; ++k)
                        w.v[k] = __fadd_rn(w.v[k], __fmul_rn(neg_multiplier, held[s].v[k]));
                    store<kVec>(weights + base + c, w);
                }
            }
        } else {
            for (uint32_t c = lane * kVec; c < tab.dim; c += lanes * kVec) {
                const Vec<kVec> g = row_grad<kVec>(src, c);
                Vec<kVec> w = load<kVec>(weights + base + c);
#pragma unroll
                for (int k = 0; k < kVec; ++k) w.v[k] = __fadd_rn(w.v[k], __fmul_rn(neg_multiplier, g.v[k]));
                store<kVec>(weights + base + c, w);
            }
        }
        return;
    }
    for (uint32_t c = lane * kVec; c < tab.dim; c += lanes * kVec) {
        const Vec<kVec> g = row_grad<kVec>(src, c);
        Vec<kVec> w = load<kVec>(weights + base + c);
        if (rule.kind == TILEARN_SPARSE_SGD) {
#pragma unroll
            for (int k = 0; k < kVec; ++k) w.v[k] = __fadd_rn(w.v[k], __fmul_rn(rule.neg_lr, g.v[k]));
        } else {  // TILEARN_SPARSE_ADAM (torch.optim.SparseAdam)
            Vec<kVec> m = load<kVec>(state1 + base + c);
            Vec<kVec> v = load<kVec>(state2 + base + c);
#pragma unroll
            for (int k = 0; k < kVec; ++k) {
                const float m_update = __fmul_rn(__fsub_rn(g.v[k], m.v[k]), rule.one_minus_beta1);
                const float v_update = __fmul_rn(__fsub_rn(__fmul_rn(g.v[k], g.v[k]), v.v[k]),
                                                 rule.one_minus_beta2);
                const float numer = __fadd_rn(m_update, m.v[k]);
                const float v_new = __fadd_rn(v_update, v.v[k]);
                m.v[k] = numer;
                v.v[k] = v_new;
                const float ratio = __fdiv_rn(numer, __fadd_rn(sqrtf(v_new), rule.eps));
                w.v[k] = __fadd_rn(w.v[k], __fmul_rn(rule.neg_step_size, ratio));
            }
            store<kVec>(state1 + base + c, m);
            store<kVec>(state2 + base + c, v);
        }
        store<kVec>(weights + base + c, w);
    }
}

// Phase B: one group of `lanes` lanes per run of equal keys (a distinct row) sums its gradient
// (its staged entries, or its chunk sums) and applies the optimizer once; runs past *num_runs
// exit. Groups only synchronise within themselves, so a group may exit or take another path.
__global__ void update_kernel(const uint32_t* __restrict__ tables, size_t num_tables,
                              size_t total_rows, size_t total_dim, size_t batch,
                              const uint32_t* __restrict__ offsets,
                              const uint32_t* __restrict__ unique_keys,
                              const uint32_t* __restrict__ run_counts,
                              const uint64_t* __restrict__ run_info,
                              const uint32_t* __restrict__ num_runs,
                              const uint32_t* __restrict__ sorted_bags,
                              const float* __restrict__ dout, const float* __restrict__ partials,
                              size_t stride, unsigned lanes, float* __restrict__ weights,
                              float* __restrict__ state1, float* __restrict__ state2,
                              tilearn_sparse_rule rule) {
    __shared__ Staged staged[kThreads / kMinGroupLanes];
    const unsigned group = threadIdx.x / lanes;
    const size_t r = static_cast<size_t>(blockIdx.x) * (kThreads / lanes) + group;
    if (r >= *num_runs) return;
    const uint32_t key = unique_keys[r];
    if (key >= total_rows) return;  // the sentinel run of out-of-range ids
    const unsigned lane = threadIdx.x % lanes;
    const unsigned mask =
        lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1) << (threadIdx.x % 32 / lanes * lanes);
    const Table tab = load_table(tables, table_of(tables, num_tables, key), total_dim);
    const uint32_t count = run_counts[r];
    const uint64_t info = run_info[r];
    Staged& s = staged[group];
    RowGrad src{&s, count, nullptr, scratch_chunks(count), stride, dout, total_dim, tab.col};
    if (src.chunks == 0) {
        // Stage the run's <= kChunk entries, `lanes` at a time.
        const uint32_t begin = static_cast<uint32_t>(info);
        for (uint32_t e = lane; e < count; e += lanes) {
            const uint32_t bag = sorted_bags[begin + e];
            s.sample[e] = static_cast<uint32_t>(bag % batch);
            s.scale[e] = pooling_scale(tab.pooling, offsets[bag + 1] - offsets[bag]);
        }
        __syncwarp(mask);
    } else {
        if (tab.dim > stride) return;  // unreachable: chunk_kernel skipped it as well
        src.partial = partials + (info >> 32) * stride;
    }
    const uint32_t row = key - tab.row_base;
    if (tab.vec4)
        update_row<4>(src, tab, row, lane, lanes, mask, weights, state1, state2, rule);
    else
        update_row<1>(src, tab, row, lane, lanes, mask, weights, state1, state2, rule);
}

size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

int key_bits(size_t max_key) {
    int bits = 1;
    while (bits < 32 && (max_key >> bits) != 0) ++bits;
    return bits;
}

// Scratch, each part 256-aligned from the aligned base: eight u32[entries] parts (0 keys, 1
// bags, reused together after the sort as the u64 packed run counts; 2 sorted keys, 3 sorted
// bags, 4 unique keys, 5 run counts, 6-7 the u64 run info), the run count, CUB's temporary
// storage (the largest of the three algorithms'), then the chunk sums: max_scratch_chunks rows
// of `stride` (max_dim rounded up to 4) floats.
struct ScratchLayout {
    size_t part, cub_bytes, stride, partial_rows, total;
};

constexpr size_t kMaxDim = size_t{1} << 24;

cudaError_t scratch_layout(size_t entries, size_t total_rows, size_t max_dim,
                           ScratchLayout* layout) {
    const int n = static_cast<int>(entries);
    uint32_t* u = nullptr;
    uint64_t* u64 = nullptr;
    size_t sort_bytes = 0, rle_bytes = 0, scan_bytes = 0;
    cudaError_t err = cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, u, u, u, u, n, 0,
                                                      key_bits(total_rows));
    if (err != cudaSuccess) return err;
    err = cub::DeviceRunLengthEncode::Encode(nullptr, rle_bytes, u, u, u, u, n);
    if (err != cudaSuccess) return err;
    err = cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, u64, u64, n);
    if (err != cudaSuccess) return err;
    size_t cub_bytes = sort_bytes > rle_bytes ? sort_bytes : rle_bytes;
    cub_bytes = cub_bytes > scan_bytes ? cub_bytes : scan_bytes;
    layout->part = align_up(entries * sizeof(uint32_t), kScratchAlign);
    layout->cub_bytes = cub_bytes;
    layout->stride = align_up(max_dim, 4);
    layout->partial_rows = max_scratch_chunks(entries);
    layout->total = kScratchAlign + 8 * layout->part + kScratchAlign +
                    align_up(cub_bytes, kScratchAlign) +
                    layout->partial_rows * layout->stride * sizeof(float);
    return cudaSuccess;
}

bool shape_ok(size_t num_tables, size_t batch, size_t entries, size_t total_rows) {
    return num_tables > 0 && num_tables <= 65535 && batch <= 0xffffffffu / num_tables &&
           entries <= 0x7fffffffu && total_rows < 0xffffffffu;
}

}  // namespace

extern "C" int tilearn_embedding_bag_forward(const float* weights, const uint32_t* tables,
                                             size_t num_tables, size_t total_dim,
                                             const uint32_t* offsets, const uint32_t* ids,
                                             size_t batch, float* out, cudaStream_t stream) {
    if (!shape_ok(num_tables, batch, 0, 0)) return static_cast<int>(cudaErrorInvalidValue);
    if (batch == 0 || total_dim == 0) return static_cast<int>(cudaSuccess);
    if (weights == nullptr || tables == nullptr || offsets == nullptr || out == nullptr)
        return static_cast<int>(cudaErrorInvalidValue);
    // Blocks sized for one-lane bags; a block whose table needs more lanes per bag serves
    // fewer bags and the rest of its grid row exits at once (b >= batch).
    const size_t groups = batch;  // upper bound: kThreads / lanes >= 1 bag per block
    const size_t blocks_x = (groups + kThreads - 1) / kThreads * 32;
    const dim3 grid(static_cast<unsigned>(blocks_x < 0x7fffffffu ? blocks_x : 0x7fffffffu),
                    static_cast<unsigned>(num_tables));
    forward_kernel<<<grid, kThreads, 0, stream>>>(weights, tables, total_dim, offsets, ids, batch,
                                                  out);
    return static_cast<int>(cudaGetLastError());
}

extern "C" size_t tilearn_embedding_bag_backward_scratch_bytes(size_t entries, size_t total_rows,
                                                               size_t max_dim) {
    if (!shape_ok(1, 0, entries, total_rows) || max_dim > kMaxDim) return SIZE_MAX;
    if (entries == 0) return 0;
    ScratchLayout layout;
    if (scratch_layout(entries, total_rows, max_dim, &layout) != cudaSuccess) return SIZE_MAX;
    return layout.total;
}

extern "C" int tilearn_embedding_bag_backward_update(
    float* weights, float* state1, float* state2, const uint32_t* tables, size_t num_tables,
    size_t total_rows, size_t total_dim, size_t max_dim, const uint32_t* offsets,
    const uint32_t* ids, size_t batch, size_t entries, const float* dout,
    tilearn_sparse_rule rule, void* scratch, size_t scratch_bytes, cudaStream_t stream) {
    if (!shape_ok(num_tables, batch, entries, total_rows) || max_dim > kMaxDim)
        return static_cast<int>(cudaErrorInvalidValue);
    if (entries == 0) return static_cast<int>(cudaSuccess);
    const bool needs1 = rule.kind != TILEARN_SPARSE_SGD;
    const bool needs2 = rule.kind == TILEARN_SPARSE_ADAM;
    if (rule.kind < TILEARN_SPARSE_SGD || rule.kind > TILEARN_SPARSE_ADAM ||
        weights == nullptr || tables == nullptr || offsets == nullptr || ids == nullptr ||
        dout == nullptr || scratch == nullptr || (needs1 && state1 == nullptr) ||
        (needs2 && state2 == nullptr))
        return static_cast<int>(cudaErrorInvalidValue);
    ScratchLayout layout;
    cudaError_t err = scratch_layout(entries, total_rows, max_dim, &layout);
    if (err != cudaSuccess) return static_cast<int>(err);
    if (scratch_bytes < layout.total) return static_cast<int>(cudaErrorInvalidValue);
    char* base = static_cast<char*>(scratch) +
                 (align_up(reinterpret_cast<uintptr_t>(scratch), kScratchAlign) -
                  reinterpret_cast<uintptr_t>(scratch));
    uint32_t* part[8];
    for (int i = 0; i < 8; ++i) part[i] = reinterpret_cast<uint32_t*>(base + i * layout.part);
    uint32_t *keys = part[0], *bags = part[1], *sorted_keys = part[2], *sorted_bags = part[3],
             *unique_keys = part[4], *run_counts = part[5];
    uint64_t* packed_runs = reinterpret_cast<uint64_t*>(part[0]);  // after the sort
    uint64_t* run_info = reinterpret_cast<uint64_t*>(part[6]);
    uint32_t* num_runs = reinterpret_cast<uint32_t*>(base + 8 * layout.part);
    void* cub_temp = base + 8 * layout.part + kScratchAlign;
    float* partials = reinterpret_cast<float*>(static_cast<char*>(cub_temp) +
                                               align_up(layout.cub_bytes, kScratchAlign));
    const int n = static_cast<int>(entries);

    const size_t num_bags = num_tables * batch;
    const size_t key_blocks = (num_bags + kThreads - 1) / kThreads;
    keys_kernel<<<static_cast<unsigned>(key_blocks < 65535 ? key_blocks : 65535), kThreads, 0,
                  stream>>>(tables, num_tables, total_rows, offsets, ids, batch, keys, bags);
    if ((err = cudaGetLastError()) != cudaSuccess) return static_cast<int>(err);
    size_t bytes = layout.cub_bytes;
    err = cub::DeviceRadixSort::SortPairs(cub_temp, bytes, keys, sorted_keys, bags, sorted_bags,
                                          n, 0, key_bits(total_rows), stream);
    if (err != cudaSuccess) return static_cast<int>(err);
    bytes = layout.cub_bytes;
    err = cub::DeviceRunLengthEncode::Encode(cub_temp, bytes, sorted_keys, unique_keys,
                                             run_counts, num_runs, n, stream);
    if (err != cudaSuccess) return static_cast<int>(err);
    const size_t run_blocks = (entries + kThreads - 1) / kThreads;
    pack_runs_kernel<<<static_cast<unsigned>(run_blocks < 65535 ? run_blocks : 65535), kThreads,
                       0, stream>>>(run_counts, num_runs, packed_runs);
    if ((err = cudaGetLastError()) != cudaSuccess) return static_cast<int>(err);
    bytes = layout.cub_bytes;
    // Each run's info depends only on the packed counts before it (all written above).
    err = cub::DeviceScan::ExclusiveSum(cub_temp, bytes, packed_runs, run_info, n, stream);
    if (err != cudaSuccess) return static_cast<int>(err);
    if (layout.partial_rows > 0) {
        const size_t chunk_blocks = (layout.partial_rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
        chunk_kernel<<<static_cast<unsigned>(chunk_blocks), kThreads, 0, stream>>>(
            tables, num_tables, total_rows, total_dim, batch, offsets, unique_keys, run_counts,
            run_info, num_runs, sorted_bags, dout, partials, layout.stride);
        if ((err = cudaGetLastError()) != cudaSuccess) return static_cast<int>(err);
    }
    const unsigned lanes = group_lanes(max_dim);
    const size_t rows_per_block = kThreads / lanes;
    const size_t update_blocks = (entries + rows_per_block - 1) / rows_per_block;
    update_kernel<<<static_cast<unsigned>(update_blocks), kThreads, 0, stream>>>(
        tables, num_tables, total_rows, total_dim, batch, offsets, unique_keys, run_counts,
        run_info, num_runs, sorted_bags, dout, partials, layout.stride, lanes, weights, state1,
        state2, rule);
    return static_cast<int>(cudaGetLastError());
}
