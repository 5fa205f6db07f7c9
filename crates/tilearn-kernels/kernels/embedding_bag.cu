// embedding_bag.cu: the fused multi-table embedding bag of tilearn-recsys (FBGEMM-style
// table-batched embeddings): the pooled forward, and the backward fused with a sparse optimizer
// that updates every touched row in place.
//
//   forward:  out[b, col_t + c] = scale_t(len) * sum_{j in bag(t, b)} W[row(t, ids[j]), c]
//   backward: g_r = sum over entries j of row r (entry order) of dout[b_j, col_t + c] * scale;
//             row r updated by the rule (SGD, row-wise Adagrad or SparseAdam) from g_r.
//
// Fused:     forward: gather + pooling + the mean's scale, one pass, no intermediate. Backward:
//            (1) a kernel writes each entry's stacked-row key (row_base_t + id) and its bag;
//            (2) CUB's stable radix sort orders the entries by key (entry order kept within a
//            key); (3) CUB's run-length encode + exclusive scan give each distinct row's run;
//            (4) one warp per distinct row sums its run's dout rows (times the pooling scale)
//            and applies the optimizer to the row and its state in place. No dense gradient of
//            a table is materialised; the only scratch is O(entries).
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
//            SparseAdam match it bit for bit; row-wise Adagrad's sum of squares is a warp tree
//            (differs from the CPU's serial sum by rounding only).
// Output:    forward writes out (=). Backward+update overwrites touched weight rows and their
//            state in place (=); untouched rows and state are not accessed. Deterministic: no
//            float atomics, each row is owned by one warp, which adds its entries in entry
//            order, so reruns are bit-identical. Ids outside their table (which the Rust
//            wrappers rule out) are skipped, never read or written out of bounds.

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

// One thread per bag: its entries' sort keys (stacked row, or the sentinel total_rows for an
// id outside its table), entry numbers and bag numbers.
__global__ void keys_kernel(const uint32_t* __restrict__ tables, size_t num_tables,
                            size_t total_rows, const uint32_t* __restrict__ offsets,
                            const uint32_t* __restrict__ ids, size_t batch,
                            uint32_t* __restrict__ keys, uint32_t* __restrict__ entries,
                            uint32_t* __restrict__ bag_of) {
    const size_t bags = num_tables * batch;
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    for (size_t bag = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; bag < bags;
         bag += stride) {
        const uint32_t* w = tables + (bag / batch) * TILEARN_BAG_TABLE_WORDS;
        const uint32_t rows = w[TILEARN_BAG_TABLE_ROWS];
        const uint32_t base = w[TILEARN_BAG_TABLE_ROW_BASE];
        for (uint32_t j = offsets[bag]; j < offsets[bag + 1]; ++j) {
            const uint32_t id = ids[j];
            keys[j] = id < rows ? base + id : static_cast<uint32_t>(total_rows);
            entries[j] = j;
            bag_of[j] = static_cast<uint32_t>(bag);
        }
    }
}

// The table of a stacked row: the last t with row_base_t <= row (tables are few; linear).
__device__ __forceinline__ size_t table_of(const uint32_t* __restrict__ tables,
                                           size_t num_tables, uint32_t row) {
    size_t t = 0;
    while (t + 1 < num_tables &&
           tables[(t + 1) * TILEARN_BAG_TABLE_WORDS + TILEARN_BAG_TABLE_ROW_BASE] <= row)
        ++t;
    return t;
}

struct Run {
    const uint32_t* entries;  // sorted entry numbers
    const uint32_t* bag_of;
    const uint32_t* offsets;
    uint32_t begin, end;      // the run inside the sorted entries
    size_t batch, total_dim;
};

// The run's gradient at columns c .. c + kVec: sum over its entries, in entry order, of
// dout[b, col + c] * scale(bag).
template <int kVec>
__device__ __forceinline__ Vec<kVec> run_grad(const Run& run, const Table& tab,
                                              const float* __restrict__ dout, uint32_t c) {
    Vec<kVec> g;
#pragma unroll
    for (int k = 0; k < kVec; ++k) g.v[k] = 0.0f;
    for (uint32_t j = run.begin; j < run.end; ++j) {
        const uint32_t bag = run.bag_of[run.entries[j]];
        const size_t b = bag % run.batch;
        const float scale = pooling_scale(tab.pooling, run.offsets[bag + 1] - run.offsets[bag]);
        const Vec<kVec> d = load<kVec>(dout + b * run.total_dim + tab.col + c);
#pragma unroll
        for (int k = 0; k < kVec; ++k) g.v[k] = __fadd_rn(g.v[k], __fmul_rn(d.v[k], scale));
    }
    return g;
}

template <int kVec>
__device__ void update_row(const Run& run, const Table& tab, uint32_t row, unsigned lane,
                           const float* __restrict__ dout, float* __restrict__ weights,
                           float* __restrict__ state1, float* __restrict__ state2,
                           const tilearn_sparse_rule& rule) {
    const size_t base = tab.weight_offset + static_cast<size_t>(row) * tab.dim;
    if (rule.kind == TILEARN_SPARSE_ROWWISE_ADAGRAD) {
        // Pass 1: the row's sum of squares (lane partials, then a fixed xor tree).
        float sum_sq = 0.0f;
        for (uint32_t c = lane * kVec; c < tab.dim; c += 32 * kVec) {
            const Vec<kVec> g = run_grad<kVec>(run, tab, dout, c);
#pragma unroll
            for (int k = 0; k < kVec; ++k) sum_sq = __fadd_rn(sum_sq, __fmul_rn(g.v[k], g.v[k]));
        }
#pragma unroll
        for (int m = 16; m > 0; m >>= 1) sum_sq = __fadd_rn(sum_sq, __shfl_xor_sync(0xffffffffu, sum_sq, m));
        float* acc = state1 + tab.row_base + row;
        const float g2 = __fadd_rn(*acc, __fdiv_rn(sum_sq, static_cast<float>(tab.dim)));
        const float neg_multiplier = -__fdiv_rn(rule.lr, __fadd_rn(sqrtf(g2), rule.eps));
        __syncwarp();
        if (lane == 0) *acc = g2;
        // Pass 2: recompute the gradient (its dout rows are in L1/L2 now) and update.
        for (uint32_t c = lane * kVec; c < tab.dim; c += 32 * kVec) {
            const Vec<kVec> g = run_grad<kVec>(run, tab, dout, c);
            Vec<kVec> w = load<kVec>(weights + base + c);
#pragma unroll
            for (int k = 0; k < kVec; ++k) w.v[k] = __fadd_rn(w.v[k], __fmul_rn(neg_multiplier, g.v[k]));
            store<kVec>(weights + base + c, w);
        }
        return;
    }
    for (uint32_t c = lane * kVec; c < tab.dim; c += 32 * kVec) {
        const Vec<kVec> g = run_grad<kVec>(run, tab, dout, c);
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

// One warp per run of equal keys (a distinct row); runs past *num_runs exit.
__global__ void update_kernel(const uint32_t* __restrict__ tables, size_t num_tables,
                              size_t total_rows, size_t total_dim, size_t batch,
                              const uint32_t* __restrict__ offsets,
                              const uint32_t* __restrict__ unique_keys,
                              const uint32_t* __restrict__ run_counts,
                              const uint32_t* __restrict__ run_starts,
                              const uint32_t* __restrict__ num_runs,
                              const uint32_t* __restrict__ sorted_entries,
                              const uint32_t* __restrict__ bag_of, const float* __restrict__ dout,
                              float* __restrict__ weights, float* __restrict__ state1,
                              float* __restrict__ state2, tilearn_sparse_rule rule) {
    const size_t r = static_cast<size_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
    if (r >= *num_runs) return;
    const uint32_t key = unique_keys[r];
    if (key >= total_rows) return;  // the sentinel run of out-of-range ids
    const unsigned lane = threadIdx.x % 32;
    const size_t t = table_of(tables, num_tables, key);
    const Table tab = load_table(tables, t, total_dim);
    const Run run{sorted_entries, bag_of, offsets, run_starts[r], run_starts[r] + run_counts[r],
                  batch, total_dim};
    if (tab.vec4)
        update_row<4>(run, tab, key - tab.row_base, lane, dout, weights, state1, state2, rule);
    else
        update_row<1>(run, tab, key - tab.row_base, lane, dout, weights, state1, state2, rule);
}

size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

int key_bits(size_t max_key) {
    int bits = 1;
    while (bits < 32 && (max_key >> bits) != 0) ++bits;
    return bits;
}

// Scratch: eight u32[entries] parts (keys, sorted keys, entries, sorted entries, bag of entry,
// unique keys, run counts, run starts), the run count, then CUB's temporary storage (the
// largest of the three algorithms'), each part 256-aligned from the aligned base.
struct ScratchLayout {
    size_t part, cub_bytes, total;
};

cudaError_t scratch_layout(size_t entries, size_t total_rows, ScratchLayout* layout) {
    const int n = static_cast<int>(entries);
    uint32_t* u = nullptr;
    size_t sort_bytes = 0, rle_bytes = 0, scan_bytes = 0;
    cudaError_t err = cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, u, u, u, u, n, 0,
                                                      key_bits(total_rows));
    if (err != cudaSuccess) return err;
    err = cub::DeviceRunLengthEncode::Encode(nullptr, rle_bytes, u, u, u, u, n);
    if (err != cudaSuccess) return err;
    err = cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, u, u, n);
    if (err != cudaSuccess) return err;
    size_t cub_bytes = sort_bytes > rle_bytes ? sort_bytes : rle_bytes;
    cub_bytes = cub_bytes > scan_bytes ? cub_bytes : scan_bytes;
    layout->part = align_up(entries * sizeof(uint32_t), kScratchAlign);
    layout->cub_bytes = cub_bytes;
    layout->total = 8 * layout->part + kScratchAlign + align_up(cub_bytes, kScratchAlign) +
                    kScratchAlign;
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

extern "C" size_t tilearn_embedding_bag_backward_scratch_bytes(size_t entries,
                                                               size_t total_rows) {
    if (!shape_ok(1, 0, entries, total_rows)) return SIZE_MAX;
    if (entries == 0) return 0;
    ScratchLayout layout;
    if (scratch_layout(entries, total_rows, &layout) != cudaSuccess) return SIZE_MAX;
    return layout.total;
}

extern "C" int tilearn_embedding_bag_backward_update(
    float* weights, float* state1, float* state2, const uint32_t* tables, size_t num_tables,
    size_t total_rows, size_t total_dim, const uint32_t* offsets, const uint32_t* ids,
    size_t batch, size_t entries, const float* dout, tilearn_sparse_rule rule, void* scratch,
    size_t scratch_bytes, cudaStream_t stream) {
    if (!shape_ok(num_tables, batch, entries, total_rows))
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
    cudaError_t err = scratch_layout(entries, total_rows, &layout);
    if (err != cudaSuccess) return static_cast<int>(err);
    if (scratch_bytes < layout.total) return static_cast<int>(cudaErrorInvalidValue);
    char* base = static_cast<char*>(scratch) +
                 (align_up(reinterpret_cast<uintptr_t>(scratch), kScratchAlign) -
                  reinterpret_cast<uintptr_t>(scratch));
    uint32_t* part[8];
    for (int i = 0; i < 8; ++i) part[i] = reinterpret_cast<uint32_t*>(base + i * layout.part);
    uint32_t *keys = part[0], *sorted_keys = part[1], *entry_ids = part[2],
             *sorted_entries = part[3], *bag_of = part[4], *unique_keys = part[5],
             *run_counts = part[6], *run_starts = part[7];
    uint32_t* num_runs = reinterpret_cast<uint32_t*>(base + 8 * layout.part);
    void* cub_temp = base + 8 * layout.part + kScratchAlign;
    const int n = static_cast<int>(entries);

    const size_t bags = num_tables * batch;
    const size_t key_blocks = (bags + kThreads - 1) / kThreads;
    keys_kernel<<<static_cast<unsigned>(key_blocks < 65535 ? key_blocks : 65535), kThreads, 0,
                  stream>>>(tables, num_tables, total_rows, offsets, ids, batch, keys, entry_ids,
                            bag_of);
    if ((err = cudaGetLastError()) != cudaSuccess) return static_cast<int>(err);
    size_t bytes = layout.cub_bytes;
    err = cub::DeviceRadixSort::SortPairs(cub_temp, bytes, keys, sorted_keys, entry_ids,
                                          sorted_entries, n, 0, key_bits(total_rows), stream);
    if (err != cudaSuccess) return static_cast<int>(err);
    bytes = layout.cub_bytes;
    err = cub::DeviceRunLengthEncode::Encode(cub_temp, bytes, sorted_keys, unique_keys,
                                             run_counts, num_runs, n, stream);
    if (err != cudaSuccess) return static_cast<int>(err);
    bytes = layout.cub_bytes;
    // Counts past the run count are never written by the encode; their prefix sums are never
    // read (the update kernel stops at *num_runs), and each run's start depends only on the
    // counts before it.
    err = cub::DeviceScan::ExclusiveSum(cub_temp, bytes, run_counts, run_starts, n, stream);
    if (err != cudaSuccess) return static_cast<int>(err);
    const size_t update_blocks = (entries + kWarpsPerBlock - 1) / kWarpsPerBlock;
    update_kernel<<<static_cast<unsigned>(update_blocks), kThreads, 0, stream>>>(
        tables, num_tables, total_rows, total_dim, batch, offsets, unique_keys, run_counts,
        run_starts, num_runs, sorted_entries, bag_of, dout, weights, state1, state2, rule);
    return static_cast<int>(cudaGetLastError());
}
