// row_copy.cu: the moves of tilearn-recsys' row cache (tables larger than the GPU): whole rows
// copied between the tables in pinned host memory and the cache on the device, every row of a
// batch's moves in one launch.
//
//   copy_rows: for each move i, dst[dst_i .. dst_i + len_i] = src[src_i .. src_i + len_i]
//
// Fused:     one launch per buffer and direction (weights, optimizer state) instead of one copy
//            per row: a batch moves thousands of rows of 64 bytes, where a copy call each would
//            cost more than the bytes.
// Layout:    src / dst: flat f32 buffers; one of them is page-locked host memory mapped into the
//            device's address space (cuMemHostAlloc with DEVICEMAP: the kernel reads or writes it
//            over the bus, zero-copy), the other device memory. moves: [n, 3] u64, (src element
//            offset, dst element offset, element count) per move. The caller guarantees that
//            every move lies inside both buffers and that no two moves write the same element.
// Precision: bit copies (f32 bits are moved, never converted).
// Output:    dst written (=) at the moved elements only. One warp per move; a move whose
//            offsets and count are multiples of 4 is copied as float4 (both buffers are at
//            least 16-byte aligned: allocations are).

#include "tilearn_kernels.h"

namespace {

constexpr unsigned kThreads = 256;
constexpr unsigned kWarps = kThreads / 32;
constexpr unsigned kMaxBlocks = 65535;  // grid-stride loops cover the rest

__global__ void copy_rows_kernel(const float* __restrict__ src, float* __restrict__ dst,
                                 const unsigned long long* __restrict__ moves, size_t n) {
    const unsigned lane = threadIdx.x & 31u;
    const size_t first = blockIdx.x * size_t(kWarps) + threadIdx.x / 32u;
    for (size_t m = first; m < n; m += size_t(gridDim.x) * kWarps) {
        const unsigned long long from = moves[3 * m];
        const unsigned long long to = moves[3 * m + 1];
        const unsigned long long len = moves[3 * m + 2];
        if (((from | to | len) & 3ull) == 0) {
            const float4* s = reinterpret_cast<const float4*>(src + from);
            float4* d = reinterpret_cast<float4*>(dst + to);
            for (unsigned long long i = lane; i < len / 4; i += 32) d[i] = s[i];
        } else {
            for (unsigned long long i = lane; i < len; i += 32) dst[to + i] = src[from + i];
        }
    }
}

}  // namespace

extern "C" int tilearn_copy_rows(const float* src, float* dst, const uint64_t* moves, size_t n,
                                 cudaStream_t stream) {
    if (n == 0) return static_cast<int>(cudaSuccess);
    if (src == nullptr || dst == nullptr || moves == nullptr)
        return static_cast<int>(cudaErrorInvalidValue);
    const size_t blocks = (n + kWarps - 1) / kWarps;
    const unsigned grid = static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
    copy_rows_kernel<<<grid, kThreads, 0, stream>>>(
        src, dst, reinterpret_cast<const unsigned long long*>(moves), n);
    return static_cast<int>(cudaGetLastError());
}
