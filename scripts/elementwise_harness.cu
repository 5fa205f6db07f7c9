// elementwise_harness.cu: a development harness for the memory-bound kernels of the Llama MLP,
// outside cargo (the device machine has no Rust toolchain), as flash_harness.cu is for
// attention. It times the SwiGLU forward (activation.cu, through its C API) against the kernel
// it replaced, whose sigmoid branched on the sign of the gate (kept below as the baseline),
// checks that both give the same bits, and times a device-to-device copy of the same bytes as
// the ceiling. CUDA events, mean of 20 launches after 3 untimed, the variants alternating
// twice. scripts/flash_harness.sh builds it beside the flash harness; not a test of record
// (gpu-test checks the kernel against the CPU reference).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <vector>

#include "tilearn_dtype.cuh"
#include "tilearn_kernels.h"

namespace {

void check(cudaError_t e, const char* what) {
    if (e == cudaSuccess) return;
    std::printf("CUDA error %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
}

__device__ __forceinline__ float sigmoid_ref(float g) {
    if (g >= 0.0f) return 1.0f / (1.0f + expf(-g));
    const float e = expf(g);
    return e / (1.0f + e);
}

// The SwiGLU forward before the seventh session: sigmoid evaluated by a branch on the sign.
__global__ void swiglu_one_vector(const __nv_bfloat16* __restrict__ gate,
                                  const __nv_bfloat16* __restrict__ up,
                                  __nv_bfloat16* __restrict__ out, size_t nv) {
    using V = tilearn::Vec16<__nv_bfloat16>;
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
    for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < nv;
         i += stride) {
        const V g = reinterpret_cast<const V*>(gate)[i];
        const V u = reinterpret_cast<const V*>(up)[i];
        V o;
        for (int k = 0; k < V::kLen; ++k) {
            const float gf = __bfloat162float(g.v[k]);
            o.v[k] = __float2bfloat16(gf * sigmoid_ref(gf) * __bfloat162float(u.v[k]));
        }
        reinterpret_cast<V*>(out)[i] = o;
    }
}

template <typename F>
float mean_ms(F&& launch) {
    cudaEvent_t a, b;
    check(cudaEventCreate(&a), "event");
    check(cudaEventCreate(&b), "event");
    for (int i = 0; i < 3; ++i) launch();
    check(cudaEventRecord(a), "record");
    for (int i = 0; i < 20; ++i) launch();
    check(cudaEventRecord(b), "record");
    check(cudaEventSynchronize(b), "sync");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, a, b), "elapsed");
    return ms / 20;
}

void run(const char* name, size_t n) {
    std::vector<__nv_bfloat16> host(n);
    std::mt19937 rng(7);
    std::normal_distribution<float> dist(0.0f, 2.0f);
    __nv_bfloat16 *gate, *up, *out_new, *out_old;
    check(cudaMalloc(&gate, n * 2), "malloc");
    check(cudaMalloc(&up, n * 2), "malloc");
    check(cudaMalloc(&out_new, n * 2), "malloc");
    check(cudaMalloc(&out_old, n * 2), "malloc");
    for (auto* p : {gate, up}) {
        for (auto& x : host) x = __float2bfloat16(dist(rng));
        check(cudaMemcpy(p, host.data(), n * 2, cudaMemcpyHostToDevice), "upload");
    }
    const size_t nv = n / 8;
    auto launch_new = [&] {
        if (tilearn_swiglu_forward(TILEARN_DTYPE_BF16, gate, up, out_new, n, 0) != 0) std::exit(1);
    };
    auto launch_old = [&] {
        const size_t blocks = std::min<size_t>((nv + 255) / 256, 65535);
        swiglu_one_vector<<<static_cast<unsigned>(blocks), 256>>>(gate, up, out_old, nv);
    };
    launch_new();
    launch_old();
    check(cudaDeviceSynchronize(), "run");
    std::vector<__nv_bfloat16> a(n), b(n);
    check(cudaMemcpy(a.data(), out_new, n * 2, cudaMemcpyDeviceToHost), "download");
    check(cudaMemcpy(b.data(), out_old, n * 2, cudaMemcpyDeviceToHost), "download");
    size_t differ = 0;
    for (size_t i = 0; i < n; ++i)
        differ += reinterpret_cast<uint16_t&>(a[i]) != reinterpret_cast<uint16_t&>(b[i]);
    std::printf("%s %s: n = %zu, values differing %zu\n", differ ? "FAIL" : "PASS", name, n, differ);
    const double bytes = 3.0 * n * 2;
    char* copy_buf;  // a copy that reads and writes 3 n bytes moves what the kernel does
    check(cudaMalloc(&copy_buf, n * 6), "malloc");
    for (int rep = 0; rep < 2; ++rep) {
        const float t_old = mean_ms(launch_old), t_new = mean_ms(launch_new);
        const float t_copy = mean_ms([&] {
            check(cudaMemcpyAsync(copy_buf + n * 3, copy_buf, n * 3, cudaMemcpyDeviceToDevice),
                  "copy");
        });
        std::printf("  TIME %s swiglu forward: branching sigmoid %.3f ms (%.2f TB/s), branch-free "
                    "%.3f ms (%.2f TB/s); copy of the same bytes %.3f ms (%.2f TB/s)\n",
                    name, t_old, bytes / t_old / 1e9, t_new, bytes / t_new / 1e9, t_copy,
                    bytes / t_copy / 1e9);
    }
    for (auto* p : {gate, up, out_new, out_old}) cudaFree(p);
    cudaFree(copy_buf);
}

}  // namespace

int main() {
    run("TinyLlama 8 x 2048 x 5632", size_t(16384) * 5632);
    run("llama-134m 16 x 1024 x 2048", size_t(16384) * 2048);
    return 0;
}
