// ctr_head.cu: the parts of tilearn-recsys' CTR models (DeepFM, Wide & Deep) between the fused
// embedding bag and the dense optimizer that are not matrix products (those go through
// cuBLASLt: tilearn-ops' linear_forward / linear_backward).
//
//   mlp_input:     x0[b] = [emb[b, 0:deep], dense[b]]            (the MLP's input row)
//   relu_forward:  a = max(z, 0);  relu_backward: dx = (z <= 0) ? 0 : dx   (in place)
//   logits_loss:   z_b = bias + mlp_b + sum(emb[b, deep:width]) + dense_b . w_dense
//                        [+ 0.5 * sum_j ((sum_f v_fj)^2 - sum_f v_fj^2)   when fm != 0]
//                  loss_b = max(z, 0) - z y + ln(1 + exp(-|z|))  (f64, BCE-with-logits),
//                  dlogit_b = (sigmoid(z_b) - y_b) * dlogit_scale
//   head_backward: demb[b, deep:width] = g_b;  demb[b, f k + j] = [fm] g_b (sum_f' v_f'j - v_fj)
//                  + dx0[b, f k + j]
//   batch_sums:    dw_dense[i] += sum_b g_b x_bi,  dbias += sum_b g_b,  loss_sum = sum_b loss_b
//
// Fused:     logits_loss computes the logit, its loss term and its gradient in one pass; the
//            FM's interaction gradient and the MLP input gradient meet in head_backward (one
//            write of demb); batch_sums does every batch reduction of the step in one launch.
// Layout:    emb / demb: [batch, width] f32, the fields' dim-k embeddings at columns 0..deep
//            (deep = fields * k; field f at f k), the dim-1 first-order / cross weights after
//            them; dense: [batch, num_dense]; x0 / dx0: [batch, deep + num_dense]; mlp, labels,
//            logits, dlogits: [batch]; loss terms [batch] f64.
// Precision: f32 storage and arithmetic, f64 for the loss. Sums over a sample run across a
//            warp (a tree; the CPU reference of tilearn-recsys' model/head.rs adds serially, so
//            they differ by rounding only), except the FM column sums of head_backward, which
//            run over the fields in the CPU's order. exp is expf (no fast math).
// Output:    mlp_input, relu_forward, logits, dlogits, loss terms, demb and loss_sum are written
//            (=); relu_backward overwrites dx in place; dw_dense and dbias are accumulated
//            (+=). Deterministic: no atomics, fixed reduction trees.

#include "tilearn_kernels.h"

namespace {

constexpr unsigned kThreads = 256;
constexpr unsigned kWarps = kThreads / 32;
constexpr unsigned kMaxBlocks = 65535;  // grid-stride loops cover the rest

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Evaluated on the side where exp cannot overflow (as tilearn-recsys' `sigmoid`).
__device__ __forceinline__ float sigmoid(float z) {
    if (z >= 0.0f) return 1.0f / (1.0f + expf(-z));
    const float e = expf(z);
    return e / (1.0f + e);
}

unsigned blocks_for(size_t n, size_t per_block) {
    const size_t b = (n + per_block - 1) / per_block;
    return static_cast<unsigned>(b < kMaxBlocks ? (b > 0 ? b : 1) : kMaxBlocks);
}

__global__ void mlp_input_kernel(const float* __restrict__ emb, size_t width, size_t deep,
                                 const float* __restrict__ dense, size_t num_dense, size_t batch,
                                 float* __restrict__ x0) {
    const size_t cols = deep + num_dense;
    const size_t n = batch * cols;
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
         i += size_t(gridDim.x) * blockDim.x) {
        const size_t b = i / cols, c = i % cols;
        x0[i] = c < deep ? emb[b * width + c] : dense[b * num_dense + (c - deep)];
    }
}

__global__ void relu_forward_kernel(const float* __restrict__ z, float* __restrict__ a, size_t n) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
         i += size_t(gridDim.x) * blockDim.x)
        a[i] = fmaxf(z[i], 0.0f);
}

__global__ void relu_backward_kernel(float* __restrict__ dx, const float* __restrict__ z,
                                     size_t n) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
         i += size_t(gridDim.x) * blockDim.x)
        if (z[i] <= 0.0f) dx[i] = 0.0f;
}

// One warp per sample.
__global__ void logits_loss_kernel(int fm, const float* __restrict__ emb, size_t width,
                                   size_t fields, size_t k, const float* __restrict__ dense,
                                   size_t num_dense, const float* __restrict__ w_dense,
                                   const float* __restrict__ bias, const float* __restrict__ mlp,
                                   const float* __restrict__ labels, size_t batch,
                                   float dlogit_scale, float* __restrict__ logits,
                                   float* __restrict__ dlogits, double* __restrict__ loss_terms) {
    const unsigned lane = threadIdx.x % 32;
    const size_t deep = fields * k;
    for (size_t b = blockIdx.x * size_t(kWarps) + threadIdx.x / 32; b < batch;
         b += size_t(gridDim.x) * kWarps) {
        const float* row = emb + b * width;
        float first = 0.0f;
        for (size_t c = deep + lane; c < width; c += 32) first += row[c];
        float lin = 0.0f;
        for (size_t i = lane; i < num_dense; i += 32)
            lin = __fadd_rn(lin, __fmul_rn(dense[b * num_dense + i], w_dense[i]));
        float inter = 0.0f;
        if (fm) {
            for (size_t j = lane; j < k; j += 32) {
                float sum = 0.0f, sum_sq = 0.0f;
                for (size_t f = 0; f < fields; ++f) {
                    const float v = row[f * k + j];
                    sum = __fadd_rn(sum, v);
                    sum_sq = __fadd_rn(sum_sq, __fmul_rn(v, v));
                }
                inter = __fadd_rn(inter, __fsub_rn(__fmul_rn(sum, sum), sum_sq));
            }
        }
        first = warp_sum(first);
        lin = warp_sum(lin);
        inter = warp_sum(inter);
        if (lane == 0) {
            float z = __fadd_rn(bias[0], mlp[b]);
            z = __fadd_rn(__fadd_rn(z, first), lin);
            if (fm) z = __fadd_rn(z, __fmul_rn(0.5f, inter));
            logits[b] = z;
            if (labels != nullptr) {
                const float y = labels[b];
                const double zd = z;
                loss_terms[b] = fmax(zd, 0.0) - zd * double(y) + log1p(exp(-fabs(zd)));
                dlogits[b] = __fmul_rn(__fsub_rn(sigmoid(z), y), dlogit_scale);
            }
        }
    }
}

// One warp per sample; lane j owns FM column j (the fields summed in order, as the CPU).
__global__ void head_backward_kernel(int fm, const float* __restrict__ emb, size_t width,
                                     size_t fields, size_t k, const float* __restrict__ dlogits,
                                     const float* __restrict__ dx0, size_t mlp_in, size_t batch,
                                     float* __restrict__ demb) {
    const unsigned lane = threadIdx.x % 32;
    const size_t deep = fields * k;
    for (size_t b = blockIdx.x * size_t(kWarps) + threadIdx.x / 32; b < batch;
         b += size_t(gridDim.x) * kWarps) {
        const float g = dlogits[b];
        const float* row = emb + b * width;
        float* drow = demb + b * width;
        const float* dx = dx0 + b * mlp_in;
        for (size_t c = deep + lane; c < width; c += 32) drow[c] = g;
        for (size_t j = lane; j < k; j += 32) {
            float sum = 0.0f;
            if (fm)
                for (size_t f = 0; f < fields; ++f) sum = __fadd_rn(sum, row[f * k + j]);
            for (size_t f = 0; f < fields; ++f) {
                const size_t c = f * k + j;
                const float own = fm ? __fmul_rn(g, __fsub_rn(sum, row[c])) : 0.0f;
                drow[c] = __fadd_rn(own, dx[c]);
            }
        }
    }
}

// Block c < num_dense: sum_b g_b x_bc; block num_dense: sum_b g_b; block num_dense + 1: the
// loss (f64). Each thread adds a fixed stride of samples, then a fixed tree over the block.
__global__ void batch_sums_kernel(const float* __restrict__ dlogits,
                                  const float* __restrict__ dense, size_t num_dense,
                                  const double* __restrict__ loss_terms, size_t batch,
                                  float* __restrict__ dw_dense, float* __restrict__ dbias,
                                  double* __restrict__ loss_sum) {
    __shared__ double partial[kThreads];
    const size_t c = blockIdx.x;
    double acc = 0.0;
    if (c <= num_dense) {
        float s = 0.0f;
        for (size_t b = threadIdx.x; b < batch; b += kThreads)
            s = __fadd_rn(s, c < num_dense ? __fmul_rn(dlogits[b], dense[b * num_dense + c])
                                           : dlogits[b]);
        acc = s;
    } else {
        for (size_t b = threadIdx.x; b < batch; b += kThreads) acc += loss_terms[b];
    }
    partial[threadIdx.x] = acc;
    __syncthreads();
    for (unsigned half = kThreads / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) {
            if (c <= num_dense)
                partial[threadIdx.x] = float(partial[threadIdx.x]) + float(partial[threadIdx.x + half]);
            else
                partial[threadIdx.x] += partial[threadIdx.x + half];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        if (c < num_dense)
            dw_dense[c] = __fadd_rn(dw_dense[c], float(partial[0]));
        else if (c == num_dense)
            dbias[0] = __fadd_rn(dbias[0], float(partial[0]));
        else
            loss_sum[0] = partial[0];
    }
}

}  // namespace

extern "C" int tilearn_ctr_mlp_input(const float* emb, size_t width, size_t deep,
                                     const float* dense, size_t num_dense, size_t batch,
                                     float* x0, cudaStream_t stream) {
    if (deep > width) return static_cast<int>(cudaErrorInvalidValue);
    const size_t n = batch * (deep + num_dense);
    if (n == 0) return static_cast<int>(cudaSuccess);
    if (x0 == nullptr || (deep > 0 && emb == nullptr) || (num_dense > 0 && dense == nullptr))
        return static_cast<int>(cudaErrorInvalidValue);
    mlp_input_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream>>>(emb, width, deep, dense,
                                                                        num_dense, batch, x0);
    return static_cast<int>(cudaGetLastError());
}

extern "C" int tilearn_ctr_relu_forward(const float* z, float* a, size_t n, cudaStream_t stream) {
    if (n == 0) return static_cast<int>(cudaSuccess);
    if (z == nullptr || a == nullptr) return static_cast<int>(cudaErrorInvalidValue);
    relu_forward_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream>>>(z, a, n);
    return static_cast<int>(cudaGetLastError());
}

extern "C" int tilearn_ctr_relu_backward(float* dx, const float* z, size_t n,
                                         cudaStream_t stream) {
    if (n == 0) return static_cast<int>(cudaSuccess);
    if (z == nullptr || dx == nullptr) return static_cast<int>(cudaErrorInvalidValue);
    relu_backward_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream>>>(dx, z, n);
    return static_cast<int>(cudaGetLastError());
}

extern "C" int tilearn_ctr_logits_loss(int fm, const float* emb, size_t width, size_t fields,
                                       size_t k, const float* dense, size_t num_dense,
                                       const float* w_dense, const float* bias, const float* mlp,
                                       const float* labels, size_t batch, float dlogit_scale,
                                       float* logits, float* dlogits, double* loss_terms,
                                       cudaStream_t stream) {
    if (fields * k > width) return static_cast<int>(cudaErrorInvalidValue);
    if (batch == 0) return static_cast<int>(cudaSuccess);
    if (emb == nullptr || bias == nullptr || mlp == nullptr || logits == nullptr ||
        (num_dense > 0 && (dense == nullptr || w_dense == nullptr)) ||
        (labels != nullptr && (dlogits == nullptr || loss_terms == nullptr)))
        return static_cast<int>(cudaErrorInvalidValue);
    logits_loss_kernel<<<blocks_for(batch, kWarps), kThreads, 0, stream>>>(
        fm, emb, width, fields, k, dense, num_dense, w_dense, bias, mlp, labels, batch,
        dlogit_scale, logits, dlogits, loss_terms);
    return static_cast<int>(cudaGetLastError());
}

extern "C" int tilearn_ctr_head_backward(int fm, const float* emb, size_t width, size_t fields,
                                         size_t k, const float* dlogits, const float* dx0,
                                         size_t mlp_in, size_t batch, float* demb,
                                         cudaStream_t stream) {
    if (fields * k > width || fields * k > mlp_in) return static_cast<int>(cudaErrorInvalidValue);
    if (batch == 0) return static_cast<int>(cudaSuccess);
    if (emb == nullptr || dlogits == nullptr || dx0 == nullptr || demb == nullptr)
        return static_cast<int>(cudaErrorInvalidValue);
    head_backward_kernel<<<blocks_for(batch, kWarps), kThreads, 0, stream>>>(
        fm, emb, width, fields, k, dlogits, dx0, mlp_in, batch, demb);
    return static_cast<int>(cudaGetLastError());
}

extern "C" int tilearn_ctr_batch_sums(const float* dlogits, const float* dense, size_t num_dense,
                                      const double* loss_terms, size_t batch, float* dw_dense,
                                      float* dbias, double* loss_sum, cudaStream_t stream) {
    if (num_dense + 2 > kMaxBlocks) return static_cast<int>(cudaErrorInvalidValue);
    if (dlogits == nullptr || loss_terms == nullptr || dbias == nullptr || loss_sum == nullptr ||
        (num_dense > 0 && (dense == nullptr || dw_dense == nullptr)))
        return static_cast<int>(cudaErrorInvalidValue);
    batch_sums_kernel<<<static_cast<unsigned>(num_dense + 2), kThreads, 0, stream>>>(
        dlogits, dense, num_dense, loss_terms, batch, dw_dense, dbias, loss_sum);
    return static_cast<int>(cudaGetLastError());
}
