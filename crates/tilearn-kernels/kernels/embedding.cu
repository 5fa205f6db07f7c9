// embedding.cu: token embedding lookup (forward) and its deterministic gradient (backward).
//
//   forward:   out[r, :] = table[ids[r], :]
//   backward:  dtable[ids[r], :] += dout[r, :]   for r = 0, 1, ... in order
//
// Fused:     nothing; the backward is three steps on `stream`: (1) a kernel writes sort keys
//            (the id, or the sentinel `vocab` for an out-of-range id) and positions 0..rows-1;
//            (2) CUB's stable radix sort orders the positions by id (positions stay increasing
//            within an id); (3) one thread block per run of equal ids (and per column chunk)
//            adds that run's dout rows into the table row, in position order.
// Layout:    ids are [rows] u32; table / dtable [vocab, dim]; out / dout [rows, dim]; all
//            row-major. A thread moves 16 bytes (4 f32, or 8 bf16 / f16) per access when dim is
//            a multiple of that width and the pointers are 16-byte aligned; one element
//            otherwise.
// Precision: forward: a copy in the storage type (f32, bf16 or f16; no rounding). Backward:
//            dout f32, bf16 or f16 (widened exactly to f32), dtable always f32 (the fp32 master
//            gradient), sums in f32.
// Gradients: dtable is accumulated (`+=`). Deterministic and order-exact: each dtable element is
//            owned by one thread, which starts from the current value and adds the rows of its
//            id in increasing position, the same f32 operations in the same order as
//            tilearn_ops::cpu::embedding_backward::<f32>, so the result is bit-identical to that
//            reference and from run to run. No float atomics. A run of n equal ids is summed
//            serially by its block (n adds per column); the sort costs O(rows) and the table is
//            touched only at the rows that occur.
// Bad ids:   an id >= vocab never reads or writes out of bounds. The forward fills that output
//            row with NaN, so a caller that ignores the error cannot train silently on garbage;
//            the backward skips that row. Both record it in `status`, one u64 device word that
//            the caller initialises to UINT64_MAX ("no error"): every launch atomically lowers it
//            to (position << 32) | id of the offending row, so after any number of launches it
//            names the first bad position of the launch with the earliest one (integer atomicMin,
//            deterministic). The caller reads it when it chooses (tilearn_ops::cuda::TokenIdCheck)
//            instead of a host round trip inside every step.
// Slices:    the *_slice launchers serve a vocabulary-parallel rank whose table holds rows
//            vocab_start .. vocab_start + table_rows of a vocabulary of full_vocab words: an id in
//            the slice reads/writes table row id - vocab_start, an id elsewhere in
//            [0, full_vocab) gives a zero output row (written `=`, so the sum over the ranks is
//            the lookup) and is skipped by the backward (the sort gives it the sentinel key),
//            and only ids >= full_vocab are bad. The whole-table launchers are the slice
//            0 .. vocab of a vocabulary of vocab words: the same kernels, the same results.

#include <cub/device/device_radix_sort.cuh>

#include "tilearn_dtype.cuh"
#include "tilearn_kernels.h"

namespace {

constexpr unsigned kMaxThreads = 256;
constexpr size_t kScratchAlign = 256;

using tilearn::aligned16;
using tilearn::to_f32;

// The quiet NaN that fills the output row of an out-of-range id.
template <typename T>
__device__ __forceinline__ T nan_of();
template <>
__device__ __forceinline__ float nan_of<float>() { return __int_as_float(0x7fc00000); }
template <>
__device__ __forceinline__ __nv_bfloat16 nan_of<__nv_bfloat16>() {
    return __ushort_as_bfloat16(static_cast<unsigned short>(0x7fc0));
}
template <>
__device__ __forceinline__ __half nan_of<__half>() {
    return __ushort_as_half(static_cast<unsigned short>(0x7e00));
}

// N consecutive elements moved together: 16-byte accesses when N * sizeof(T) is a multiple of
// 16, a plain scalar access when N == 1.
template <typename T, int N>
struct alignas(N * sizeof(T) < 16 ? N * sizeof(T) : 16) Pack {
    T v[N];
};

__device__ __forceinline__ void record_bad_id(unsigned long long* status, size_t position,
                                              uint32_t id) {
    atomicMin(status, (static_cast<unsigned long long>(position) << 32) | id);
}

// Block: (x: column packs, y: rows). Grid: (x: row groups, y: column chunks).
// The table rows a launch reads or writes: rows start .. start + rows of a vocabulary of
// `full` words.
struct Slice {
    size_t start;
    size_t rows;
    size_t full;
};

// The sort key of `id`: its table row when the slice holds it, else `slice.rows` (the sentinel
// run that the backward skips: ids of other ranks and bad ids alike).
__device__ __forceinline__ uint32_t slice_key(uint32_t id, const Slice& slice) {
    const size_t i = id;
    return i >= slice.start && i - slice.start < slice.rows
               ? static_cast<uint32_t>(i - slice.start)
               : static_cast<uint32_t>(slice.rows);
}

template <typename T, int kVec>
__global__ void forward_kernel(const uint32_t* __restrict__ ids, const T* __restrict__ table,
                               size_t rows, Slice slice, size_t dim, T* __restrict__ out,
                               unsigned long long* __restrict__ status) {
    const size_t row = static_cast<size_t>(blockIdx.x) * blockDim.y + threadIdx.y;
    if (row >= rows) return;
    const uint32_t id = ids[row];
    const size_t col = (static_cast<size_t>(blockIdx.y) * blockDim.x + threadIdx.x) * kVec;
    if (id >= slice.full) {
        if (blockIdx.y == 0 && threadIdx.x == 0) record_bad_id(status, row, id);
        if (col < dim) {
            Pack<T, kVec> nan;
#pragma unroll
            for (int k = 0; k < kVec; ++k) nan.v[k] = nan_of<T>();
            *reinterpret_cast<Pack<T, kVec>*>(out + row * dim + col) = nan;
        }
        return;
    }
    if (col >= dim) return;  // dim % kVec == 0, so a pack that starts inside ends inside
    const uint32_t key = slice_key(id, slice);
    Pack<T, kVec> v;
    if (key < slice.rows) {
        v = *reinterpret_cast<const Pack<T, kVec>*>(table + static_cast<size_t>(key) * dim + col);
    } else {
#pragma unroll
        for (int k = 0; k < kVec; ++k) v.v[k] = tilearn::from_f32<T>(0.0f);
    }
    *reinterpret_cast<Pack<T, kVec>*>(out + row * dim + col) = v;
}

// Sort keys and values for the backward: the table row (or the sentinel `slice.rows` for an
// id outside the slice, bad or not) and the position.
__global__ void keys_kernel(const uint32_t* __restrict__ ids, size_t rows, Slice slice,
                            uint32_t* __restrict__ keys, uint32_t* __restrict__ positions,
                            unsigned long long* __restrict__ status) {
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    for (size_t r = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < rows;
         r += stride) {
        const uint32_t id = ids[r];
        if (id >= slice.full) record_bad_id(status, r, id);
        keys[r] = slice_key(id, slice);
        positions[r] = static_cast<uint32_t>(r);
    }
}

// Block x = k-th entry of the sorted keys; it works only if entry k starts a run of equal ids.
// Block y = column chunk. Each thread owns kVec columns of the run's table row.
template <typename T, int kVec>
__global__ void accumulate_kernel(const uint32_t* __restrict__ sorted_ids,
                                  const uint32_t* __restrict__ sorted_positions,
                                  const T* __restrict__ dout, size_t rows, size_t vocab,
                                  size_t dim, float* __restrict__ dtable) {
    const size_t k = blockIdx.x;
    const uint32_t id = sorted_ids[k];
    if (id >= vocab) return;                        // the sentinel run of bad ids
    if (k > 0 && sorted_ids[k - 1] == id) return;   // not the start of a run
    const size_t col = (static_cast<size_t>(blockIdx.y) * blockDim.x + threadIdx.x) * kVec;
    if (col >= dim) return;
    Pack<float, kVec>* dst =
        reinterpret_cast<Pack<float, kVec>*>(dtable + static_cast<size_t>(id) * dim + col);
    Pack<float, kVec> acc = *dst;
    for (size_t j = k; j < rows && sorted_ids[j] == id; ++j) {
        const Pack<T, kVec> d = *reinterpret_cast<const Pack<T, kVec>*>(
            dout + static_cast<size_t>(sorted_positions[j]) * dim + col);
#pragma unroll
        for (int c = 0; c < kVec; ++c) acc.v[c] += to_f32(d.v[c]);
    }
    *dst = acc;
}

size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

// Bits the radix sort must look at: enough for every key 0..=vocab (vocab is the sentinel).
int key_bits(size_t vocab) {
    int bits = 1;
    while (bits < 32 && (vocab >> bits) != 0) ++bits;
    return bits;
}

// rows and vocab fit the u32 ids and positions and the (position << 32 | id) status word; the
// backward's grid has one block per row, so rows also stay below 2^31.
bool shape_ok(size_t rows, size_t vocab, size_t dim) {
    return rows <= 0x7fffffffu && vocab <= 0xffffffffu && dim != 0 &&
           rows <= SIZE_MAX / dim && vocab <= SIZE_MAX / dim;
}

// The slice lies inside the vocabulary, which fits the u32 ids.
bool slice_ok(const Slice& slice, size_t rows, size_t dim) {
    return slice.full <= 0xffffffffu && slice.start <= slice.full &&
           slice.rows <= slice.full - slice.start && shape_ok(rows, slice.rows, dim);
}

// Threads along a row: enough 32-wide warps to cover the row's packs, at most kMaxThreads.
unsigned row_threads(size_t packs) {
    const size_t warps = (packs + 31) / 32;
    const size_t t = warps * 32;
    return static_cast<unsigned>(t < kMaxThreads ? t : kMaxThreads);
}

template <typename T, int kVec>
int launch_forward_vec(const uint32_t* ids, const T* table, size_t rows, Slice slice,
                       size_t dim, T* out, unsigned long long* status, cudaStream_t stream) {
    const size_t packs = dim / kVec;
    const unsigned tx = row_threads(packs);
    const unsigned ty = kMaxThreads / tx;  // several short rows per block
    const size_t chunks = (packs + tx - 1) / tx;
    const size_t groups = (rows + ty - 1) / ty;
    if (chunks > 65535) return static_cast<int>(cudaErrorInvalidValue);
    const dim3 grid(static_cast<unsigned>(groups), static_cast<unsigned>(chunks));
    forward_kernel<T, kVec><<<grid, dim3(tx, ty), 0, stream>>>(ids, table, rows, slice, dim, out,
                                                               status);
    return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch_forward(const uint32_t* ids, const void* table, size_t rows, Slice slice, size_t dim,
                   void* out, uint64_t* status, cudaStream_t stream) {
    if (!slice_ok(slice, rows, dim)) return static_cast<int>(cudaErrorInvalidValue);
    if (rows == 0) return static_cast<int>(cudaSuccess);
    if (ids == nullptr || out == nullptr || status == nullptr ||
        (slice.rows > 0 && table == nullptr))
        return static_cast<int>(cudaErrorInvalidValue);
    const T* tab = static_cast<const T*>(table);
    T* o = static_cast<T*>(out);
    auto* st = reinterpret_cast<unsigned long long*>(status);
    constexpr int kVec = 16 / sizeof(T);
    if (dim % kVec == 0 && aligned16(table) && aligned16(out))
        return launch_forward_vec<T, kVec>(ids, tab, rows, slice, dim, o, st, stream);
    return launch_forward_vec<T, 1>(ids, tab, rows, slice, dim, o, st, stream);
}

// Scratch layout (bytes, each part 256-aligned from the first 256-aligned byte of the scratch,
// so any base address works): keys, sorted keys, positions, sorted positions (u32[rows] each),
// then CUB's temporary storage.
struct ScratchLayout {
    size_t part;       // bytes of one u32[rows] part
    size_t cub_bytes;  // CUB temporary storage
    size_t total;
};

cudaError_t scratch_layout(size_t rows, size_t vocab, ScratchLayout* layout) {
    size_t cub_bytes = 0;
    const cudaError_t err = cub::DeviceRadixSort::SortPairs(
        nullptr, cub_bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
        static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
        static_cast<int>(rows), 0, key_bits(vocab));
    if (err != cudaSuccess) return err;
    layout->part = align_up(rows * sizeof(uint32_t), kScratchAlign);
    layout->cub_bytes = cub_bytes;
    // + kScratchAlign: room to round the caller's base address up to the alignment.
    layout->total = 4 * layout->part + align_up(cub_bytes, kScratchAlign) + kScratchAlign;
    return cudaSuccess;
}

template <typename T, int kVec>
int launch_accumulate(const uint32_t* sorted_ids, const uint32_t* sorted_positions, const T* dout,
                      size_t rows, size_t vocab, size_t dim, float* dtable, cudaStream_t stream) {
    const size_t packs = dim / kVec;
    const unsigned threads = row_threads(packs);
    const size_t chunks = (packs + threads - 1) / threads;
    if (chunks > 65535) return static_cast<int>(cudaErrorInvalidValue);
    const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(chunks));
    accumulate_kernel<T, kVec><<<grid, threads, 0, stream>>>(sorted_ids, sorted_positions, dout,
                                                             rows, vocab, dim, dtable);
    return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch_backward(const uint32_t* ids, const void* dout, size_t rows, Slice slice, size_t dim,
                    float* dtable, uint64_t* status, void* scratch, size_t scratch_bytes,
                    cudaStream_t stream) {
    if (!slice_ok(slice, rows, dim)) return static_cast<int>(cudaErrorInvalidValue);
    if (rows == 0) return static_cast<int>(cudaSuccess);
    // The table's rows are the sort's key range; `vocab` below is that count.
    const size_t vocab = slice.rows;
    if (ids == nullptr || dout == nullptr || status == nullptr || scratch == nullptr ||
        (vocab > 0 && dtable == nullptr))
        return static_cast<int>(cudaErrorInvalidValue);
    ScratchLayout layout;
    cudaError_t err = scratch_layout(rows, vocab, &layout);
    if (err != cudaSuccess) return static_cast<int>(err);
    if (scratch_bytes < layout.total) return static_cast<int>(cudaErrorInvalidValue);
    char* base = static_cast<char*>(scratch) +
                 (align_up(reinterpret_cast<uintptr_t>(scratch), kScratchAlign) -
                  reinterpret_cast<uintptr_t>(scratch));
    uint32_t* keys = reinterpret_cast<uint32_t*>(base);
    uint32_t* sorted_keys = reinterpret_cast<uint32_t*>(base + layout.part);
    uint32_t* positions = reinterpret_cast<uint32_t*>(base + 2 * layout.part);
    uint32_t* sorted_positions = reinterpret_cast<uint32_t*>(base + 3 * layout.part);
    void* cub_temp = base + 4 * layout.part;
    auto* st = reinterpret_cast<unsigned long long*>(status);

    const unsigned threads = 256;
    const size_t blocks = (rows + threads - 1) / threads;
    keys_kernel<<<static_cast<unsigned>(blocks < 65535 ? blocks : 65535), threads, 0, stream>>>(
        ids, rows, slice, keys, positions, st);
    err = cudaGetLastError();
    if (err != cudaSuccess) return static_cast<int>(err);
    size_t cub_bytes = layout.cub_bytes;
    err = cub::DeviceRadixSort::SortPairs(cub_temp, cub_bytes, keys, sorted_keys, positions,
                                          sorted_positions, static_cast<int>(rows), 0,
                                          key_bits(vocab), stream);
    if (err != cudaSuccess) return static_cast<int>(err);
    if (vocab == 0) return static_cast<int>(cudaGetLastError());  // no id has a table row

    const T* dy = static_cast<const T*>(dout);
    constexpr int kVec = 16 / sizeof(T);
    if (dim % kVec == 0 && aligned16(dout) && aligned16(dtable))
        return launch_accumulate<T, kVec>(sorted_keys, sorted_positions, dy, rows, vocab, dim,
                                          dtable, stream);
    return launch_accumulate<T, 1>(sorted_keys, sorted_positions, dy, rows, vocab, dim, dtable,
                                   stream);
}

}  // namespace

extern "C" int tilearn_embedding_forward(int dtype, const uint32_t* ids, const void* table,
                                         size_t rows, size_t vocab, size_t dim, void* out,
                                         uint64_t* status, cudaStream_t stream) {
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch_forward<decltype(tag)>(ids, table, rows, Slice{0, vocab, vocab}, dim, out,
                                             status, stream);
    });
}

extern "C" size_t tilearn_embedding_backward_scratch_bytes(size_t rows, size_t vocab) {
    if (!shape_ok(rows, vocab, 1)) return SIZE_MAX;
    if (rows == 0) return 0;
    ScratchLayout layout;
    if (scratch_layout(rows, vocab, &layout) != cudaSuccess) return SIZE_MAX;
    return layout.total;
}

extern "C" int tilearn_embedding_backward(int dtype, const uint32_t* ids, const void* dout,
                                          size_t rows, size_t vocab, size_t dim, float* dtable,
                                          uint64_t* status, void* scratch, size_t scratch_bytes,
                                          cudaStream_t stream) {
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch_backward<decltype(tag)>(ids, dout, rows, Slice{0, vocab, vocab}, dim,
                                              dtable, status, scratch, scratch_bytes, stream);
    });
}

extern "C" int tilearn_embedding_forward_slice(int dtype, const uint32_t* ids, const void* table,
                                               size_t rows, size_t vocab_start,
                                               size_t table_rows, size_t full_vocab, size_t dim,
                                               void* out, uint64_t* status,
                                               cudaStream_t stream) {
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch_forward<decltype(tag)>(ids, table, rows,
                                             Slice{vocab_start, table_rows, full_vocab}, dim,
                                             out, status, stream);
    });
}

extern "C" int tilearn_embedding_backward_slice(int dtype, const uint32_t* ids, const void* dout,
                                                size_t rows, size_t vocab_start,
                                                size_t table_rows, size_t full_vocab,
                                                size_t dim, float* dtable, uint64_t* status,
                                                void* scratch, size_t scratch_bytes,
                                                cudaStream_t stream) {
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch_backward<decltype(tag)>(ids, dout, rows,
                                              Slice{vocab_start, table_rows, full_vocab}, dim,
                                              dtable, status, scratch, scratch_bytes, stream);
    });
}
