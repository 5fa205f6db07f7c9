/*
 * tilearn_kernels.h: every extern "C" launcher of the kernel files (kernels/<op>.cu).
 *
 * Conventions shared by all launchers:
 *   - Pointers are device pointers, row-major and contiguous.
 *   - bf16 and f16 tensors are passed as their 16-bit storage (`tilearn_bf16`, `tilearn_f16`);
 *     the kernels reinterpret them as __nv_bfloat16 / __half.
 *   - The launch is asynchronous on `stream`. The return value is the cudaError_t of
 *     cudaGetLastError() after the launch (0 = cudaSuccess); invalid arguments return
 *     cudaErrorInvalidValue (1) without launching anything.
 *
 * The Rust FFI (crates/tilearn-ops/src/cuda/ffi.rs) is generated from this file by
 * `cargo xtask build-kernels`. This header must stay parseable without the CUDA headers.
 */
#ifndef TILEARN_KERNELS_H
#define TILEARN_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __CUDACC__
#include <cuda_runtime.h>
#else
/* The runtime's stream handle is the driver's CUstream: an opaque pointer. */
typedef struct CUstream_st *cudaStream_t;
#endif

/* 16-bit storage of a bfloat16 / IEEE binary16 value. */
typedef uint16_t tilearn_bf16;
typedef uint16_t tilearn_f16;

/* Element type of a model kernel's tensors: the `dtype` argument of the launchers below that take
 * `void *` tensors (activations, weights and their gradients). Every such kernel computes in f32
 * and rounds each stored result once, to nearest even, to this type. Parameter gradients
 * (dweight, dtable, db), rstd, lse, row losses and totals stay f32 / f64 whatever the dtype.
 * f16 results of magnitude >= 65520 (65504 plus half a step) round to +-inf. An unknown dtype
 * launches nothing and returns cudaErrorInvalidValue. */
#define TILEARN_DTYPE_F32 0
#define TILEARN_DTYPE_BF16 1
#define TILEARN_DTYPE_F16 2

#ifdef __cplusplus
extern "C" {
#endif

/* ---- status.cu: names for the status codes the launchers return ---- */

/* cudaGetErrorName / cudaGetErrorString of a returned code (static strings, never NULL). */
const char *tilearn_status_name(int status);
const char *tilearn_status_string(int status);

/* ---- cast.cu: element-wise dtype conversion, out[i] = convert(in[i]) for i < n ---- */

/* f32 -> bf16, round to nearest even. */
int tilearn_cast_f32_to_bf16(const float *input, tilearn_bf16 *output, size_t n,
                             cudaStream_t stream);
/* f32 -> f16, round to nearest even (overflow to +-inf, subnormals kept). */
int tilearn_cast_f32_to_f16(const float *input, tilearn_f16 *output, size_t n,
                            cudaStream_t stream);
/* bf16 -> f32, exact. */
int tilearn_cast_bf16_to_f32(const tilearn_bf16 *input, float *output, size_t n,
                             cudaStream_t stream);
/* f16 -> f32, exact. */
int tilearn_cast_f16_to_f32(const tilearn_f16 *input, float *output, size_t n,
                            cudaStream_t stream);

/* ---- norm.cu: RMSNorm (Hugging Face LlamaRMSNorm), y = w * x / sqrt(mean(x^2) + eps) ---- */

/* x, out: [rows, dim]; weight: [dim]; rstd: [rows] (written, f32). */
int tilearn_rmsnorm_forward(int dtype, const void *x, const void *weight, size_t rows,
                            size_t dim, float eps, void *out, float *rstd, cudaStream_t stream);

/* Number of f32 elements of scratch that tilearn_rmsnorm_backward(_add) needs for (rows, dim). */
size_t tilearn_rmsnorm_backward_scratch_len(size_t rows, size_t dim);

/* dout, x, dx: [rows, dim]; weight: [dim]; rstd: [rows] from the forward;
 * dx is written (=), dweight (f32, [dim]) is accumulated (+=) deterministically;
 * scratch: at least tilearn_rmsnorm_backward_scratch_len(rows, dim) f32 elements, clobbered. */
int tilearn_rmsnorm_backward(int dtype, const void *dout, const void *x, const void *weight,
                             const float *rstd, size_t rows, size_t dim, void *dx, float *dweight,
                             float *scratch, size_t scratch_len, cudaStream_t stream);

/* norm.cu, residual-fused: resid += y (in place; resid, y: [rows, dim]), then out = RMSNorm(resid)
 * with rstd written, exactly as residual_add_inplace followed by rmsnorm_forward. */
int tilearn_add_rmsnorm_forward(int dtype, void *resid, const void *y, const void *weight,
                                size_t rows, size_t dim, float eps, void *out, float *rstd,
                                cudaStream_t stream);
/* Like tilearn_rmsnorm_backward, but the input gradient is added into dresid (+=) rather than
 * written; same scratch, same deterministic dweight (+=). */
int tilearn_rmsnorm_backward_add(int dtype, const void *dout, const void *x, const void *weight,
                                 const float *rstd, size_t rows, size_t dim, void *dresid,
                                 float *dweight, float *scratch, size_t scratch_len,
                                 cudaStream_t stream);
/* Scratch (f32 elements) that covers every call of tilearn_rmsnorm_backward* with rows <=
 * max_rows and this dim: size a caller-owned buffer once with it. */
size_t tilearn_rmsnorm_backward_scratch_len_max(size_t max_rows, size_t dim);

/* ---- norm.cu: LayerNorm with weight and bias (PyTorch nn.LayerNorm, Bloom),
 *      y = (x - mean) / sqrt(var + eps) * w + b over the last axis (biased variance) ---- */
/* x, out: [rows, dim]; weight, bias: [dim]; mean, rstd: [rows] (written, f32). */
int tilearn_layernorm_forward(int dtype, const void *x, const void *weight, const void *bias,
                              size_t rows, size_t dim, float eps, void *out, float *mean,
                              float *rstd, cudaStream_t stream);
/* f32 elements of scratch tilearn_layernorm_backward needs for (rows, dim), and a bound for
 * every rows <= max_rows (size a caller-owned buffer once with it). */
size_t tilearn_layernorm_backward_scratch_len(size_t rows, size_t dim);
size_t tilearn_layernorm_backward_scratch_len_max(size_t max_rows, size_t dim);
/* dout, x, dx: [rows, dim]; weight: [dim]; mean, rstd: [rows] from the forward; dx written (=),
 * dweight and dbias (f32, [dim]) accumulated (+=) deterministically; scratch clobbered. */
int tilearn_layernorm_backward(int dtype, const void *dout, const void *x, const void *weight,
                               const float *mean, const float *rstd, size_t rows, size_t dim,
                               void *dx, float *dweight, float *dbias, float *scratch,
                               size_t scratch_len, cudaStream_t stream);

/* ---- gelu.cu: Bloom's tanh GeLU, out = 0.5 x (1 + tanh(0.79788456 x (1 + 0.044715 x^2))),
 *      element-wise over n elements; the backward writes (=) dx = dout * gelu'(x) ---- */
int tilearn_gelu_tanh_forward(int dtype, const void *x, void *out, size_t n,
                              cudaStream_t stream);
int tilearn_gelu_tanh_backward(int dtype, const void *dout, const void *x, void *dx, size_t n,
                               cudaStream_t stream);

/* ---- optim_*.cu (shared machinery in kernels/optim_common.cuh): fused multi-tensor optimizer
 *      steps over flat buffers: fp32 master weights and state, f32 or bf16 gradients, an
 *      optional bf16/f16 working copy of the parameters written by the same kernel ---- */

/* Dtype codes of tilearn_optim_launch. */
#define TILEARN_OPTIM_DTYPE_NONE 0
#define TILEARN_OPTIM_DTYPE_F32 1
#define TILEARN_OPTIM_DTYPE_BF16 2
#define TILEARN_OPTIM_DTYPE_F16 3

/* Most parameter groups one launch takes (their scalars travel as a kernel argument). */
#define TILEARN_OPTIM_MAX_GROUPS 16

/* One contiguous range of the flat buffers and its group. Segments are sorted by start and
 * disjoint; elements in no segment are never read or written. A segment of len elements is cut
 * into ceil(len / chunk) chunks; chunk_begin is the number of chunks of all earlier segments. */
typedef struct tilearn_optim_segment {
    uint64_t start;
    uint64_t end;
    uint64_t chunk_begin;
    uint64_t group;
} tilearn_optim_segment;

/* What every optimizer launch shares. Pointers marked (device) are device pointers; every
 * buffer has the same element indexing (index 0 = first element of the buffer). */
typedef struct tilearn_optim_launch {
    const tilearn_optim_segment *segments; /* (device) n_segments entries */
    uint64_t n_segments;
    uint64_t n_chunks;       /* total chunks of all segments */
    uint64_t chunk;          /* elements per chunk: > 0, a multiple of 4 */
    int grad_dtype;          /* TILEARN_OPTIM_DTYPE_F32 or _BF16 */
    const void *grads;       /* (device) */
    int copy_dtype;          /* _NONE, _BF16 or _F16: the working copy of the parameters */
    void *param_copy;        /* (device) NULL iff copy_dtype == _NONE; written (=) */
    const float *inv_scale;  /* (device, NULL = 1) gradients are multiplied by *inv_scale */
    const float *found_inf;  /* (device, NULL = never) *found_inf != 0: no change at all */
    const double *grad_sumsq; /* (device, NULL = no clipping) global sum of squares of the
                                 unscaled gradients: clip to max_norm as clip_grad_norm_ */
    double max_norm;
    int stochastic_rounding; /* bf16 copy only: round stochastically with (seed, step, index) */
    uint64_t seed;
    uint64_t step;
    uint64_t index_offset;   /* global index of buffer element 0 (a ZeRO shard's start) */
} tilearn_optim_launch;

/* optim_norm.cu: global gradient sum of squares, deterministic (fixed grid, fixed-order block
 * and final reductions, f64 accumulation). out[0] = sum (g * inv_scale)^2, out[1] = sqrt of
 * it (both f64, written); inv_scale (device) may be NULL (= 1). partials: scratch of at least
 * tilearn_optim_norm_partials_len() f64 elements, clobbered. */
size_t tilearn_optim_norm_partials_len(void);
int tilearn_optim_grad_sumsq_f32(const float *grads, size_t n, const float *inv_scale,
                                 double *partials, size_t partials_len, double *out,
                                 cudaStream_t stream);
int tilearn_optim_grad_sumsq_bf16(const tilearn_bf16 *grads, size_t n, const float *inv_scale,
                                  double *partials, size_t partials_len, double *out,
                                  cudaStream_t stream);

/* optim_adam.cu: Adam / AdamW (torch.optim semantics, optional amsgrad). Per group:
 *   l2_decay:        g = g + l2_weight_decay * p                 (Adam's weight decay)
 *   decoupled_decay: p = p * decay_factor                         (AdamW, 1 - lr * wd)
 *   m = lerp(m, g, one_minus_beta1); v = v * beta2 + one_minus_beta2 * g * g
 *   amsgrad (max_exp_avg_sq != NULL): vmax = max(vmax, v), the denominator uses vmax
 *   p = p + neg_step_size * m / (sqrt(v) / bias_correction2_sqrt + eps) */
typedef struct tilearn_optim_adam_group {
    float decay_factor;
    float l2_weight_decay;
    float one_minus_beta1;
    float beta2;
    float one_minus_beta2;
    float bias_correction2_sqrt;
    float neg_step_size;
    float eps;
    uint32_t decoupled_decay;
    uint32_t l2_decay;
} tilearn_optim_adam_group;

/* params, exp_avg, exp_avg_sq (and max_exp_avg_sq, or NULL without amsgrad): (device) f32,
 * updated in place (=) on the launch's segments. */
int tilearn_optim_adam(const tilearn_optim_launch *launch, const tilearn_optim_adam_group *groups,
                       uint32_t n_groups, float *params, float *exp_avg, float *exp_avg_sq,
                       float *max_exp_avg_sq, cudaStream_t stream);
/* As tilearn_optim_adam with groups (n_groups entries) in DEVICE memory, read by the kernel when
 * it runs: a captured CUDA graph replays the launch with each step's scalars. */
int tilearn_optim_adam_device_groups(const tilearn_optim_launch *launch,
                                     const tilearn_optim_adam_group *groups, uint32_t n_groups,
                                     float *params, float *exp_avg, float *exp_avg_sq,
                                     float *max_exp_avg_sq, cudaStream_t stream);

/* optim_sgd.cu: SGD (torch.optim.SGD). Per group:
 *   g = g + weight_decay * p                        (when weight_decay != 0)
 *   with a buffer: buf = g (first_step) or buf = buf * momentum + one_minus_dampening * g;
 *                  d = nesterov ? g + momentum * buf : buf
 *   p = p + neg_lr * d                              (d = g without a buffer) */
typedef struct tilearn_optim_sgd_group {
    float weight_decay;
    float momentum;
    float one_minus_dampening;
    float neg_lr;
    uint32_t nesterov;
    uint32_t first_step;
} tilearn_optim_sgd_group;

/* params: (device) f32; momentum_buffer: (device) f32 or NULL (momentum 0: plain SGD); both
 * updated in place (=) on the launch's segments. */
int tilearn_optim_sgd(const tilearn_optim_launch *launch, const tilearn_optim_sgd_group *groups,
                      uint32_t n_groups, float *params, float *momentum_buffer,
                      cudaStream_t stream);

/* optim_lion.cu: Lion (lion-pytorch). Per group:
 *   p = p * decay_factor (when apply_decay); c = m * beta1 + one_minus_beta1 * g;
 *   p = p + neg_lr * sign(c); m = m * beta2 + one_minus_beta2 * g */
typedef struct tilearn_optim_lion_group {
    float decay_factor;
    float beta1;
    float one_minus_beta1;
    float beta2;
    float one_minus_beta2;
    float neg_lr;
    uint32_t apply_decay;
} tilearn_optim_lion_group;

/* params, exp_avg: (device) f32, updated in place (=) on the launch's segments. */
int tilearn_optim_lion(const tilearn_optim_launch *launch, const tilearn_optim_lion_group *groups,
                       uint32_t n_groups, float *params, float *exp_avg, cudaStream_t stream);

/* optim_lamb.cu: LAMB (Apex FusedLAMB, adam_w_mode). The launch's segments are the tensors of
 * the per-tensor trust ratio. Per group:
 *   s = g / divisor (divisor = norm / max_norm when the launch has grad_sumsq and
 *       norm > max_norm (launch->max_norm = Apex max_grad_norm), else clip_divisor)
 *   m = m * beta1 + beta3 * s; v = v * beta2 + one_minus_beta2 * s * s
 *   u = (m / bias_correction1) / (sqrt(v / bias_correction2) + eps) + weight_decay * p
 *   per tensor: ratio = lr * ||p|| / ||u|| (use_trust_ratio, both norms non-zero) else lr
 *   p = p - ratio * u */
typedef struct tilearn_optim_lamb_group {
    float clip_divisor;
    float beta1;
    float beta3;
    float beta2;
    float one_minus_beta2;
    float bias_correction1;
    float bias_correction2;
    float eps;
    float weight_decay;
    uint32_t use_trust_ratio;
    double lr;
} tilearn_optim_lamb_group;

/* params, exp_avg, exp_avg_sq: (device) f32, updated in place (=). partials: (device) scratch of
 * >= 2 * launch->n_chunks f64; ratios: (device) >= launch->n_segments f32, written with each
 * tensor's applied learning rate. */
int tilearn_optim_lamb(const tilearn_optim_launch *launch, const tilearn_optim_lamb_group *groups,
                       uint32_t n_groups, float *params, float *exp_avg, float *exp_avg_sq,
                       double *partials, size_t partials_len, float *ratios, size_t ratios_len,
                       cudaStream_t stream);

/* ---- cross_entropy.cu: softmax cross-entropy over the vocabulary, forward + backward fused ----
 * logits: [rows, vocab] row-major, any vocab; targets: [rows] (-100 = ignored); row_loss: [rows]
 * f32, written (0 for ignored rows); totals: 4 f64, written by every successful launch:
 *   totals[0] = sum of row losses (fixed-order f64 reduction: deterministic),
 *   totals[1] = number of targets in [0, vocab),
 *   totals[2] = position of the first target neither -100 nor in [0, vocab), or -1,
 *   totals[3] = that target (0 if none).
 * A row with such a target gets a NaN loss (and, fused, a NaN gradient row). */

/* Overwrites each logits row (in place) with (softmax(row) - onehot(target)) * grad_scale,
 * all zeros for ignored rows. grad_scale must be finite. */
int tilearn_cross_entropy_fused(int dtype, void *logits, const int32_t *targets, size_t rows,
                                size_t vocab, float grad_scale, float *row_loss, double *totals,
                                cudaStream_t stream);
/* As tilearn_cross_entropy_fused with the factor read from device memory (*grad_scale, one
 * f32) when the kernel runs: a captured CUDA graph replays it with each step's factor. */
int tilearn_cross_entropy_fused_device_scale(int dtype, void *logits, const int32_t *targets,
                                             size_t rows, size_t vocab, const float *grad_scale,
                                             float *row_loss, double *totals,
                                             cudaStream_t stream);
/* Loss only (evaluation): logits are not modified. */
int tilearn_cross_entropy_forward(int dtype, const void *logits, const int32_t *targets,
                                  size_t rows, size_t vocab, float *row_loss, double *totals,
                                  cudaStream_t stream);
/* Totals only, from row losses already written (e.g. by fused or forward launches over chunks
 * of the rows): the same reduction, so the same bits, as one launch over all rows. */
int tilearn_cross_entropy_totals(const float *row_loss, const int32_t *targets, size_t rows,
                                 size_t vocab, double *totals, cudaStream_t stream);

/* ---- cross_entropy.cu, vocabulary-parallel: a rank's logits [rows, cols] are the columns
 * col_start .. col_start + cols of a vocabulary of full_vocab words (tensor parallelism); the
 * caller all-reduces between the launches: MAX of local_max into global_max after partials,
 * SUM of sumexp and of target_logit after rescale. Per-row statistics are f32 [rows]. */

/* local_max, sumexp (of exp(x - local_max)) and target_logit (the target's logit when this
 * slice holds it, else 0; NaN for a target neither -100 nor in [0, full_vocab)), written;
 * ignored rows write zeros. */
int tilearn_vocab_ce_partials(int dtype, const void *logits, const int32_t *targets, size_t rows,
                              size_t cols, size_t col_start, size_t full_vocab, float *local_max,
                              float *sumexp, float *target_logit, cudaStream_t stream);
/* sumexp *= exp(local_max - global_max) in place (a zero stays zero). */
int tilearn_vocab_ce_rescale(const float *local_max, const float *global_max, float *sumexp,
                             size_t rows, cudaStream_t stream);
/* row_loss = global_max + log(sumexp) - target_logit (written; 0 for ignored rows) and the
 * logits overwritten with (exp(x - global_max) / sumexp - onehot(target)) * grad_scale (zeros
 * for ignored rows). grad_scale must be finite. */
int tilearn_vocab_ce_fused_finish(int dtype, void *logits, const int32_t *targets, size_t rows,
                                  size_t cols, size_t col_start, size_t full_vocab,
                                  const float *global_max, const float *sumexp,
                                  const float *target_logit, float grad_scale, float *row_loss,
                                  cudaStream_t stream);
/* The row losses only (evaluation). */
int tilearn_vocab_ce_loss_finish(const int32_t *targets, size_t rows, size_t full_vocab,
                                 const float *global_max, const float *sumexp,
                                 const float *target_logit, float *row_loss,
                                 cudaStream_t stream);

/* ---- embedding.cu: token embedding, out[r] = table[ids[r]]; dtable[ids[r]] += dout[r] ----
 * ids: [rows] u32; table / dtable: [vocab, dim]; out / dout: [rows, dim].
 * status: one u64 device word, initialised by the caller to UINT64_MAX ("no error"); a launch
 * that meets an id >= vocab lowers it (atomic min) to (position << 32) | id. Such a row is never
 * read out of bounds: the forward fills it with NaN, the backward skips it. */
int tilearn_embedding_forward(int dtype, const uint32_t *ids, const void *table, size_t rows,
                              size_t vocab, size_t dim, void *out, uint64_t *status,
                              cudaStream_t stream);

/* Bytes of scratch (any alignment) that tilearn_embedding_backward needs for (rows, vocab);
 * SIZE_MAX if the shape is out of range or the current device cannot be queried. */
size_t tilearn_embedding_backward_scratch_bytes(size_t rows, size_t vocab);

/* dtable (f32) is accumulated (+=), deterministically and in position order (bit-identical to
 * the f32 CPU reference); scratch: at least tilearn_embedding_backward_scratch_bytes(rows, vocab)
 * bytes, clobbered. */
int tilearn_embedding_backward(int dtype, const uint32_t *ids, const void *dout, size_t rows,
                               size_t vocab, size_t dim, float *dtable, uint64_t *status,
                               void *scratch, size_t scratch_bytes, cudaStream_t stream);

/* The lookup of a rank's rows vocab_start .. vocab_start + table_rows of a vocabulary of
 * full_vocab words (vocabulary-parallel embedding): an id in the slice copies its table row, an
 * id elsewhere in the vocabulary gives a zero row (forward) or is skipped (backward), an id >=
 * full_vocab is recorded in status (NaN row forward). table / dtable: [table_rows, dim]. The
 * backward's scratch: tilearn_embedding_backward_scratch_bytes(rows, table_rows). */
int tilearn_embedding_forward_slice(int dtype, const uint32_t *ids, const void *table, size_t rows,
                                    size_t vocab_start, size_t table_rows, size_t full_vocab,
                                    size_t dim, void *out, uint64_t *status, cudaStream_t stream);
int tilearn_embedding_backward_slice(int dtype, const uint32_t *ids, const void *dout, size_t rows,
                                     size_t vocab_start, size_t table_rows, size_t full_vocab,
                                     size_t dim, float *dtable, uint64_t *status, void *scratch,
                                     size_t scratch_bytes, cudaStream_t stream);

/* ---- embedding_bag.cu: tilearn-recsys' fused multi-table embedding bag (pooled lookup of
 *      jagged ids) and its backward fused with a sparse optimizer ----
 * weights: one flat f32 buffer, table after table ([rows_t, dim_t] each); tables:
 * TILEARN_BAG_TABLE_WORDS u32 per table, at the indices below; offsets: [num_tables * batch + 1]
 * u32, bag t * batch + b holds ids[offsets[bag] .. offsets[bag + 1]], row numbers inside table t;
 * out / dout: [batch, total_dim] f32, table t at columns col_offset_t .. + dim_t. The callers
 * (tilearn_recsys::cuda) guarantee that offsets partition the ids and that every id is inside its
 * table; an id that is not is skipped, never accessed out of bounds. */
#define TILEARN_BAG_TABLE_WORDS 8
#define TILEARN_BAG_TABLE_ROWS 0
#define TILEARN_BAG_TABLE_DIM 1
#define TILEARN_BAG_TABLE_POOLING 2 /* TILEARN_POOLING_SUM or _MEAN */
#define TILEARN_BAG_TABLE_COL_OFFSET 3
#define TILEARN_BAG_TABLE_ROW_BASE 4 /* first stacked row of the table (all rows < 2^32 - 1) */
#define TILEARN_BAG_TABLE_WEIGHT_OFFSET_LO 5 /* first element in weights, low 32 bits */
#define TILEARN_BAG_TABLE_WEIGHT_OFFSET_HI 6
#define TILEARN_POOLING_SUM 0
#define TILEARN_POOLING_MEAN 1 /* the sum times 1 / len (f32); an empty bag gives 0 */

/* The rule of one sparse optimizer step (scalars computed on the host, see tilearn-recsys'
 * sparse_optim.rs). SGD: w += neg_lr * g. Row-wise Adagrad (state1: one f32 per stacked row):
 * G += sum(g^2) / dim, w += -(lr / (sqrt(G) + eps)) * g. SparseAdam (state1 / state2: first
 * and second moments, one f32 per weight element): torch.optim.SparseAdam's update. */
#define TILEARN_SPARSE_SGD 0
#define TILEARN_SPARSE_ROWWISE_ADAGRAD 1
#define TILEARN_SPARSE_ADAM 2
typedef struct tilearn_sparse_rule {
    int kind;
    float neg_lr;
    float lr;
    float eps;
    float one_minus_beta1;
    float one_minus_beta2;
    float neg_step_size;
} tilearn_sparse_rule;

/* out (=): every bag pooled. */
int tilearn_embedding_bag_forward(const float *weights, const uint32_t *tables,
                                  size_t num_tables, size_t total_dim, const uint32_t *offsets,
                                  const uint32_t *ids, size_t batch, float *out,
                                  cudaStream_t stream);

/* The backward's summation order: a row's run of entries (entry order) is cut into chunks of
 * at most TILEARN_BAG_GRAD_CHUNK entries from its start; each chunk is summed from 0 in entry
 * order, and the row's gradient is 0 plus the chunk sums in chunk order (tilearn-recsys' CPU
 * reference uses the same constant and order). */
#define TILEARN_BAG_GRAD_CHUNK 32

/* Bytes of scratch (any alignment) tilearn_embedding_bag_backward_update needs for `entries`
 * ids over total_rows stacked rows whose widest table has max_dim columns; SIZE_MAX if out of
 * range or the device cannot be queried. */
size_t tilearn_embedding_bag_backward_scratch_bytes(size_t entries, size_t total_rows,
                                                    size_t max_dim);

/* Every row that occurs in the batch is updated in place (=) with its summed gradient from dout,
 * as is its state; nothing else is touched. Deterministic. state1 / state2 may be NULL when the
 * rule does not use them. max_dim: at least every table's dim (sizes the scratch). scratch:
 * clobbered. */
int tilearn_embedding_bag_backward_update(float *weights, float *state1, float *state2,
                                          const uint32_t *tables, size_t num_tables,
                                          size_t total_rows, size_t total_dim, size_t max_dim,
                                          const uint32_t *offsets, const uint32_t *ids,
                                          size_t batch, size_t entries, const float *dout,
                                          tilearn_sparse_rule rule, void *scratch,
                                          size_t scratch_bytes, cudaStream_t stream);

/* ---- row_copy.cu: tilearn-recsys' row cache moves (rows between pinned host tables and the
 *      device cache) ----
 * dst (=) [dst_i .. dst_i + len_i] = src[src_i .. src_i + len_i] for each of the n moves
 * ([n, 3] u64: src element offset, dst element offset, element count). One of src / dst may be
 * page-locked host memory mapped into the device's address space. Moves must lie inside both
 * buffers and must not write the same element twice. */
int tilearn_copy_rows(const float *src, float *dst, const uint64_t *moves, size_t n,
                      cudaStream_t stream);

/* ---- ctr_head.cu: tilearn-recsys' DeepFM / Wide & Deep between the embedding bag and the
 *      dense optimizer, except the matrix products (cuBLASLt) ----
 * emb / demb: [batch, width] f32, the fields' dim-k embeddings at columns 0 .. fields * k, the
 * dim-1 first-order and cross weights after them; dense: [batch, num_dense]; x0 / dx0: [batch,
 * mlp_in] (the embeddings' deep part, then dense); mlp, labels, logits, dlogits: [batch];
 * loss_terms: [batch] f64. fm != 0 adds DeepFM's interaction term. Deterministic. */

/* x0 (=) = [emb[:, 0:deep], dense]. */
int tilearn_ctr_mlp_input(const float *emb, size_t width, size_t deep, const float *dense,
                          size_t num_dense, size_t batch, float *x0, cudaStream_t stream);
/* a (=) = max(z, 0). */
int tilearn_ctr_relu_forward(const float *z, float *a, size_t n, cudaStream_t stream);
/* dx = 0 where z <= 0, in place. */
int tilearn_ctr_relu_backward(float *dx, const float *z, size_t n, cudaStream_t stream);
/* logits (=) = bias + mlp + first-order sum + dense . w_dense [+ FM]; with labels (else NULL):
 * loss_terms (=) the BCE-with-logits terms, dlogits (=) (sigmoid(z) - y) * dlogit_scale. */
int tilearn_ctr_logits_loss(int fm, const float *emb, size_t width, size_t fields, size_t k,
                            const float *dense, size_t num_dense, const float *w_dense,
                            const float *bias, const float *mlp, const float *labels,
                            size_t batch, float dlogit_scale, float *logits, float *dlogits,
                            double *loss_terms, cudaStream_t stream);
/* demb (=): dlogit on the dim-1 columns, [FM gradient +] dx0 on the embeddings. */
int tilearn_ctr_head_backward(int fm, const float *emb, size_t width, size_t fields, size_t k,
                              const float *dlogits, const float *dx0, size_t mlp_in,
                              size_t batch, float *demb, cudaStream_t stream);
/* dw_dense[i] += sum_b dlogits[b] dense[b, i]; dbias[0] += sum_b dlogits[b];
 * loss_sum[0] (=) sum_b loss_terms[b] (f64). */
int tilearn_ctr_batch_sums(const float *dlogits, const float *dense, size_t num_dense,
                           const double *loss_terms, size_t batch, float *dw_dense, float *dbias,
                           double *loss_sum, cudaStream_t stream);

/* ---- rope.cu: rotary embedding (Hugging Face rotate_half: element i pairs with i + D/2),
 *      in place on x [batch, seq, heads, head_dim]; cos / sin: [table_seq, head_dim / 2] f32,
 *      row t for position t (seq <= table_seq). Token (b, t) takes the position
 *      positions[b * seq + t] (int32 [batch, seq], each < table_seq; the caller checks) or,
 *      with positions NULL, t. The backward rotates by -angle. ---- */
int tilearn_rope_forward(int dtype, void *x, const float *cos_table, const float *sin_table,
                         const int32_t *positions, size_t batch, size_t seq, size_t heads,
                         size_t head_dim, size_t table_seq, cudaStream_t stream);
int tilearn_rope_backward(int dtype, void *dx, const float *cos_table, const float *sin_table,
                          const int32_t *positions, size_t batch, size_t seq, size_t heads,
                          size_t head_dim, size_t table_seq, cudaStream_t stream);

/* ---- activation.cu: SwiGLU, out = silu(gate) * up, element-wise over n elements;
 *      the backward writes (=) dgate and dup ---- */
int tilearn_swiglu_forward(int dtype, const void *gate, const void *up, void *out, size_t n,
                           cudaStream_t stream);
int tilearn_swiglu_backward(int dtype, const void *dout, const void *gate, const void *up,
                            void *dgate, void *dup, size_t n, cudaStream_t stream);

/* ---- residual.cu: out = a + b (out may equal a), and acc += x, over n elements ---- */
int tilearn_residual_add(int dtype, const void *a, const void *b, void *out, size_t n,
                         cudaStream_t stream);
int tilearn_residual_add_inplace(int dtype, void *acc, const void *x, size_t n,
                                 cudaStream_t stream);

/* ---- row_normalize.cu: out[r] = w[r] / max(||w[r]||, 1e-12) (F.normalize; Baichuan2's
 *      NormHead). w, out: [rows, cols] in `dtype`; out written (=). The backward adds (+=)
 *      d(out)/d(w)^T dout into dw; dout and dw are f32 [rows, cols], w in `dtype`. ---- */
int tilearn_row_normalize_forward(int dtype, const void *w, size_t rows, size_t cols, void *out,
                                  cudaStream_t stream);
int tilearn_row_normalize_backward(int dtype, const float *dout, const void *w, size_t rows,
                                   size_t cols, float *dw, cudaStream_t stream);

/* ---- z_loss.cu: Baichuan2's z-loss, weight * max(logits)^2 per target row. z_loss_rows
 *      writes (=) per row of logits [rows, vocab] (`dtype`) the max (f32) and the first
 *      position holding it (i32), or 0 and -1 for rows whose target is -100; z_loss_apply
 *      adds (+=) weight * max^2 to row_loss and, when dlogits is not NULL, grad_scale * weight *
 *      2 * max to dlogits[r, arg] (grad_scale read from grad_scale_dev when not NULL). ---- */
int tilearn_z_loss_rows(int dtype, const void *logits, const int32_t *targets, size_t rows,
                        size_t vocab, float *max, int32_t *arg, cudaStream_t stream);
int tilearn_z_loss_apply(int dtype, const float *max, const int32_t *arg, size_t rows,
                         size_t vocab, float weight, float grad_scale,
                         const float *grad_scale_dev, float *row_loss, void *dlogits,
                         cudaStream_t stream);

/* ---- reduce.cu: whole-buffer gradient reductions (global L2 norm; GradScaler unscale) ---- */

/* Number of f64 partials tilearn_global_norm uses as scratch for n elements (at most 1024;
 * 0 for n == 0). */
size_t tilearn_global_norm_partials_len(size_t n);
/* sum_sq[0] = sum of x[i]^2 (f64) and norm[0] = sqrt(sum_sq) (f32), both written (=), also for
 * n == 0; every square and sum in f64, deterministic (grid fixed by n, fixed-order trees).
 * partials: at least tilearn_global_norm_partials_len(n) f64, clobbered. */
int tilearn_global_norm(int dtype, const void *x, size_t n, double *partials,
                        size_t partials_len, double *sum_sq, float *norm, cudaStream_t stream);

/* In place x[i] = x[i] * inv_scale[0] (f32 product, rounded once to x's type), and
 * found_inf[0] = 1.0f if any x[i] was inf or NaN (never cleared: the caller zeroes it once per
 * step), like torch._amp_foreach_non_finite_check_and_unscale_. */
int tilearn_unscale_check(int dtype, void *x, size_t n, const float *inv_scale,
                          float *found_inf, cudaStream_t stream);

/* ---- bias_grad.cu: linear-layer bias gradient, db[j] += sum_r dout[r, j] (f32 sums, no
 *      atomics: bit-identical from run to run) ----
 * dout: [rows, cols]; db: [cols] f32, accumulated (+=). scratch: at least
 * tilearn_bias_grad_scratch_len(rows, cols) f32 elements (0 for rows <= 256), clobbered. */
size_t tilearn_bias_grad_scratch_len(size_t rows, size_t cols);

int tilearn_bias_grad(int dtype, const void *dout, size_t rows, size_t cols, float *db,
                      float *scratch, size_t scratch_len, cudaStream_t stream);

/* A causal attention mask's extra restrictions (crates/tilearn-ops/src/key_mask.rs): query i
 * of batch row b sees the keys lo(i) ..= i, lo(i) = max(i - positions[b * seq + i],
 * i + 1 - sliding_window) clamped to [0, i]. positions: int32 [batch, seq] restarting at 0 for
 * each packed example (0, or the previous position + 1; the caller checks), 4-byte aligned, or
 * NULL; sliding_window: 0 for none. A NULL mask pointer is plain causal attention.
 * alibi_slopes: f32 [q_heads] ALiBi slopes (crates/tilearn-ops/src/alibi.rs), 4-byte aligned,
 * or NULL: head h adds slope[h] * (j - i) to the scaled score of query i and key j before the
 * softmax (a soft mask: Bloom, Baichuan-13B); lse is then that of the biased scores. */
typedef struct tilearn_key_mask {
    const int32_t *positions;
    size_t sliding_window;
    const float *alibi_slopes;
} tilearn_key_mask;

/* ---- attention.cu: the row-wise kernels of causal grouped-query attention (the matrix
 *      products run on cuBLASLt; see crates/tilearn-ops/src/cuda/attention.rs) ----
 * scores / dprobs: f32 [rows, ld]; probs (P, or dS in place): [rows, ld] of the dtype; rows are
 * (batch, head, query) with query position i = row % seq; columns [0, seq) are used, ld >= seq;
 * every probs column < seq is written, keys j > i as exact zeros. lse, delta: f32 [rows]. */

/* dst[o, yi, xi, :] = src[o, xi, yi, :] for rows of inner_bytes bytes (src != dst). */
int tilearn_attention_swap_axes(const void *src, void *dst, size_t outer, size_t x, size_t y,
                                size_t inner_bytes, cudaStream_t stream);
/* The three row kernels take a key mask (NULL: causal) whose positions start at the batch row of
 * row 0; row r belongs to batch row r / (heads * seq).
 * Causal softmax of each row: probs = exp(scores - lse), lse = log sum_{lo(i) <= j <= i}
 * exp(scores); keys outside [lo(i), i] get exact zeros. */
int tilearn_attention_softmax(int dtype, const float *scores, size_t ld, size_t rows, size_t seq,
                              void *probs, float *lse, const tilearn_key_mask *mask,
                              size_t heads, cudaStream_t stream);
/* Backward recomputation: probs = exp(scores - lse) (masked), lse from the forward. */
int tilearn_attention_probs(int dtype, const float *scores, size_t ld, size_t rows, size_t seq,
                            const float *lse, void *probs, const tilearn_key_mask *mask,
                            size_t heads, cudaStream_t stream);
/* In place: probs_ds = probs * (dprobs - delta[row]) * scale for keys lo(i) <= j <= i, 0
 * elsewhere. */
int tilearn_attention_dscores(int dtype, void *probs_ds, const float *dprobs, size_t ld,
                              size_t rows, size_t seq, const float *delta, float scale,
                              const tilearn_key_mask *mask, size_t heads, cudaStream_t stream);
/* delta[b, h, t] = sum_d dout[b, t, h, d] * out[b, t, h, d] (f32, written); dout, out:
 * [batch, seq, heads, head_dim]; delta: [batch, heads, seq]. */
int tilearn_attention_delta(int dtype, const void *dout, const void *out, size_t batch,
                            size_t seq, size_t heads, size_t head_dim, float *delta,
                            cudaStream_t stream);

/* ---- flash_attention.cu: fused causal grouped-query attention on tensor cores (FlashAttention-2
 *      style; bf16 and f16 only, head_dim 64 or 128; S and P never reach device memory) ----
 * q / out / dout / dq: [batch, seq, q_heads, head_dim]; k / v / dk / dv: [batch, seq, kv_heads,
 * head_dim], all of the dtype and 16-byte aligned; lse / delta: f32 [batch, q_heads, seq]. Query
 * head h reads kv head h / (q_heads / kv_heads); scale is 1/sqrt(head_dim) for the usual
 * attention. Anything unsupported (f32, another head_dim, a misaligned pointer, q_heads not a
 * multiple of kv_heads) launches nothing and returns cudaErrorInvalidValue. */

/* 1 when the kernels serve this dtype and head_dim, else 0. */
int tilearn_flash_attention_supported(int dtype, size_t head_dim);
/* 1 when a call of this dtype and head_dim, with (masked = 1) or without a key mask or ALiBi
 * slopes, runs the Hopper kernels (flash_attention_sm90.cu: wgmma, compute capability 9.0,
 * bf16 / f16, head_dim 64 or 128 (128 unless TILEARN_FLASH_SM90_HD128=0), unmasked,
 * TILEARN_FLASH_SM80 unset) on the current device, forward and backward; else 0 (the mma.sync
 * kernels). Their deterministic backward computes the mma.sync one's products in the same order;
 * the forward walks keys in other blocks, so its results agree to the rounding. */
int tilearn_flash_attention_uses_wgmma(int dtype, size_t head_dim, int masked);
/* 1 when, besides, the one-pass backward (dq_accum) exists for the call: head_dim 64. */
int tilearn_flash_attention_one_pass(int dtype, size_t head_dim, int masked);
/* out = softmax(scale * q k^T, causal) v and lse = log sum_{j <= i} exp(scale * q_i . k_j)
 * (natural log), both written (=); under a key mask (NULL: causal) the keys lo(i) <= j <= i. */
int tilearn_flash_attention_forward(int dtype, const void *q, const void *k, const void *v,
                                    void *out, float *lse, size_t batch, size_t seq,
                                    size_t q_heads, size_t kv_heads, size_t head_dim, float scale,
                                    const tilearn_key_mask *mask, cudaStream_t stream);
/* dq, dk, dv written (=) from dout, the inputs, the forward's lse and delta = rowsum(dout * out)
 * (tilearn_attention_delta). dq_accum NULL: deterministic (no atomics, a fixed summation order,
 * dQ in a second pass over the keys). dq_accum set (16-byte aligned, at least
 * tilearn_flash_attention_dq_accum_len(..) f32; contents overwritten): where the Hopper kernels
 * run, one pass computes dK, dV and dQ, dQ summed in f32 by reduce-adds into dq_accum (faster,
 * the same to f32 rounding, not bit-reproducible from run to run); elsewhere it is unused. */
int tilearn_flash_attention_backward(int dtype, const void *dout, const void *q, const void *k,
                                     const void *v, const float *lse, const float *delta,
                                     void *dq, void *dk, void *dv, size_t batch, size_t seq,
                                     size_t q_heads, size_t kv_heads, size_t head_dim,
                                     float scale, const tilearn_key_mask *mask, float *dq_accum,
                                     cudaStream_t stream);
/* f32 elements of the backward's dq_accum for this shape: batch * q_heads * head_dim * seq
 * rounded up to a multiple of 64 (0 when the product overflows size_t). */
size_t tilearn_flash_attention_dq_accum_len(size_t batch, size_t seq, size_t q_heads,
                                            size_t head_dim);

/* ---- cached_attention.cu: causal grouped-query attention of n new queries against a key/value
 *      cache (generation; forward only) ----
 * q / out: [n, q_heads, head_dim]; k / v: [positions, kv_heads, head_dim] with at least
 * start + n positions; query row i (absolute position start + i) attends to keys 0..=start + i,
 * query head h to kv head h / (q_heads / kv_heads). out = softmax(scale * q k^T) v, written (=),
 * f32 arithmetic. head_dim <= 256, n <= 65535, q_heads a multiple of kv_heads; otherwise
 * nothing is launched and cudaErrorInvalidValue returned. alibi_slopes: f32 [q_heads] ALiBi
 * slopes (head h adds slope[h] * (j - (start + i)) to its scaled scores), or NULL. */
int tilearn_cached_attention(int dtype, const void *q, const void *k, const void *v, void *out,
                             size_t n, size_t start, size_t q_heads, size_t kv_heads,
                             size_t head_dim, float scale, const float *alibi_slopes,
                             cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* TILEARN_KERNELS_H */
