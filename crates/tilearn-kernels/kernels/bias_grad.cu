// bias_grad.cu: the bias gradient of a linear layer, db[j] += sum over rows r of dout[r, j].
//
// Fused:     nothing beyond the column sum; the f32 accumulation and the `+=` into db happen in
//            the same pass (no separate zero-and-add).
// Layout:    dout [rows, cols] row-major (cols = out_features), db [cols].
// Precision: dout f32, bf16 or f16 (the launcher's dtype); every sum in f32; db f32.
// Gradients: db is accumulated (`+=`), the parameter-gradient convention.
// Determinism: no atomics. Pass 1 cuts the rows into `chunks` contiguous ranges (a function of
//            `rows` only); each block sums 32 columns of one range, every thread a fixed stride
//            of rows in order, then the 8 row-lanes are added in lane order. With one range the
//            block adds straight into db; otherwise pass 2 adds the per-range partials (scratch)
//            in range order. The result is bit-identical from run to run.

#include "tilearn_dtype.cuh"
#include "tilearn_kernels.h"

namespace {

constexpr int kCols = 32;          // columns per block (one warp-wide row segment)
constexpr int kLanes = 8;          // row lanes per block
constexpr size_t kRowsPerChunk = 256;
constexpr size_t kMaxChunks = 64;

size_t chunks_for(size_t rows) {
    size_t c = (rows + kRowsPerChunk - 1) / kRowsPerChunk;
    if (c < 1) c = 1;
    return c < kMaxChunks ? c : kMaxChunks;
}

// Grid (ceil(cols / 32), chunks), block (32, 8). Chunk c covers rows [c * per, min(rows, (c+1) *
// per)). Writes db[col] += sum (chunks == 1) or partials[c * cols + col] = sum.
template <typename T>
__global__ void column_sum_kernel(const T* __restrict__ dout, size_t rows, size_t cols,
                                  size_t rows_per_chunk, int direct, float* __restrict__ db,
                                  float* __restrict__ partials) {
    __shared__ float lane_sums[kLanes][kCols];
    const size_t col = static_cast<size_t>(blockIdx.x) * kCols + threadIdx.x;
    const size_t r0 = static_cast<size_t>(blockIdx.y) * rows_per_chunk;
    size_t r1 = r0 + rows_per_chunk;
    if (r1 > rows) r1 = rows;
    float sum = 0.0f;
    if (col < cols) {
        for (size_t r = r0 + threadIdx.y; r < r1; r += kLanes)
            sum += tilearn::to_f32(dout[r * cols + col]);
    }
    lane_sums[threadIdx.y][threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.y != 0 || col >= cols) return;
    float total = lane_sums[0][threadIdx.x];
#pragma unroll
    for (int l = 1; l < kLanes; ++l) total += lane_sums[l][threadIdx.x];
    if (direct) {
        db[col] += total;
    } else {
        partials[static_cast<size_t>(blockIdx.y) * cols + col] = total;
    }
}

// One thread per column: db[col] += partials[0][col] + partials[1][col] + ... in chunk order.
__global__ void finish_kernel(const float* __restrict__ partials, size_t chunks, size_t cols,
                              float* __restrict__ db) {
    const size_t col = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (col >= cols) return;
    float total = 0.0f;
    for (size_t c = 0; c < chunks; ++c) total += partials[c * cols + col];
    db[col] += total;
}

template <typename T>
int launch(const void* dout, size_t rows, size_t cols, float* db, float* scratch,
           size_t scratch_len, cudaStream_t stream) {
    if (rows == 0 || cols == 0) return static_cast<int>(cudaSuccess);
    if (dout == nullptr || db == nullptr) return static_cast<int>(cudaErrorInvalidValue);
    const size_t chunks = chunks_for(rows);
    const size_t need = tilearn_bias_grad_scratch_len(rows, cols);
    if (need > 0 && (scratch == nullptr || scratch_len < need))
        return static_cast<int>(cudaErrorInvalidValue);
    const size_t col_blocks = (cols + kCols - 1) / kCols;
    if (col_blocks > 0x7fffffffu) return static_cast<int>(cudaErrorInvalidValue);
    const size_t rows_per_chunk = (rows + chunks - 1) / chunks;
    const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(chunks));
    const dim3 block(kCols, kLanes);
    const int direct = chunks == 1 ? 1 : 0;
    column_sum_kernel<T><<<grid, block, 0, stream>>>(static_cast<const T*>(dout), rows, cols,
                                                     rows_per_chunk, direct, db, scratch);
    if (!direct) {
        const unsigned threads = 256;
        const size_t blocks = (cols + threads - 1) / threads;
        finish_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(scratch, chunks,
                                                                              cols, db);
    }
    return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" size_t tilearn_bias_grad_scratch_len(size_t rows, size_t cols) {
    const size_t chunks = chunks_for(rows);
    if (chunks == 1) return 0;
    if (cols > SIZE_MAX / chunks) return SIZE_MAX;
    return chunks * cols;
}

extern "C" int tilearn_bias_grad(int dtype, const void* dout, size_t rows, size_t cols, float* db,
                                 float* scratch, size_t scratch_len, cudaStream_t stream) {
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch<decltype(tag)>(dout, rows, cols, db, scratch, scratch_len, stream);
    });
}
