// optim_lion.cu: fused multi-tensor Lion step (Chen et al. 2023, as lion-pytorch writes it).
//
// Fused:     one launch per step for all parameter groups and tensors (segment table, see
//            optim_common.cuh): GradScaler skip (found_inf) and unscale (inv_scale), global-norm
//            clip coefficient, decoupled weight decay, the sign update, the moment update and the
//            bf16/f16 working copy.
// Layout:    flat buffers of equal length: params and exp_avg f32, grads f32 or bf16, param copy
//            bf16 or f16. Only elements inside the segments are touched.
// Precision: f32 with explicit round-to-nearest intrinsics, the operations and order of
//            crates/tilearn-optim/src/lion.rs (update_slice): per element
//              g = g * inv_scale [* clip_coef];  [p = p * decay_factor]
//              c = m * beta1 + (1 - beta1) * g   (each product and the sum rounded: the sign of
//                                                 c must match the CPU's exactly)
//              p = p + (-lr) * sign(c)           (sign(0) = sign(NaN) = 0, as torch.sign)
//              m = m * beta2 + (1 - beta2) * g
// Output:    params and exp_avg written in place (=); param copy written (=); grads only read.

#include "optim_common.cuh"

namespace {

using namespace tilearn_optim;

struct LionGroups {
    tilearn_optim_lion_group g[TILEARN_OPTIM_MAX_GROUPS];
};

__device__ __forceinline__ float torch_sign(float x) {
    return static_cast<float>(0.0f < x) - static_cast<float>(x < 0.0f);
}

template <typename G, typename O>
struct LionBody {
    const Context& ctx;
    const tilearn_optim_lion_group& s;
    const GradTransform& gt;
    float* p;
    float* m;

    template <int W>
    __device__ __forceinline__ void run(uint64_t i) {
        float pr[W], gr[W], mr[W];
        load_f32<W>(p, i, pr);
        Grad<G>::template load<W>(ctx.grads, i, gr);
        load_f32<W>(m, i, mr);
#pragma unroll
        for (int k = 0; k < W; ++k) {
            const float g = gt.apply(gr[k]);
            if (s.apply_decay) pr[k] = __fmul_rn(pr[k], s.decay_factor);
            const float c = __fadd_rn(__fmul_rn(mr[k], s.beta1), __fmul_rn(s.one_minus_beta1, g));
            pr[k] = __fadd_rn(pr[k], __fmul_rn(s.neg_lr, torch_sign(c)));
            mr[k] = __fadd_rn(__fmul_rn(mr[k], s.beta2), __fmul_rn(s.one_minus_beta2, g));
        }
        store_f32<W>(p, i, pr);
        store_f32<W>(m, i, mr);
        Copy<O>::template store<W>(ctx.param_copy, i, pr, ctx.stochastic != 0, ctx.seed, ctx.step,
                                   ctx.index_offset);
    }
};

template <typename G, typename O>
__global__ void __launch_bounds__(kThreads)
    lion_kernel(const Context ctx, const LionGroups groups, float* __restrict__ p,
                float* __restrict__ m) {
    if (skip_step(ctx)) return;
    const GradTransform gt = grad_transform(ctx);
    for_chunks(ctx, [&](uint64_t, const tilearn_optim_segment& seg, uint64_t begin,
                        uint64_t end) {
        if (seg.group >= TILEARN_OPTIM_MAX_GROUPS) return;  // corrupt table: never read past
        const tilearn_optim_lion_group s = groups.g[seg.group];
        LionBody<G, O> body{ctx, s, gt, p, m};
        for_range(ctx, begin, end, body);
    });
}

struct LaunchLion {
    const Context& ctx;
    const LionGroups& groups;
    float* p;
    float* m;
    cudaStream_t stream;

    template <typename G, typename O>
    cudaError_t operator()() const {
        auto kernel = lion_kernel<G, O>;
        const unsigned blocks = grid_for(kernel, ctx.n_chunks);
        kernel<<<blocks, kThreads, 0, stream>>>(ctx, groups, p, m);
        return cudaGetLastError();
    }
};

}  // namespace

extern "C" int tilearn_optim_lion(const tilearn_optim_launch* launch,
                                  const tilearn_optim_lion_group* groups, uint32_t n_groups,
                                  float* params, float* exp_avg, cudaStream_t stream) {
    if (groups == nullptr || n_groups == 0 || n_groups > TILEARN_OPTIM_MAX_GROUPS)
        return static_cast<int>(cudaErrorInvalidValue);
    if (exp_avg == nullptr) return static_cast<int>(cudaErrorInvalidValue);
    const float* state[2] = {params, exp_avg};
    Context ctx;
    const cudaError_t err = make_context(launch, state, 2, &ctx);
    if (err != cudaSuccess) return static_cast<int>(err);
    if (ctx.n_chunks == 0) return static_cast<int>(cudaSuccess);
    LionGroups g{};
    for (uint32_t k = 0; k < n_groups; ++k) g.g[k] = groups[k];
    return static_cast<int>(dispatch_dtypes(launch->grad_dtype, launch->copy_dtype,
                                            LaunchLion{ctx, g, params, exp_avg, stream}));
}
