// optim_sgd.cu: fused multi-tensor SGD step (torch.optim.SGD: momentum, dampening, nesterov,
// L2 weight decay).
//
// Fused:     one launch per step for all parameter groups and tensors (segment table, see
//            optim_common.cuh): GradScaler skip (found_inf) and unscale (inv_scale), global-norm
//            clip coefficient, weight decay, momentum buffer update, parameter update and the
//            bf16/f16 working copy.
// Layout:    flat buffers of equal length: params and momentum_buffer f32 (the buffer may be
//            NULL: plain SGD, torch keeps no buffer when momentum is 0), grads f32 or bf16,
//            param copy bf16 or f16. Only elements inside the segments are touched.
// Precision: f32 with explicit round-to-nearest intrinsics, the operations and order of
//            crates/tilearn-optim/src/sgd.rs (update_slice): per element
//              g = g * inv_scale [* clip_coef];  [g = g + wd * p]
//              buffer: first step buf = g, later buf = buf * momentum + (1 - dampening) * g
//              d = nesterov ? g + momentum * buf : buf      (d = g without a buffer)
//              p = p + (-lr) * d
// Output:    params and buffer written in place (=); param copy written (=); grads only read.

#include "optim_common.cuh"

namespace {

using namespace tilearn_optim;

struct SgdGroups {
    tilearn_optim_sgd_group g[TILEARN_OPTIM_MAX_GROUPS];
};

template <typename G, typename O>
struct SgdBody {
    const Context& ctx;
    const tilearn_optim_sgd_group& s;
    const GradTransform& gt;
    float* p;
    float* buf;

    template <int W>
    __device__ __forceinline__ void run(uint64_t i) {
        float pr[W], gr[W], br[W];
        load_f32<W>(p, i, pr);
        Grad<G>::template load<W>(ctx.grads, i, gr);
        if (buf != nullptr && !s.first_step) load_f32<W>(buf, i, br);
#pragma unroll
        for (int k = 0; k < W; ++k) {
            float g = gt.apply(gr[k]);
            if (s.weight_decay != 0.0f) g = __fadd_rn(g, __fmul_rn(s.weight_decay, pr[k]));
            float d = g;
            if (buf != nullptr) {
                br[k] = s.first_step ? g
                                     : __fadd_rn(__fmul_rn(br[k], s.momentum),
                                                 __fmul_rn(s.one_minus_dampening, g));
                d = s.nesterov ? __fadd_rn(g, __fmul_rn(s.momentum, br[k])) : br[k];
            }
            pr[k] = __fadd_rn(pr[k], __fmul_rn(s.neg_lr, d));
        }
        store_f32<W>(p, i, pr);
        if (buf != nullptr) store_f32<W>(buf, i, br);
        Copy<O>::template store<W>(ctx.param_copy, i, pr, ctx.stochastic != 0, ctx.seed, ctx.step,
                                   ctx.index_offset);
    }
};

template <typename G, typename O>
__global__ void __launch_bounds__(kThreads)
    sgd_kernel(const Context ctx, const SgdGroups groups, float* __restrict__ p,
               float* __restrict__ buf) {
    if (skip_step(ctx)) return;
    const GradTransform gt = grad_transform(ctx);
    for_chunks(ctx, [&](uint64_t, const tilearn_optim_segment& seg, uint64_t begin,
                        uint64_t end) {
        if (seg.group >= TILEARN_OPTIM_MAX_GROUPS) return;  // corrupt table: never read past
        const tilearn_optim_sgd_group s = groups.g[seg.group];
        SgdBody<G, O> body{ctx, s, gt, p, buf};
        for_range(ctx, begin, end, body);
    });
}

struct LaunchSgd {
    const Context& ctx;
    const SgdGroups& groups;
    float* p;
    float* buf;
    cudaStream_t stream;

    template <typename G, typename O>
    cudaError_t operator()() const {
        auto kernel = sgd_kernel<G, O>;
        const unsigned blocks = grid_for(kernel, ctx.n_chunks);
        kernel<<<blocks, kThreads, 0, stream>>>(ctx, groups, p, buf);
        return cudaGetLastError();
    }
};

}  // namespace

extern "C" int tilearn_optim_sgd(const tilearn_optim_launch* launch,
                                 const tilearn_optim_sgd_group* groups, uint32_t n_groups,
                                 float* params, float* momentum_buffer, cudaStream_t stream) {
    if (groups == nullptr || n_groups == 0 || n_groups > TILEARN_OPTIM_MAX_GROUPS)
        return static_cast<int>(cudaErrorInvalidValue);
    const float* state[2] = {params, momentum_buffer};
    Context ctx;
    const cudaError_t err = make_context(launch, state, 2, &ctx);
    if (err != cudaSuccess) return static_cast<int>(err);
    if (ctx.n_chunks == 0) return static_cast<int>(cudaSuccess);
    SgdGroups g{};
    for (uint32_t k = 0; k < n_groups; ++k) g.g[k] = groups[k];
    return static_cast<int>(dispatch_dtypes(launch->grad_dtype, launch->copy_dtype,
                                            LaunchSgd{ctx, g, params, momentum_buffer, stream}));
}
