// optim_adam.cu: fused multi-tensor Adam / AdamW step (torch.optim semantics, optional amsgrad).
//
// Fused:     one launch per step for all parameter groups and tensors (segment table, see
//            optim_common.cuh): GradScaler skip (found_inf) and unscale (inv_scale), global-norm
//            clip coefficient, L2 (Adam) or decoupled (AdamW) weight decay, both moment updates,
//            amsgrad maximum, bias-corrected parameter update and the bf16/f16 working copy.
// Layout:    flat buffers of equal length; params / exp_avg / exp_avg_sq / max_exp_avg_sq f32,
//            grads f32 or bf16, param copy bf16 or f16. Only elements inside the segments are
//            touched. 16-byte vector accesses when every base pointer is aligned.
// Precision: all arithmetic f32 with explicit round-to-nearest intrinsics (no FMA contraction),
//            the same operations in the same order as crates/tilearn-optim/src/adamw.rs
//            (update_slice): per element
//              g = g * inv_scale [* clip_coef];  [g = g + l2_wd * p];  [p = p * decay_factor]
//              m = lerp(m, g, 1-beta1)    (torch's lerp: two formulas split at weight 0.5)
//              v = v * beta2 + ((1-beta2) * g) * g
//              [vmax = max(vmax, v), NaN-propagating]
//              p = p + (neg_step * m) / (sqrt(v or vmax) / sqrt(bc2) + eps)
//            The step scalars (bias corrections, step size) come from the host, computed in f64
//            and rounded once (AdamWStepScalars). The working copy rounds the new f32 master.
//            tilearn_optim_adam_device_groups reads the groups' scalars from device memory
//            when the kernel runs instead of from its argument (a CUDA graph replays one launch
//            with each step's learning rate and bias corrections); same values, same bits.
// Output:    params, moments written in place (=); param copy written (=); grads only read.

#include "optim_common.cuh"

namespace {

using namespace tilearn_optim;

struct AdamGroups {
    tilearn_optim_adam_group g[TILEARN_OPTIM_MAX_GROUPS];
};

// torch's CPU lerp for a scalar weight (mirrors adamw.rs::lerp).
__device__ __forceinline__ float lerp_torch(float start, float end, float weight) {
    const float diff = __fsub_rn(end, start);
    return fabsf(weight) < 0.5f ? __fadd_rn(start, __fmul_rn(weight, diff))
                                : __fsub_rn(end, __fmul_rn(diff, __fsub_rn(1.0f, weight)));
}

// torch.maximum: NaN in either operand gives NaN (mirrors adamw.rs::nan_max).
__device__ __forceinline__ float nan_max(float a, float b) {
    return (isnan(a) || a >= b) ? a : b;
}

template <typename G, typename O>
struct AdamBody {
    const Context& ctx;
    const tilearn_optim_adam_group& s;
    const GradTransform& gt;
    float* p;
    float* m;
    float* v;
    float* vmax;

    template <int W>
    __device__ __forceinline__ void run(uint64_t i) {
        float pr[W], gr[W], mr[W], vr[W], xr[W];
        load_f32<W>(p, i, pr);
        Grad<G>::template load<W>(ctx.grads, i, gr);
        load_f32<W>(m, i, mr);
        load_f32<W>(v, i, vr);
        if (vmax != nullptr) load_f32<W>(vmax, i, xr);
#pragma unroll
        for (int k = 0; k < W; ++k) {
            float g = gt.apply(gr[k]);
            if (s.l2_decay) g = __fadd_rn(g, __fmul_rn(s.l2_weight_decay, pr[k]));
            if (s.decoupled_decay) pr[k] = __fmul_rn(pr[k], s.decay_factor);
            mr[k] = lerp_torch(mr[k], g, s.one_minus_beta1);
            vr[k] = __fmul_rn(vr[k], s.beta2);
            vr[k] = __fadd_rn(vr[k], __fmul_rn(__fmul_rn(s.one_minus_beta2, g), g));
            float second = vr[k];
            if (vmax != nullptr) {
                xr[k] = nan_max(xr[k], vr[k]);
                second = xr[k];
            }
            const float denom =
                __fadd_rn(__fdiv_rn(__fsqrt_rn(second), s.bias_correction2_sqrt), s.eps);
            pr[k] = __fadd_rn(pr[k], __fdiv_rn(__fmul_rn(s.neg_step_size, mr[k]), denom));
        }
        store_f32<W>(p, i, pr);
        store_f32<W>(m, i, mr);
        store_f32<W>(v, i, vr);
        if (vmax != nullptr) store_f32<W>(vmax, i, xr);
        Copy<O>::template store<W>(ctx.param_copy, i, pr, ctx.stochastic != 0, ctx.seed, ctx.step,
                                   ctx.index_offset);
    }
};

template <typename G, typename O>
__global__ void __launch_bounds__(kThreads)
    adam_kernel(const Context ctx, const AdamGroups groups,
                const tilearn_optim_adam_group* __restrict__ device_groups,
                float* __restrict__ p, float* __restrict__ m, float* __restrict__ v,
                float* __restrict__ vmax) {
    if (skip_step(ctx)) return;
    const GradTransform gt = grad_transform(ctx);
    for_chunks(ctx, [&](uint64_t, const tilearn_optim_segment& seg, uint64_t begin,
                        uint64_t end) {
        // The host validates groups; this guard only keeps a corrupt table from reading past
        // the kernel argument.
        if (seg.group >= TILEARN_OPTIM_MAX_GROUPS) return;
        const tilearn_optim_adam_group s =
            device_groups != nullptr ? device_groups[seg.group] : groups.g[seg.group];
        AdamBody<G, O> body{ctx, s, gt, p, m, v, vmax};
        for_range(ctx, begin, end, body);
    });
}

struct LaunchAdam {
    const Context& ctx;
    const AdamGroups& groups;
    const tilearn_optim_adam_group* device_groups;
    float* p;
    float* m;
    float* v;
    float* vmax;
    cudaStream_t stream;

    template <typename G, typename O>
    cudaError_t operator()() const {
        auto kernel = adam_kernel<G, O>;
        const unsigned blocks = grid_for(kernel, ctx.n_chunks);
        kernel<<<blocks, kThreads, 0, stream>>>(ctx, groups, device_groups, p, m, v, vmax);
        return cudaGetLastError();
    }
};

}  // namespace

extern "C" int tilearn_optim_adam(const tilearn_optim_launch* launch,
                                  const tilearn_optim_adam_group* groups, uint32_t n_groups,
                                  float* params, float* exp_avg, float* exp_avg_sq,
                                  float* max_exp_avg_sq, cudaStream_t stream) {
    if (groups == nullptr || n_groups == 0 || n_groups > TILEARN_OPTIM_MAX_GROUPS)
        return static_cast<int>(cudaErrorInvalidValue);
    if (exp_avg == nullptr || exp_avg_sq == nullptr) return static_cast<int>(cudaErrorInvalidValue);
    const float* state[4] = {params, exp_avg, exp_avg_sq, max_exp_avg_sq};
    Context ctx;
    const cudaError_t err = make_context(launch, state, 4, &ctx);
    if (err != cudaSuccess) return static_cast<int>(err);
    if (ctx.n_chunks == 0) return static_cast<int>(cudaSuccess);
    AdamGroups g{};
    for (uint32_t k = 0; k < n_groups; ++k) g.g[k] = groups[k];
    return static_cast<int>(dispatch_dtypes(
        launch->grad_dtype, launch->copy_dtype,
        LaunchAdam{ctx, g, nullptr, params, exp_avg, exp_avg_sq, max_exp_avg_sq, stream}));
}

extern "C" int tilearn_optim_adam_device_groups(const tilearn_optim_launch* launch,
                                                const tilearn_optim_adam_group* groups,
                                                uint32_t n_groups, float* params, float* exp_avg,
                                                float* exp_avg_sq, float* max_exp_avg_sq,
                                                cudaStream_t stream) {
    if (groups == nullptr || n_groups == 0 || n_groups > TILEARN_OPTIM_MAX_GROUPS)
        return static_cast<int>(cudaErrorInvalidValue);
    if (exp_avg == nullptr || exp_avg_sq == nullptr) return static_cast<int>(cudaErrorInvalidValue);
    const float* state[4] = {params, exp_avg, exp_avg_sq, max_exp_avg_sq};
    Context ctx;
    const cudaError_t err = make_context(launch, state, 4, &ctx);
    if (err != cudaSuccess) return static_cast<int>(err);
    if (ctx.n_chunks == 0) return static_cast<int>(cudaSuccess);
    const AdamGroups unused{};
    return static_cast<int>(dispatch_dtypes(
        launch->grad_dtype, launch->copy_dtype,
        LaunchAdam{ctx, unused, groups, params, exp_avg, exp_avg_sq, max_exp_avg_sq, stream}));
}
