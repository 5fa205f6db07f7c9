// cross_entropy.cu: token softmax cross-entropy over the vocabulary (Hugging Face semantics:
// targets already shifted, -100 ignored), forward and backward fused.
//
// Fused:     per row, one pass over the vocabulary computes the max and the sum of exp(x - max)
//            together (online softmax: the running sum is rescaled when the max grows), then the
//            fused variant makes a second pass that OVERWRITES the logits row in place with its
//            gradient (softmax - onehot(target)) * grad_scale. No f32 copy of the logits and no
//            probability buffer exist. A second, one-block kernel reduces the per-row losses
//            and the valid-target count, and finds the first out-of-range label; it also has a
//            launcher of its own (tilearn_cross_entropy_totals), for row losses written by
//            several launches over chunks of rows (the engine's chunked linear + cross entropy),
//            so the totals of a chunked step are those of one launch over all rows, bit for bit.
// Layout:    logits [rows, vocab] row-major (any vocab: no alignment or multiple is assumed);
//            targets [rows] i32; row_loss [rows] f32; totals [4] f64 (layout below). One thread
//            block per row. A row that starts on a 16-byte boundary and holds whole 16-byte
//            vectors (vocab a multiple of 8 in bf16/f16, of 4 in f32) is read and written as
//            vectors (each thread's elements in a fixed order either way).
// Precision: logits f32, bf16 or f16, read as f32; max, exp and the per-thread and block sums in
//            f32 (expf, not the fast-math __expf); the row loss is formed in f64 as
//            max + log(sum) - logit[target] and stored as f32. Gradients are computed in f32 and
//            rounded once, to nearest even, to the logits' type. In f16 a gradient of magnitude
//            >= 65520 (it rounds past the largest finite f16, 65504; possible with a GradScaler's
//            grad_scale = loss_scale / tokens, loss_scale up to 65536) becomes +-inf, never a
//            clamped value, so the scaler's non-finite check sees the overflow and skips the
//            step; the row loss is f32 and stays finite.
//            tilearn_cross_entropy_fused_device_scale reads grad_scale from device memory
//            when the kernel runs (a CUDA graph replays the step with each step's factor); the
//            arithmetic is the same, so the same factor gives the same bits.
// Output:    row_loss is written (`=`): 0 for ignored rows; the gradient is written (`=`, in
//            place), all zeros for ignored rows. totals is written (`=`):
//              totals[0] = sum of row losses over non-ignored rows, f64, in a fixed order
//                          (per-thread sums over a fixed row stride, then a fixed tree);
//              totals[1] = number of targets in [0, vocab) (exact in f64 below 2^53);
//              totals[2] = position of the first (lowest) target that is neither -100 nor in
//                          [0, vocab), or -1 if there is none;
//              totals[3] = that target's value (0 if none).
//            A row with an out-of-range target gets a NaN loss and (fused) a NaN gradient row,
//            so an unchecked error cannot train silently: the loss sum is then NaN too.
// Determinism: no atomics; every reduction has a fixed shape that depends only on
//            (rows, vocab), so results are bit-identical run to run.
//
// Vocabulary-parallel variant (tensor parallelism: a rank holds the logits of its columns
// col_start .. col_start + cols of a full vocabulary of full_vocab words; the caller completes
// the per-row statistics over the ranks between the launches):
//   tilearn_vocab_ce_partials   per row of the rank's [rows, cols] logits, one block per row:
//                               local_max = max over the slice, sumexp = sum of exp(x - local_max)
//                               (the same online pass as above), target_logit = the target's
//                               logit when the slice holds the target, else 0. All three f32,
//                               written (`=`). Ignored rows write (0, 0, 0); a target that is
//                               neither -100 nor in [0, full_vocab) writes target_logit = NaN.
//   (caller: global_max = all-reduce MAX of local_max)
//   tilearn_vocab_ce_rescale    sumexp *= exp(local_max - global_max), elementwise in f32 (`=`,
//                               in place; a zero sum stays zero), so the partial sums share
//                               the global max.
//   (caller: all-reduce SUM of sumexp and of target_logit)
//   tilearn_vocab_ce_fused_finish  per row: row_loss = global_max + log(sumexp) - target_logit
//                               formed in f64, stored f32 (`=`; 0 for ignored rows, NaN for a
//                               bad target), and the slice's logits OVERWRITTEN in place with
//                               (exp(x - global_max) / sumexp - onehot(target)) * grad_scale,
//                               f32 math rounded once to the logits' type (zeros for ignored
//                               rows, NaN for a bad target); the one-hot only where the slice
//                               holds the target.
//   tilearn_vocab_ce_loss_finish   the row losses only (evaluation), elementwise over rows.
//   Every rank then holds the same row losses; tilearn_cross_entropy_totals with full_vocab
//   reduces them. The slice's row pass is the whole-vocabulary kernels' (same vectorised
//   reads, same f32 expf); against one rank only the sum of exponentials is added in another
//   order (~1e-7 relative in f32).

#include <math.h>

#include "tilearn_dtype.cuh"
#include "tilearn_kernels.h"

namespace {

using tilearn::from_f32;
using tilearn::to_f32;

constexpr int32_t kIgnoreIndex = -100;
constexpr unsigned kTotalsThreads = 512;  // one block; a power of two for the tree reduction

__device__ __forceinline__ bool label_in_range(int32_t t, size_t vocab) {
    return t >= 0 && static_cast<size_t>(t) < vocab;
}

// Merges the partial (max, sum of exp(x - max)) pair (m2, s2) into (m, s). Symmetric in its two
// operands (fmaxf and the final addition commute), so butterfly exchanges leave every lane with
// the same bits. An empty partial is (-inf, 0); two empty partials stay empty (no inf - inf).
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
    const float mn = fmaxf(m, m2);
    if (mn == -INFINITY) return;
    s = s * expf(m - mn) + s2 * expf(m2 - mn);
    m = mn;
}

// The row's max and sum of exp(x - max), returned to every thread of the block.
// Each thread scans i = threadIdx.x + k * blockDim.x; the partials are merged by warp
// butterflies and then across warps in warp order: a fixed order for a given blockDim.
// blockDim.x must be a multiple of 32.
// One logit into a thread's running (max, sum of exp(x - max)).
__device__ __forceinline__ void online_add(float& m, float& s, float v) {
    if (v > m) {
        // exp(-inf - v) is 0 for the first element, so (m, s) = (v, 1).
        s = s * expf(m - v) + 1.0f;
        m = v;
    } else if (v != -INFINITY) {
        // A NaN logit lands here and makes s NaN (and the loss with it), as it should.
        s += expf(v - m);
    }
}

// Whether a row of `vocab` elements starting at `x` is read as 16-byte vectors: thread i then
// takes the vectors i, i + blockDim.x, ... and their elements in order, instead of the
// elements i, i + blockDim.x, ... (a different but equally fixed order).
template <typename T>
__device__ __forceinline__ bool row_vectorized(const T* x, size_t vocab) {
    return vocab % tilearn::Vec16<T>::kLen == 0 && tilearn::aligned16(x);
}

template <typename T>
__device__ void row_max_sumexp(const T* __restrict__ x, size_t vocab, float& m_out,
                               float& s_out) {
    float m = -INFINITY, s = 0.0f;
    if (row_vectorized(x, vocab)) {
        using V = tilearn::Vec16<T>;
        const V* xv = reinterpret_cast<const V*>(x);
        for (size_t i = threadIdx.x; i < vocab / V::kLen; i += blockDim.x) {
            const V v = xv[i];
#pragma unroll
            for (int e = 0; e < V::kLen; ++e) online_add(m, s, to_f32(v.v[e]));
        }
    } else {
        for (size_t i = threadIdx.x; i < vocab; i += blockDim.x) online_add(m, s, to_f32(x[i]));
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
        merge(m, s, m2, s2);
    }
    __shared__ float warp_m[32], warp_s[32];
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        warp_m[warp] = m;
        warp_s[warp] = s;
    }
    __syncthreads();
    if (warp == 0) {
        const bool live = lane < blockDim.x / 32;
        m = live ? warp_m[lane] : -INFINITY;
        s = live ? warp_s[lane] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) {
            const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
            const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
            merge(m, s, m2, s2);
        }
        if (lane == 0) {
            warp_m[0] = m;
            warp_s[0] = s;
        }
    }
    __syncthreads();
    m_out = warp_m[0];
    s_out = warp_s[0];
}

// loss = max + log(sum) - x[target], formed in f64 (one per row, so the cost is nil).
__device__ __forceinline__ float row_loss_of(float m, float s, float x_target) {
    return static_cast<float>(static_cast<double>(m) + log(static_cast<double>(s)) -
                              static_cast<double>(x_target));
}

template <typename T>
__global__ void ce_fused_kernel(T* __restrict__ logits, const int32_t* __restrict__ targets,
                                size_t vocab, float host_grad_scale,
                                const float* __restrict__ device_grad_scale,
                                float* __restrict__ row_loss) {
    const size_t row = blockIdx.x;
    T* x = logits + row * vocab;
    // A CUDA graph replays the launch with the factor of each step read from device memory.
    const float grad_scale = device_grad_scale != nullptr ? *device_grad_scale : host_grad_scale;
    const int32_t t = targets[row];
    if (t == kIgnoreIndex) {
        for (size_t i = threadIdx.x; i < vocab; i += blockDim.x) x[i] = from_f32<T>(0.0f);
        if (threadIdx.x == 0) row_loss[row] = 0.0f;
        return;
    }
    const bool ok = label_in_range(t, vocab);
    // Read before the barriers inside row_max_sumexp: every overwrite of the row comes after
    // them, so thread 0 sees the original logit.
    float x_target = NAN;
    if (threadIdx.x == 0 && ok) x_target = to_f32(x[t]);
    float m, s;
    row_max_sumexp(x, vocab, m, s);
    if (threadIdx.x == 0) row_loss[row] = ok ? row_loss_of(m, s, x_target) : NAN;
    if (!ok) {
        for (size_t i = threadIdx.x; i < vocab; i += blockDim.x) x[i] = from_f32<T>(NAN);
        return;
    }
    const float p_scale = grad_scale / s;
    const size_t target = static_cast<size_t>(t);
    if (row_vectorized(x, vocab)) {
        using V = tilearn::Vec16<T>;
        V* xv = reinterpret_cast<V*>(x);
        for (size_t i = threadIdx.x; i < vocab / V::kLen; i += blockDim.x) {
            V v = xv[i];
#pragma unroll
            for (int e = 0; e < V::kLen; ++e) {
                float g = expf(to_f32(v.v[e]) - m) * p_scale;
                if (i * V::kLen + e == target) g -= grad_scale;
                v.v[e] = from_f32<T>(g);
            }
            xv[i] = v;
        }
        return;
    }
    for (size_t i = threadIdx.x; i < vocab; i += blockDim.x) {
        float g = expf(to_f32(x[i]) - m) * p_scale;
        if (i == target) g -= grad_scale;
        x[i] = from_f32<T>(g);
    }
}

template <typename T>
__global__ void ce_forward_kernel(const T* __restrict__ logits,
                                  const int32_t* __restrict__ targets, size_t vocab,
                                  float* __restrict__ row_loss) {
    const size_t row = blockIdx.x;
    const int32_t t = targets[row];
    if (t == kIgnoreIndex) {
        if (threadIdx.x == 0) row_loss[row] = 0.0f;
        return;
    }
    const T* x = logits + row * vocab;
    const bool ok = label_in_range(t, vocab);
    float m, s;
    row_max_sumexp(x, vocab, m, s);
    if (threadIdx.x == 0) row_loss[row] = ok ? row_loss_of(m, s, to_f32(x[t])) : NAN;
}

// One block of kTotalsThreads threads. Thread j takes rows j, j + kTotalsThreads, ... in order,
// then a shared-memory tree halves the partials: the summation order depends only on `rows`.
__global__ void ce_totals_kernel(const float* __restrict__ row_loss,
                                 const int32_t* __restrict__ targets, size_t rows, size_t vocab,
                                 double* __restrict__ totals) {
    __shared__ double sum_sh[kTotalsThreads];
    __shared__ unsigned long long valid_sh[kTotalsThreads];
    __shared__ unsigned long long bad_sh[kTotalsThreads];
    double sum = 0.0;
    unsigned long long valid = 0, bad = ~0ull;
    for (size_t r = threadIdx.x; r < rows; r += kTotalsThreads) {
        const int32_t t = targets[r];
        if (t == kIgnoreIndex) continue;
        if (label_in_range(t, vocab)) {
            ++valid;
        } else if (bad == ~0ull) {
            bad = r;  // rows increase along the loop: the first bad one is this thread's lowest
        }
        sum += static_cast<double>(row_loss[r]);
    }
    sum_sh[threadIdx.x] = sum;
    valid_sh[threadIdx.x] = valid;
    bad_sh[threadIdx.x] = bad;
    __syncthreads();
    for (unsigned half = kTotalsThreads / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) {
            sum_sh[threadIdx.x] += sum_sh[threadIdx.x + half];
            valid_sh[threadIdx.x] += valid_sh[threadIdx.x + half];
            const unsigned long long other = bad_sh[threadIdx.x + half];
            if (other < bad_sh[threadIdx.x]) bad_sh[threadIdx.x] = other;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        totals[0] = sum_sh[0];
        totals[1] = static_cast<double>(valid_sh[0]);
        const unsigned long long first_bad = bad_sh[0];
        totals[2] = first_bad == ~0ull ? -1.0 : static_cast<double>(first_bad);
        totals[3] = first_bad == ~0ull ? 0.0 : static_cast<double>(targets[first_bad]);
    }
}

// ---- vocabulary-parallel cross entropy (see the header) ----

__device__ __forceinline__ bool in_slice(int32_t t, size_t col_start, size_t cols) {
    return t >= 0 && static_cast<size_t>(t) >= col_start &&
           static_cast<size_t>(t) - col_start < cols;
}

template <typename T>
__global__ void vocab_partials_kernel(const T* __restrict__ logits,
                                      const int32_t* __restrict__ targets, size_t cols,
                                      size_t col_start, size_t full_vocab,
                                      float* __restrict__ local_max, float* __restrict__ sumexp,
                                      float* __restrict__ target_logit) {
    const size_t row = blockIdx.x;
    const int32_t t = targets[row];
    if (t == kIgnoreIndex) {
        if (threadIdx.x == 0) {
            local_max[row] = 0.0f;
            sumexp[row] = 0.0f;
            target_logit[row] = 0.0f;
        }
        return;
    }
    const T* x = logits + row * cols;
    float m, s;
    row_max_sumexp(x, cols, m, s);
    if (threadIdx.x == 0) {
        local_max[row] = m;
        sumexp[row] = s;
        float xt = 0.0f;
        if (!label_in_range(t, full_vocab)) {
            xt = NAN;
        } else if (in_slice(t, col_start, cols)) {
            xt = to_f32(x[static_cast<size_t>(t) - col_start]);
        }
        target_logit[row] = xt;
    }
}

__global__ void vocab_rescale_kernel(const float* __restrict__ local_max,
                                     const float* __restrict__ global_max,
                                     float* __restrict__ sumexp, size_t rows) {
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    for (size_t r = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < rows;
         r += stride) {
        const float s = sumexp[r];
        // A zero partial (ignored row) stays zero, whatever the maxima (no 0 * inf).
        if (s != 0.0f) sumexp[r] = s * expf(local_max[r] - global_max[r]);
    }
}

template <typename T>
__global__ void vocab_fused_finish_kernel(T* __restrict__ logits,
                                          const int32_t* __restrict__ targets, size_t cols,
                                          size_t col_start, size_t full_vocab,
                                          const float* __restrict__ global_max,
                                          const float* __restrict__ sumexp,
                                          const float* __restrict__ target_logit,
                                          float grad_scale, float* __restrict__ row_loss) {
    const size_t row = blockIdx.x;
    T* x = logits + row * cols;
    const int32_t t = targets[row];
    if (t == kIgnoreIndex) {
        for (size_t i = threadIdx.x; i < cols; i += blockDim.x) x[i] = from_f32<T>(0.0f);
        if (threadIdx.x == 0) row_loss[row] = 0.0f;
        return;
    }
    const bool ok = label_in_range(t, full_vocab);
    const float m = global_max[row], s = sumexp[row];
    if (threadIdx.x == 0) row_loss[row] = ok ? row_loss_of(m, s, target_logit[row]) : NAN;
    if (!ok) {
        for (size_t i = threadIdx.x; i < cols; i += blockDim.x) x[i] = from_f32<T>(NAN);
        return;
    }
    const float p_scale = grad_scale / s;
    // The target's column in this slice, or cols (never matched) when another rank holds it.
    const size_t target = in_slice(t, col_start, cols) ? static_cast<size_t>(t) - col_start : cols;
    if (row_vectorized(x, cols)) {
        using V = tilearn::Vec16<T>;
        V* xv = reinterpret_cast<V*>(x);
        for (size_t i = threadIdx.x; i < cols / V::kLen; i += blockDim.x) {
            V v = xv[i];
#pragma unroll
            for (int e = 0; e < V::kLen; ++e) {
                float g = expf(to_f32(v.v[e]) - m) * p_scale;
                if (i * V::kLen + e == target) g -= grad_scale;
                v.v[e] = from_f32<T>(g);
            }
            xv[i] = v;
        }
        return;
    }
    for (size_t i = threadIdx.x; i < cols; i += blockDim.x) {
        float g = expf(to_f32(x[i]) - m) * p_scale;
        if (i == target) g -= grad_scale;
        x[i] = from_f32<T>(g);
    }
}

__global__ void vocab_loss_finish_kernel(const int32_t* __restrict__ targets, size_t rows,
                                         size_t full_vocab, const float* __restrict__ global_max,
                                         const float* __restrict__ sumexp,
                                         const float* __restrict__ target_logit,
                                         float* __restrict__ row_loss) {
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    for (size_t r = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < rows;
         r += stride) {
        const int32_t t = targets[r];
        if (t == kIgnoreIndex) {
            row_loss[r] = 0.0f;
        } else if (!label_in_range(t, full_vocab)) {
            row_loss[r] = NAN;
        } else {
            row_loss[r] = row_loss_of(global_max[r], sumexp[r], target_logit[r]);
        }
    }
}

// Grid of an elementwise kernel over rows (grid-stride loop past 65535 blocks).
unsigned elementwise_blocks(size_t rows) {
    const size_t blocks = (rows + 255) / 256;
    return static_cast<unsigned>(blocks < 65535 ? blocks : 65535);
}

unsigned threads_for(size_t vocab) {
    if (vocab <= 1024) return 128;
    if (vocab <= 8192) return 256;
    return 512;
}

// rows fit the grid's x dimension (and, as positions, exactly in f64); rows * vocab fits size_t.
bool shape_ok(size_t rows, size_t vocab) {
    return rows <= 0x7fffffffu && (vocab == 0 || rows <= SIZE_MAX / vocab);
}

bool pointers_ok(const void* logits, const int32_t* targets, size_t rows, size_t vocab,
                 const float* row_loss, const double* totals) {
    if (totals == nullptr) return false;
    if (rows == 0) return true;
    return targets != nullptr && row_loss != nullptr && (vocab == 0 || logits != nullptr);
}

int launch_totals(const float* row_loss, const int32_t* targets, size_t rows, size_t vocab,
                  double* totals, cudaStream_t stream) {
    ce_totals_kernel<<<1, kTotalsThreads, 0, stream>>>(row_loss, targets, rows, vocab, totals);
    return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch_fused(void* logits, const int32_t* targets, size_t rows, size_t vocab,
                 float grad_scale, const float* device_grad_scale, float* row_loss,
                 double* totals, cudaStream_t stream) {
    if (!shape_ok(rows, vocab) || !isfinite(grad_scale) ||
        !pointers_ok(logits, targets, rows, vocab, row_loss, totals))
        return static_cast<int>(cudaErrorInvalidValue);
    if (rows > 0) {
        ce_fused_kernel<T><<<static_cast<unsigned>(rows), threads_for(vocab), 0, stream>>>(
            static_cast<T*>(logits), targets, vocab, grad_scale, device_grad_scale, row_loss);
        const cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess) return static_cast<int>(err);
    }
    // Also for rows == 0: the totals are always written, so they never hold a stale result.
    return launch_totals(row_loss, targets, rows, vocab, totals, stream);
}

template <typename T>
int launch_forward(const void* logits, const int32_t* targets, size_t rows, size_t vocab,
                   float* row_loss, double* totals, cudaStream_t stream) {
    if (!shape_ok(rows, vocab) || !pointers_ok(logits, targets, rows, vocab, row_loss, totals))
        return static_cast<int>(cudaErrorInvalidValue);
    if (rows > 0) {
        ce_forward_kernel<T><<<static_cast<unsigned>(rows), threads_for(vocab), 0, stream>>>(
            static_cast<const T*>(logits), targets, vocab, row_loss);
        const cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess) return static_cast<int>(err);
    }
    return launch_totals(row_loss, targets, rows, vocab, totals, stream);
}

// The slice lies inside the vocabulary and is not empty; the shapes fit the grid.
bool slice_ok(size_t rows, size_t cols, size_t col_start, size_t full_vocab) {
    return cols > 0 && col_start <= full_vocab && cols <= full_vocab - col_start &&
           full_vocab <= 0x7fffffffu && shape_ok(rows, cols);
}

template <typename T>
int launch_vocab_partials(const void* logits, const int32_t* targets, size_t rows, size_t cols,
                          size_t col_start, size_t full_vocab, float* local_max, float* sumexp,
                          float* target_logit, cudaStream_t stream) {
    if (!slice_ok(rows, cols, col_start, full_vocab)) return static_cast<int>(cudaErrorInvalidValue);
    if (rows == 0) return static_cast<int>(cudaSuccess);
    if (logits == nullptr || targets == nullptr || local_max == nullptr || sumexp == nullptr ||
        target_logit == nullptr)
        return static_cast<int>(cudaErrorInvalidValue);
    vocab_partials_kernel<T><<<static_cast<unsigned>(rows), threads_for(cols), 0, stream>>>(
        static_cast<const T*>(logits), targets, cols, col_start, full_vocab, local_max, sumexp,
        target_logit);
    return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch_vocab_fused_finish(void* logits, const int32_t* targets, size_t rows, size_t cols,
                              size_t col_start, size_t full_vocab, const float* global_max,
                              const float* sumexp, const float* target_logit, float grad_scale,
                              float* row_loss, cudaStream_t stream) {
    if (!slice_ok(rows, cols, col_start, full_vocab) || !isfinite(grad_scale))
        return static_cast<int>(cudaErrorInvalidValue);
    if (rows == 0) return static_cast<int>(cudaSuccess);
    if (logits == nullptr || targets == nullptr || global_max == nullptr || sumexp == nullptr ||
        target_logit == nullptr || row_loss == nullptr)
        return static_cast<int>(cudaErrorInvalidValue);
    vocab_fused_finish_kernel<T><<<static_cast<unsigned>(rows), threads_for(cols), 0, stream>>>(
        static_cast<T*>(logits), targets, cols, col_start, full_vocab, global_max, sumexp,
        target_logit, grad_scale, row_loss);
    return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" int tilearn_cross_entropy_fused(int dtype, void* logits, const int32_t* targets,
                                           size_t rows, size_t vocab, float grad_scale,
                                           float* row_loss, double* totals,
                                           cudaStream_t stream) {
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch_fused<decltype(tag)>(logits, targets, rows, vocab, grad_scale, nullptr,
                                           row_loss, totals, stream);
    });
}

extern "C" int tilearn_cross_entropy_fused_device_scale(int dtype, void* logits,
                                                        const int32_t* targets, size_t rows,
                                                        size_t vocab, const float* grad_scale,
                                                        float* row_loss, double* totals,
                                                        cudaStream_t stream) {
    if (grad_scale == nullptr) return static_cast<int>(cudaErrorInvalidValue);
    return tilearn::dispatch(dtype, [&](auto tag) {
        // 1.0f only passes the host-side finiteness check; the kernel reads *grad_scale.
        return launch_fused<decltype(tag)>(logits, targets, rows, vocab, 1.0f, grad_scale,
                                           row_loss, totals, stream);
    });
}

extern "C" int tilearn_cross_entropy_totals(const float* row_loss, const int32_t* targets,
                                            size_t rows, size_t vocab, double* totals,
                                            cudaStream_t stream) {
    if (!shape_ok(rows, vocab) || totals == nullptr ||
        (rows > 0 && (row_loss == nullptr || targets == nullptr)))
        return static_cast<int>(cudaErrorInvalidValue);
    return launch_totals(row_loss, targets, rows, vocab, totals, stream);
}

extern "C" int tilearn_cross_entropy_forward(int dtype, const void* logits,
                                             const int32_t* targets, size_t rows, size_t vocab,
                                             float* row_loss, double* totals,
                                             cudaStream_t stream) {
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch_forward<decltype(tag)>(logits, targets, rows, vocab, row_loss, totals,
                                             stream);
    });
}

extern "C" int tilearn_vocab_ce_partials(int dtype, const void* logits, const int32_t* targets,
                                         size_t rows, size_t cols, size_t col_start,
                                         size_t full_vocab, float* local_max, float* sumexp,
                                         float* target_logit, cudaStream_t stream) {
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch_vocab_partials<decltype(tag)>(logits, targets, rows, cols, col_start,
                                                    full_vocab, local_max, sumexp, target_logit,
                                                    stream);
    });
}

extern "C" int tilearn_vocab_ce_rescale(const float* local_max, const float* global_max,
                                        float* sumexp, size_t rows, cudaStream_t stream) {
    if (rows > 0x7fffffffu) return static_cast<int>(cudaErrorInvalidValue);
    if (rows == 0) return static_cast<int>(cudaSuccess);
    if (local_max == nullptr || global_max == nullptr || sumexp == nullptr)
        return static_cast<int>(cudaErrorInvalidValue);
    vocab_rescale_kernel<<<elementwise_blocks(rows), 256, 0, stream>>>(local_max, global_max,
                                                                       sumexp, rows);
    return static_cast<int>(cudaGetLastError());
}

extern "C" int tilearn_vocab_ce_fused_finish(int dtype, void* logits, const int32_t* targets,
                                             size_t rows, size_t cols, size_t col_start,
                                             size_t full_vocab, const float* global_max,
                                             const float* sumexp, const float* target_logit,
                                             float grad_scale, float* row_loss,
                                             cudaStream_t stream) {
    return tilearn::dispatch(dtype, [&](auto tag) {
        return launch_vocab_fused_finish<decltype(tag)>(logits, targets, rows, cols, col_start,
                                                        full_vocab, global_max, sumexp,
                                                        target_logit, grad_scale, row_loss,
                                                        stream);
    });
}

extern "C" int tilearn_vocab_ce_loss_finish(const int32_t* targets, size_t rows,
                                            size_t full_vocab, const float* global_max,
                                            const float* sumexp, const float* target_logit,
                                            float* row_loss, cudaStream_t stream) {
    if (rows > 0x7fffffffu || full_vocab > 0x7fffffffu)
        return static_cast<int>(cudaErrorInvalidValue);
    if (rows == 0) return static_cast<int>(cudaSuccess);
    if (targets == nullptr || global_max == nullptr || sumexp == nullptr ||
        target_logit == nullptr || row_loss == nullptr)
        return static_cast<int>(cudaErrorInvalidValue);
    vocab_loss_finish_kernel<<<elementwise_blocks(rows), 256, 0, stream>>>(
        targets, rows, full_vocab, global_max, sumexp, target_logit, row_loss);
    return static_cast<int>(cudaGetLastError());
}
