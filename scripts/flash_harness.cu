// flash_harness.cu: a development harness for the flash attention kernels, outside cargo, for
// quick iteration on the device machine (no Rust toolchain there). It links the kernels' C API
// (flash_attention.cu, flash_attention_sm90.cu, attention.cu) and, for each shape:
//   - checks the one-pass Hopper backward against the deterministic one (dq relative error,
//     dk / dv bit for bit), a second one-pass run against the first, and the deterministic
//     backward against the mma.sync one (TILEARN_FLASH_SM80=1) bit for bit;
//   - checks the TMA forward (the default) against the cp.async one bit for bit
//     (TILEARN_FLASH_SM90_FWD_TMA=0), and the one-pass backward with its Q / dO by TMA (the
//     default) against its cp.async loads (TILEARN_FLASH_SM90_BWD_TMA=0): dk / dv bit for bit,
//     dq within the one-pass bound;
//   - with timing on, reports forward, delta and backward milliseconds (CUDA events, mean of
//     20 launches, 5 at 16 K) and TFLOP/s for mma.sync, the deterministic and the one-pass
//     backward, and the two forwards and the two one-pass backwards alternately.
//   - checks and times the head_dim-128 wgmma forward and backward (TILEARN_FLASH_SM90_HD128=0
//     turns them off) against the mma.sync ones.
// It is not a test of record (the Rust GPU tests are); bench/RESULTS.md cites its figures as
// the "development harness". Build with scripts/flash_harness.sh; run `harness` (all shapes),
// `harness small` (correctness only, e.g. under compute-sanitizer) or `harness profile16k` (the
// 1 x 16 K kernels twice, for ncu).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "tilearn_kernels.h"

namespace {

void check_cuda(cudaError_t e, const char* what) {
    if (e == cudaSuccess) return;
    std::printf("CUDA error %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
}

void check_status(int status, const char* what) {
    if (status == 0) return;
    std::printf("kernel status %d (%s): %s\n", status,
                cudaGetErrorString(static_cast<cudaError_t>(status)), what);
    std::exit(1);
}

void use_mma_sync(bool on) {
    if (on) setenv("TILEARN_FLASH_SM80", "1", 1);
    else unsetenv("TILEARN_FLASH_SM80");
}

// The head_dim-64 forward with TMA loads (fwd_tma_kernel, the default) or cp.async (fwd_kernel).
void use_fwd_tma(bool on) {
    // "1" demands TMA (an error status if the tensor maps cannot be encoded), so a timing or
    // comparison labelled TMA never measures the cp.async fallback.
    setenv("TILEARN_FLASH_SM90_FWD_TMA", on ? "1" : "0", 1);
}

// The one-pass backward's Q / dO by TMA (the default) or cp.async; "1" as in use_fwd_tma.
void use_bwd_tma(bool on) { setenv("TILEARN_FLASH_SM90_BWD_TMA", on ? "1" : "0", 1); }

// A device buffer of n elements of T, freed with the owner.
template <typename T>
struct Buffer {
    T* ptr = nullptr;
    size_t n = 0;
    explicit Buffer(size_t count) : n(count) {
        check_cuda(cudaMalloc(&ptr, n * sizeof(T)), "cudaMalloc");
        check_cuda(cudaMemset(ptr, 0, n * sizeof(T)), "cudaMemset");
    }
    ~Buffer() { cudaFree(ptr); }
    Buffer(Buffer&& other) noexcept : ptr(other.ptr), n(other.n) { other.ptr = nullptr; }
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    std::vector<float> download() const {
        std::vector<T> host(n);
        check_cuda(cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost), "copy");
        return std::vector<float>(host.begin(), host.end());
    }
};

// max |a - b| / max |a|.
double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
    double scale = 0, worst = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        scale = std::fmax(scale, std::fabs(a[i]));
        const double d = std::fabs(static_cast<double>(a[i]) - b[i]);
        if (!(d <= worst)) worst = d;  // NaN sticks
    }
    return worst / (scale > 0 ? scale : 1);
}

size_t differing(const std::vector<float>& a, const std::vector<float>& b) {
    size_t n = 0;
    for (size_t i = 0; i < a.size(); ++i) n += a[i] != b[i];
    return n;
}

// n standard-normal values of T on the device.
template <typename T>
Buffer<T> random_buffer(std::mt19937& rng, size_t n) {
    std::normal_distribution<float> normal(0.f, 1.f);
    Buffer<T> b(n);
    std::vector<T> host(n);
    for (auto& x : host) x = T(normal(rng));
    check_cuda(cudaMemcpy(b.ptr, host.data(), n * sizeof(T), cudaMemcpyHostToDevice), "copy");
    return b;
}

struct Shape {
    int batch, seq, q_heads, kv_heads;
};

// Mean milliseconds of `launch` over the shape's repetitions (20, 5 from 16 K tokens), after two
// untimed ones; CUDA events on the default stream.
template <typename F>
float mean_ms(const Shape& sh, F&& launch) {
    const int reps = sh.seq >= 16384 ? 5 : 20;
    cudaEvent_t start, end;
    check_cuda(cudaEventCreate(&start), "event");
    check_cuda(cudaEventCreate(&end), "event");
    for (int i = 0; i < 2; ++i) launch();
    check_cuda(cudaEventRecord(start), "record");
    for (int i = 0; i < reps; ++i) launch();
    check_cuda(cudaEventRecord(end), "record");
    check_cuda(cudaEventSynchronize(end), "sync");
    float ms = 0;
    check_cuda(cudaEventElapsedTime(&ms, start, end), "elapsed");
    cudaEventDestroy(start);
    cudaEventDestroy(end);
    return ms / reps;
}

template <typename T>
bool run_shape(Shape sh, int dtype, bool timing) {
    constexpr int kD = 64;
    const size_t nq = size_t(sh.batch) * sh.seq * sh.q_heads * kD;
    const size_t nk = size_t(sh.batch) * sh.seq * sh.kv_heads * kD;
    const size_t nl = size_t(sh.batch) * sh.q_heads * sh.seq;
    std::mt19937 rng(1234 + sh.seq + sh.q_heads);
    auto random = [&](size_t n) { return random_buffer<T>(rng, n); };
    Buffer<T> q = random(nq), k = random(nk), v = random(nk), dout = random(nq);
    Buffer<T> out(nq), dq_det(nq), dq_one(nq), dq_again(nq), dk_det(nk), dk_one(nk), dv_det(nk),
        dv_one(nk), out_other(nq), dq_cp(nq), dk_cp(nk), dv_cp(nk);
    Buffer<float> lse(nl), delta(nl), lse_other(nl);
    Buffer<float> acc(tilearn_flash_attention_dq_accum_len(sh.batch, sh.seq, sh.q_heads, kD));
    const float scale = 0.125f;
    // The forward the switches pick, into (o, l).
    auto forward_into = [&](T* o, float* l, const char* what) {
        check_status(tilearn_flash_attention_forward(dtype, q.ptr, k.ptr, v.ptr, o, l, sh.batch,
                                                     sh.seq, sh.q_heads, sh.kv_heads, kD, scale,
                                                     nullptr, 0),
                     what);
    };
    auto forward = [&] { forward_into(out.ptr, lse.ptr, "forward"); };
    auto make_delta = [&] {
        check_status(tilearn_attention_delta(dtype, dout.ptr, out.ptr, sh.batch, sh.seq,
                                             sh.q_heads, kD, delta.ptr, 0),
                     "delta");
    };
    auto backward = [&](T* dq, T* dk, T* dv, float* dq_accum) {
        check_status(tilearn_flash_attention_backward(dtype, dout.ptr, q.ptr, k.ptr, v.ptr,
                                                      lse.ptr, delta.ptr, dq, dk, dv, sh.batch,
                                                      sh.seq, sh.q_heads, sh.kv_heads, kD, scale,
                                                      nullptr, dq_accum, 0),
                     "backward");
    };

    use_mma_sync(false);
    // The TMA forward against fwd_kernel: the same products in the same order, the same bits.
    use_fwd_tma(true);
    forward_into(out_other.ptr, lse_other.ptr, "forward (TMA)");
    use_fwd_tma(false);
    forward();
    check_cuda(cudaDeviceSynchronize(), "forward");
    use_fwd_tma(true);
    const size_t tma_diff = differing(out.download(), out_other.download()) +
                            differing(lse.download(), lse_other.download());
    // The forward against the mma.sync one (key blocks of 64, the running maximum moved at
    // every block): the same softmax to the rounding.
    use_mma_sync(true);
    forward_into(out_other.ptr, lse_other.ptr, "forward (mma.sync)");
    use_mma_sync(false);
    check_cuda(cudaDeviceSynchronize(), "forward (mma.sync)");
    const double e_out = rel_err(out_other.download(), out.download());
    const double e_lse = rel_err(lse_other.download(), lse.download());
    make_delta();
    backward(dq_det.ptr, dk_det.ptr, dv_det.ptr, nullptr);
    backward(dq_one.ptr, dk_one.ptr, dv_one.ptr, acc.ptr);
    check_cuda(cudaDeviceSynchronize(), "one-pass");
    const double e_dq = rel_err(dq_det.download(), dq_one.download());
    const size_t kv_diff = differing(dk_det.download(), dk_one.download()) +
                           differing(dv_det.download(), dv_one.download());
    backward(dq_again.ptr, dk_one.ptr, dv_one.ptr, acc.ptr);
    check_cuda(cudaDeviceSynchronize(), "one-pass again");
    const double e_again = rel_err(dq_one.download(), dq_again.download());
    // The one-pass backward's cp.async loads against its TMA ones (above, the default "1").
    use_bwd_tma(false);
    backward(dq_cp.ptr, dk_cp.ptr, dv_cp.ptr, acc.ptr);
    check_cuda(cudaDeviceSynchronize(), "one-pass (cp.async)");
    use_bwd_tma(true);
    const double e_cp = rel_err(dq_one.download(), dq_cp.download());
    const size_t cp_diff =
        differing(dk_one.download(), dk_cp.download()) + differing(dv_one.download(), dv_cp.download());
    use_mma_sync(true);
    backward(dq_again.ptr, dk_one.ptr, dv_one.ptr, nullptr);
    check_cuda(cudaDeviceSynchronize(), "mma.sync");
    use_mma_sync(false);
    const size_t sm80_diff = differing(dq_det.download(), dq_again.download());
    const double tol_out = dtype == TILEARN_DTYPE_BF16 ? 1e-2 : 2e-3;
    const bool ok = e_dq < 4e-3 && e_again < 4e-3 && e_cp < 4e-3 && kv_diff == 0 &&
                    cp_diff == 0 && sm80_diff == 0 && tma_diff == 0 && e_out < tol_out &&
                    e_lse < 1e-6;
    std::printf(
        "%s B%d T%d H%d/%d %s: one-pass vs deterministic dq %.2e, dk/dv differing %zu; "
        "one-pass rerun dq %.2e; cp.async one-pass dq %.2e, dk/dv differing %zu; deterministic "
        "vs mma.sync dq differing %zu; TMA forward out/lse differing %zu; forward vs mma.sync "
        "out %.2e, lse %.2e\n",
        ok ? "PASS" : "FAIL", sh.batch, sh.seq, sh.q_heads, sh.kv_heads,
        dtype == TILEARN_DTYPE_BF16 ? "bf16" : "f16", e_dq, kv_diff, e_again, e_cp, cp_diff,
        sm80_diff, tma_diff, e_out, e_lse);
    if (!timing) return ok;

    auto time_ms = [&](auto&& launch) { return mean_ms(sh, launch); };
    const double fwd_flops = 4.0 * sh.batch * sh.q_heads * kD * (double(sh.seq) * sh.seq / 2);
    const char* names[] = {"mma.sync", "wgmma-det", "wgmma-1p"};
    for (int variant = 0; variant < 3; ++variant) {
        use_mma_sync(variant == 0);
        float* dq_accum = variant == 2 ? acc.ptr : nullptr;
        const float tf = time_ms(forward), td = time_ms(make_delta);
        const float tb = time_ms([&] { backward(dq_one.ptr, dk_one.ptr, dv_one.ptr, dq_accum); });
        std::printf(
            "  TIME %-9s B%d T%d H%d/%d: fwd %.3f ms (%.0f TF/s)  delta %.3f  bwd %.3f ms "
            "(%.0f TF/s)  total %.3f ms\n",
            names[variant], sh.batch, sh.seq, sh.q_heads, sh.kv_heads, tf, fwd_flops / tf / 1e9,
            td, tb, 2.5 * fwd_flops / tb / 1e9, tf + td + tb);
    }
    use_mma_sync(false);
    // The two forwards alternately, twice each (clocks drift within a call).
    for (int rep = 0; rep < 2; ++rep) {
        for (bool tma : {false, true}) {
            use_fwd_tma(tma);
            const float t = time_ms(forward);
            std::printf("  TIME fwd-%s B%d T%d H%d/%d: fwd %.3f ms (%.0f TF/s)\n",
                        tma ? "tma    " : "cp.async", sh.batch, sh.seq, sh.q_heads, sh.kv_heads, t,
                        fwd_flops / t / 1e9);
        }
    }
    use_fwd_tma(true);
    for (int rep = 0; rep < 2; ++rep) {
        for (bool tma : {false, true}) {
            use_bwd_tma(tma);
            const float t = time_ms([&] { backward(dq_one.ptr, dk_one.ptr, dv_one.ptr, acc.ptr); });
            std::printf("  TIME bwd-%s B%d T%d H%d/%d: one-pass bwd %.3f ms (%.0f TF/s)\n",
                        tma ? "tma    " : "cp.async", sh.batch, sh.seq, sh.q_heads, sh.kv_heads, t,
                        2.5 * fwd_flops / t / 1e9);
        }
    }
    return ok;
}

void use_hd128_wgmma(bool on) {
    if (on) unsetenv("TILEARN_FLASH_SM90_HD128");  // the default
    else setenv("TILEARN_FLASH_SM90_HD128", "0", 1);
}

// head_dim 128: the wgmma kernels (the default) against the mma.sync ones on the same inputs:
// the forward (out max relative error, lse), then both backwards from the mma.sync forward's out
// and lse (dq, dk, dv: bit for bit; max relative error and values differing); with timing on, both
// families' forward and backward milliseconds and TFLOP/s.
template <typename T>
bool run_hd128(Shape sh, int dtype, bool timing) {
    constexpr int kD = 128;
    const size_t nq = size_t(sh.batch) * sh.seq * sh.q_heads * kD;
    const size_t nk = size_t(sh.batch) * sh.seq * sh.kv_heads * kD;
    const size_t nl = size_t(sh.batch) * sh.q_heads * sh.seq;
    std::mt19937 rng(777 + sh.seq + sh.q_heads);
    auto random = [&](size_t n) { return random_buffer<T>(rng, n); };
    Buffer<T> q = random(nq), k = random(nk), v = random(nk), dout = random(nq), out_ref(nq),
              out_new(nq);
    Buffer<T> dq_ref(nq), dq_new(nq), dk_ref(nk), dk_new(nk), dv_ref(nk), dv_new(nk);
    Buffer<float> lse_ref(nl), lse_new(nl), delta(nl);
    const float scale = 0.08838834764f;  // 1 / sqrt(128)
    auto forward = [&](T* out, float* lse) {
        check_status(tilearn_flash_attention_forward(dtype, q.ptr, k.ptr, v.ptr, out, lse,
                                                     sh.batch, sh.seq, sh.q_heads, sh.kv_heads,
                                                     kD, scale, nullptr, 0),
                     "forward hd128");
    };
    auto backward = [&](T* dq, T* dk, T* dv) {
        check_status(tilearn_flash_attention_backward(
                         dtype, dout.ptr, q.ptr, k.ptr, v.ptr, lse_ref.ptr, delta.ptr, dq, dk, dv,
                         sh.batch, sh.seq, sh.q_heads, sh.kv_heads, kD, scale, nullptr, nullptr,
                         0),
                     "backward hd128");
    };
    use_hd128_wgmma(false);
    forward(out_ref.ptr, lse_ref.ptr);
    check_status(tilearn_attention_delta(dtype, dout.ptr, out_ref.ptr, sh.batch, sh.seq,
                                         sh.q_heads, kD, delta.ptr, 0),
                 "delta hd128");
    backward(dq_ref.ptr, dk_ref.ptr, dv_ref.ptr);
    use_hd128_wgmma(true);
    forward(out_new.ptr, lse_new.ptr);
    backward(dq_new.ptr, dk_new.ptr, dv_new.ptr);
    check_cuda(cudaDeviceSynchronize(), "hd128");
    const double e_out = rel_err(out_ref.download(), out_new.download());
    const double e_lse = rel_err(lse_ref.download(), lse_new.download());
    const Buffer<T>* pairs[3][2] = {{&dq_ref, &dq_new}, {&dk_ref, &dk_new}, {&dv_ref, &dv_new}};
    double e_grad[3];
    size_t n_diff[3];
    for (int i = 0; i < 3; ++i) {
        const auto a = pairs[i][0]->download(), b = pairs[i][1]->download();
        e_grad[i] = rel_err(a, b);
        n_diff[i] = differing(a, b);
    }
    // The backward is the mma.sync one's products in the same order: bit for bit (the errors
    // are printed to size a difference should one appear).
    const double tol_out = dtype == TILEARN_DTYPE_BF16 ? 1e-2 : 2e-3;
    const bool ok = e_out < tol_out && e_lse < 1e-6 && n_diff[0] + n_diff[1] + n_diff[2] == 0;
    std::printf(
        "%s hd128 B%d T%d H%d/%d %s: wgmma vs mma.sync out %.2e, lse %.2e; backward dq %.2e "
        "(%zu differ), dk %.2e (%zu), dv %.2e (%zu)\n",
        ok ? "PASS" : "FAIL", sh.batch, sh.seq, sh.q_heads, sh.kv_heads,
        dtype == TILEARN_DTYPE_BF16 ? "bf16" : "f16", e_out, e_lse, e_grad[0], n_diff[0],
        e_grad[1], n_diff[1], e_grad[2], n_diff[2]);
    if (timing) {
        auto time_ms = [&](auto&& launch) { return mean_ms(sh, launch); };
        const double flops = 4.0 * sh.batch * sh.q_heads * kD * (double(sh.seq) * sh.seq / 2);
        for (int on = 0; on < 2; ++on) {
            use_hd128_wgmma(on == 1);
            const float tf = time_ms([&] { forward(out_new.ptr, lse_new.ptr); });
            const float tb = time_ms([&] { backward(dq_new.ptr, dk_new.ptr, dv_new.ptr); });
            std::printf(
                "  TIME hd128 %-8s B%d T%d H%d/%d: fwd %.3f ms (%.0f TF/s)  bwd %.3f ms (%.0f "
                "TF/s)  total %.3f ms\n",
                on ? "wgmma" : "mma.sync", sh.batch, sh.seq, sh.q_heads, sh.kv_heads, tf,
                flops / tf / 1e9, tb, 2.5 * flops / tb / 1e9, tf + tb);
        }
    }
    use_hd128_wgmma(false);
    return ok;
}

}  // namespace

// `harness profile16k`: the forward and the one-pass backward at 1 x 16 K (bf16, 32/4 heads),
// twice each and nothing else, for Nsight Compute to profile (scripts/gpu-phases/attn-profile.sh).
int profile16k() {
    const Shape sh{1, 16384, 32, 4};
    constexpr int kD = 64;
    using T = __nv_bfloat16;
    const int dtype = TILEARN_DTYPE_BF16;
    const size_t nq = size_t(sh.batch) * sh.seq * sh.q_heads * kD;
    const size_t nk = size_t(sh.batch) * sh.seq * sh.kv_heads * kD;
    const size_t nl = size_t(sh.batch) * sh.q_heads * sh.seq;
    std::mt19937 rng(99);
    Buffer<T> q = random_buffer<T>(rng, nq), k = random_buffer<T>(rng, nk),
              v = random_buffer<T>(rng, nk), dout = random_buffer<T>(rng, nq);
    Buffer<T> out(nq), dq(nq), dk(nk), dv(nk);
    Buffer<float> lse(nl), delta(nl);
    Buffer<float> acc(tilearn_flash_attention_dq_accum_len(sh.batch, sh.seq, sh.q_heads, kD));
    for (int rep = 0; rep < 2; ++rep) {
        check_status(tilearn_flash_attention_forward(dtype, q.ptr, k.ptr, v.ptr, out.ptr, lse.ptr,
                                                     sh.batch, sh.seq, sh.q_heads, sh.kv_heads,
                                                     kD, 0.125f, nullptr, 0),
                     "forward");
        check_status(tilearn_attention_delta(dtype, dout.ptr, out.ptr, sh.batch, sh.seq,
                                             sh.q_heads, kD, delta.ptr, 0),
                     "delta");
        check_status(tilearn_flash_attention_backward(
                         dtype, dout.ptr, q.ptr, k.ptr, v.ptr, lse.ptr, delta.ptr, dq.ptr, dk.ptr,
                         dv.ptr, sh.batch, sh.seq, sh.q_heads, sh.kv_heads, kD, 0.125f, nullptr,
                         acc.ptr, 0),
                     "backward");
    }
    check_cuda(cudaDeviceSynchronize(), "profile16k");
    std::printf("profile16k: done\n");
    return 0;
}

int main(int argc, char** argv) {
    use_fwd_tma(true);
    use_bwd_tma(true);
    if (argc > 1 && std::string(argv[1]) == "profile16k") return profile16k();
    const bool small_only = argc > 1 && std::string(argv[1]) == "small";
    bool ok = true;
    ok &= run_shape<__nv_bfloat16>({1, 130, 2, 1}, TILEARN_DTYPE_BF16, false);
    ok &= run_shape<__nv_bfloat16>({2, 1000, 4, 2}, TILEARN_DTYPE_BF16, false);
    ok &= run_shape<__half>({2, 333, 4, 4}, TILEARN_DTYPE_F16, false);
    ok &= run_shape<__nv_bfloat16>({1, 64, 3, 1}, TILEARN_DTYPE_BF16, false);
    ok &= run_shape<__nv_bfloat16>({2, 300, 16, 2}, TILEARN_DTYPE_BF16, false);
    ok &= run_hd128<__nv_bfloat16>({1, 130, 2, 1}, TILEARN_DTYPE_BF16, false);
    ok &= run_hd128<__nv_bfloat16>({2, 333, 8, 1}, TILEARN_DTYPE_BF16, false);
    ok &= run_hd128<__half>({2, 257, 4, 2}, TILEARN_DTYPE_F16, false);
    ok &= run_hd128<__nv_bfloat16>({1, 64, 3, 3}, TILEARN_DTYPE_BF16, false);
    if (!small_only) {
        // Llama-2-7B's attention (32 heads of 128) at 1 x 4096 and 2 x 2048.
        ok &= run_hd128<__nv_bfloat16>({1, 4096, 32, 32}, TILEARN_DTYPE_BF16, true);
        ok &= run_hd128<__nv_bfloat16>({2, 2048, 32, 32}, TILEARN_DTYPE_BF16, true);
        ok &= run_shape<__nv_bfloat16>({16, 1024, 12, 12}, TILEARN_DTYPE_BF16, true);
        ok &= run_shape<__nv_bfloat16>({8, 2048, 32, 4}, TILEARN_DTYPE_BF16, true);
        ok &= run_shape<__nv_bfloat16>({1, 16384, 32, 4}, TILEARN_DTYPE_BF16, true);
    }
    std::printf(ok ? "ALL PASS\n" : "SOME FAILED\n");
    return ok ? 0 : 1;
}
