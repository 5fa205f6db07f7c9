// optim_lamb.cu: fused multi-tensor LAMB step (NVIDIA Apex FusedLAMB, adam_w_mode=True).
//
// Fused:     three launches per step for all groups and tensors (never one per tensor):
//              1. moments + update + per-chunk partial squared norms of p and of the update;
//              2. per tensor (= per segment): the partials summed in chunk order, the trust
//                 ratio lr * ||p|| / ||u|| (f64, rounded once);
//              3. the update recomputed from the new moments (same operations, same bits; this
//                 avoids an n-element scratch buffer) and p = p - ratio * u, plus the working
//                 copy.
//            GradScaler skip (found_inf, all three kernels) and unscale (inv_scale); Apex's
//            global-norm clip: with grad_sumsq the divisor norm / max_norm (when norm >
//            max_norm) is computed on the device, otherwise the group's host clip_divisor is
//            used.
// Layout:    flat buffers of equal length: params, exp_avg, exp_avg_sq f32; grads f32 or bf16;
//            param copy bf16 or f16. The segments are the trust-ratio tensors. Scratch:
//            partials (2 f64 per chunk), ratios (1 f32 per segment).
// Precision: f32 elementwise with explicit round-to-nearest intrinsics, the order of
//            crates/tilearn-optim/src/lamb.rs (stage1, stage 2): per element
//              s = (g * inv_scale) / clip_divisor
//              m = m * beta1 + beta3 * s;  v = v * beta2 + ((1 - beta2) * s) * s
//              u = (m / bc1) / (sqrt(v / bc2) + eps) [+ wd * p]
//              p = p - ratio * u
//            Norms: p^2 and u^2 accumulated in f64 per thread, block sums in a fixed order per
//            chunk, chunk sums added in chunk order per tensor: deterministic.
// Output:    params, moments written in place (=); copy written (=); scratch clobbered.

#include "optim_common.cuh"

namespace {

using namespace tilearn_optim;

struct LambGroups {
    tilearn_optim_lamb_group g[TILEARN_OPTIM_MAX_GROUPS];
};

// Apex's clip divisor from the device sum of squares (lamb.rs::lamb_clip_divisor), or the
// group's host value without one.
__device__ __forceinline__ float clip_divisor(const Context& ctx,
                                              const tilearn_optim_lamb_group& s) {
    if (ctx.grad_sumsq == nullptr) return s.clip_divisor;
    const double norm = sqrt(*ctx.grad_sumsq);
    return norm > ctx.max_norm ? static_cast<float>(norm / ctx.max_norm) : 1.0f;
}

__device__ __forceinline__ float lamb_update(const tilearn_optim_lamb_group& s, float p, float m,
                                             float v) {
    const float m_hat = __fdiv_rn(m, s.bias_correction1);
    const float v_hat = __fdiv_rn(v, s.bias_correction2);
    const float denom = __fadd_rn(__fsqrt_rn(v_hat), s.eps);
    float u = __fdiv_rn(m_hat, denom);
    if (s.weight_decay != 0.0f) u = __fadd_rn(u, __fmul_rn(s.weight_decay, p));
    return u;
}

// Fixed-order block sum of a double (warp butterflies, then warps in order); result in
// thread 0. Ends with a barrier so the shared array can be reused.
__device__ double block_sum(double v) {
    __shared__ double warp_sums[kThreads / 32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    double total = 0.0;
    if (threadIdx.x == 0) {
        for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
    }
    __syncthreads();
    return total;
}

template <typename G>
struct Stage1Body {
    const Context& ctx;
    const tilearn_optim_lamb_group& s;
    float inv_scale;
    float divisor;
    const float* p;
    float* m;
    float* v;
    double pp;
    double uu;

    template <int W>
    __device__ __forceinline__ void run(uint64_t i) {
        float pr[W], gr[W], mr[W], vr[W];
        load_f32<W>(p, i, pr);
        Grad<G>::template load<W>(ctx.grads, i, gr);
        load_f32<W>(m, i, mr);
        load_f32<W>(v, i, vr);
#pragma unroll
        for (int k = 0; k < W; ++k) {
            const float sg = __fdiv_rn(__fmul_rn(gr[k], inv_scale), divisor);
            mr[k] = __fadd_rn(__fmul_rn(mr[k], s.beta1), __fmul_rn(s.beta3, sg));
            vr[k] = __fadd_rn(__fmul_rn(vr[k], s.beta2),
                              __fmul_rn(__fmul_rn(s.one_minus_beta2, sg), sg));
            const float u = lamb_update(s, pr[k], mr[k], vr[k]);
            pp += static_cast<double>(pr[k]) * static_cast<double>(pr[k]);
            uu += static_cast<double>(u) * static_cast<double>(u);
        }
        store_f32<W>(m, i, mr);
        store_f32<W>(v, i, vr);
    }
};

template <typename G>
__global__ void __launch_bounds__(kThreads)
    lamb_stage1(const Context ctx, const LambGroups groups, const float* __restrict__ p,
                float* __restrict__ m, float* __restrict__ v, double* __restrict__ partials) {
    if (skip_step(ctx)) return;
    const float inv_scale = ctx.inv_scale != nullptr ? *ctx.inv_scale : 1.0f;
    for (uint64_t c = blockIdx.x; c < ctx.n_chunks; c += gridDim.x) {
        const uint64_t si = find_segment(ctx, c);
        const tilearn_optim_segment seg = ctx.segments[si];
        const uint64_t begin = seg.start + (c - seg.chunk_begin) * ctx.chunk;
        const uint64_t end = min(begin + ctx.chunk, seg.end);
        // Uniform across the block (same chunk): the barriers in block_sum are safe.
        const uint64_t group = seg.group < TILEARN_OPTIM_MAX_GROUPS ? seg.group : 0;
        const tilearn_optim_lamb_group s = groups.g[group];
        Stage1Body<G> body{ctx, s, inv_scale, clip_divisor(ctx, s), p, m, v, 0.0, 0.0};
        for_range(ctx, begin, end, body);
        const double pp = block_sum(body.pp);
        const double uu = block_sum(body.uu);
        if (threadIdx.x == 0) {
            partials[2 * c] = pp;
            partials[2 * c + 1] = uu;
        }
    }
}

// One thread per tensor: its chunks' partials in chunk order, then the ratio
// (lamb.rs::lamb_trust_ratio).
__global__ void __launch_bounds__(kThreads)
    lamb_ratios(const Context ctx, const LambGroups groups, const double* __restrict__ partials,
                float* __restrict__ ratios) {
    if (skip_step(ctx)) return;
    const uint64_t si = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (si >= ctx.n_segments) return;
    const tilearn_optim_segment seg = ctx.segments[si];
    const uint64_t n_chunks = (seg.end - seg.start + ctx.chunk - 1) / ctx.chunk;
    double pp = 0.0, uu = 0.0;
    for (uint64_t c = seg.chunk_begin; c < seg.chunk_begin + n_chunks; ++c) {
        pp += partials[2 * c];
        uu += partials[2 * c + 1];
    }
    const uint64_t group = seg.group < TILEARN_OPTIM_MAX_GROUPS ? seg.group : 0;
    const tilearn_optim_lamb_group s = groups.g[group];
    const double pn = sqrt(pp), un = sqrt(uu);
    ratios[si] = (s.use_trust_ratio && pn != 0.0 && un != 0.0)
                     ? static_cast<float>(s.lr * (pn / un))
                     : static_cast<float>(s.lr);
}

template <typename O>
struct Stage2Body {
    const Context& ctx;
    const tilearn_optim_lamb_group& s;
    float ratio;
    float* p;
    const float* m;
    const float* v;

    template <int W>
    __device__ __forceinline__ void run(uint64_t i) {
        float pr[W], mr[W], vr[W];
        load_f32<W>(p, i, pr);
        load_f32<W>(m, i, mr);
        load_f32<W>(v, i, vr);
#pragma unroll
        for (int k = 0; k < W; ++k) {
            const float u = lamb_update(s, pr[k], mr[k], vr[k]);
            pr[k] = __fsub_rn(pr[k], __fmul_rn(ratio, u));
        }
        store_f32<W>(p, i, pr);
        Copy<O>::template store<W>(ctx.param_copy, i, pr, ctx.stochastic != 0, ctx.seed, ctx.step,
                                   ctx.index_offset);
    }
};

template <typename O>
__global__ void __launch_bounds__(kThreads)
    lamb_stage2(const Context ctx, const LambGroups groups, float* __restrict__ p,
                const float* __restrict__ m, const float* __restrict__ v,
                const float* __restrict__ ratios) {
    if (skip_step(ctx)) return;
    for_chunks(ctx, [&](uint64_t si, const tilearn_optim_segment& seg, uint64_t begin,
                        uint64_t end) {
        if (seg.group >= TILEARN_OPTIM_MAX_GROUPS) return;  // corrupt table: never read past
        const tilearn_optim_lamb_group s = groups.g[seg.group];
        Stage2Body<O> body{ctx, s, ratios[si], p, m, v};
        for_range(ctx, begin, end, body);
    });
}

struct LaunchLamb {
    const Context& ctx;
    const LambGroups& groups;
    float* p;
    float* m;
    float* v;
    double* partials;
    float* ratios;
    cudaStream_t stream;

    template <typename G, typename O>
    cudaError_t operator()() const {
        auto k1 = lamb_stage1<G>;
        k1<<<grid_for(k1, ctx.n_chunks), kThreads, 0, stream>>>(ctx, groups, p, m, v, partials);
        cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess) return err;
        const unsigned ratio_blocks =
            static_cast<unsigned>((ctx.n_segments + kThreads - 1) / kThreads);
        lamb_ratios<<<ratio_blocks, kThreads, 0, stream>>>(ctx, groups, partials, ratios);
        err = cudaGetLastError();
        if (err != cudaSuccess) return err;
        auto k2 = lamb_stage2<O>;
        k2<<<grid_for(k2, ctx.n_chunks), kThreads, 0, stream>>>(ctx, groups, p, m, v, ratios);
        return cudaGetLastError();
    }
};

}  // namespace

extern "C" int tilearn_optim_lamb(const tilearn_optim_launch* launch,
                                  const tilearn_optim_lamb_group* groups, uint32_t n_groups,
                                  float* params, float* exp_avg, float* exp_avg_sq,
                                  double* partials, size_t partials_len, float* ratios,
                                  size_t ratios_len, cudaStream_t stream) {
    if (groups == nullptr || n_groups == 0 || n_groups > TILEARN_OPTIM_MAX_GROUPS)
        return static_cast<int>(cudaErrorInvalidValue);
    if (exp_avg == nullptr || exp_avg_sq == nullptr) return static_cast<int>(cudaErrorInvalidValue);
    const float* state[3] = {params, exp_avg, exp_avg_sq};
    Context ctx;
    const cudaError_t err = make_context(launch, state, 3, &ctx);
    if (err != cudaSuccess) return static_cast<int>(err);
    if (ctx.n_chunks == 0) return static_cast<int>(cudaSuccess);
    if (partials == nullptr || ratios == nullptr || partials_len < 2 * ctx.n_chunks ||
        ratios_len < ctx.n_segments)
        return static_cast<int>(cudaErrorInvalidValue);
    LambGroups g{};
    for (uint32_t k = 0; k < n_groups; ++k) g.g[k] = groups[k];
    return static_cast<int>(
        dispatch_dtypes(launch->grad_dtype, launch->copy_dtype,
                        LaunchLamb{ctx, g, params, exp_avg, exp_avg_sq, partials, ratios, stream}));
}
