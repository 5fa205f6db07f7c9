"""How fast a training step can be on a power-capped GPU: the energy floor of a preset's step.

The TinyLlama step (8 x 2048 tokens) runs at the board's power limit (700 W on the H200): its
SM clock drops from 1980 MHz to 1560-1635 MHz, so the compute-bound kernels take longer inside
the step than one at a time under Nsight Compute. A step can then be no faster than the energy
its work needs divided by the power limit. This script measures that energy part by part; its
default measurement has nothing of tilearn in it, so the floor holds for any implementation of
the same step:

  gemm       every matrix product of one step (forward, input and weight gradients of the
             seven projections of each decoder layer, and the lm_head's three products chunk by
             chunk of tokens), bf16 inputs, f32 accumulation, captured in one CUDA graph and
             replayed back to back for --seconds: the sustained time a step's products take at
             the power limit. Run alone they draw the most power a step can, so at the limit
             their energy per FLOP is the lowest the board reaches (the clock is lowest), and
             that time is a lower bound on what they add to a step. With --gemm-bench the
             same products also run through tilearn's own linear-layer calls (`gemm-bench
             step`: its cuBLASLt algorithms, f32 weight gradients added by the GEMMs), and a
             floor is printed for each.
  memory     a device-to-device copy replayed for --memory-seconds: the power of a purely
             bandwidth-bound kernel, for the step's memory-bound parts (norms, elementwise,
             optimizer, loss) and, generously low, for attention.

    floor = gemm sustained ms + (attention ms + memory-bound ms) x memory power / power limit

where attention ms and memory-bound ms are the step's own kernel times at full clock (from
`scripts/step_breakdown.py`, passed as --attention-ms and --memory-bound-ms): those kernels
cannot run faster than that, and they cost at least the copy's power while they run. The
tokens per second that floor allows is the ceiling for this preset on this board.

    python3 benches/power_floor.py floor --preset tinyllama-1.1b --attention-ms 28.30 \\
        --memory-bound-ms 27.56 --gemm-bench target/release/gemm-bench
    python3 benches/power_floor.py sample --label tilearn -- tilearn bench --preset tinyllama-1.1b

`sample` runs a command while nvidia-smi samples the SM clock, the power draw and the throttle
reasons every 100 ms, and prints their medians over the busy samples (power above 250 W), so a
whole training run's clocks can be set beside the floor. One JSON line per measurement.
"""
import argparse
import json
import statistics
import subprocess
import sys
import threading
import time

# The Llama presets (SwiGLU MLP, no biases); their shapes come from benches/pytorch_baseline.py.
LLAMA_PRESETS = ["llama-134m", "tinyllama-1.1b"]
SMI_FIELDS = "clocks.sm,power.draw,power.limit,clocks_event_reasons.active"
BUSY_WATTS = 250.0
SW_POWER_CAP = 0x4  # clocks_event_reasons: software power cap


class Sampler:
    """nvidia-smi in the background, one line every `period_ms`; `stop()` returns the samples
    as (seconds since start, SM MHz, watts, limit watts, reasons)."""

    def __init__(self, period_ms=100, gpu=0):
        self.t0 = time.time()
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits",
                 f"-lms={period_ms}", f"-i={gpu}"], stdout=subprocess.PIPE, text=True)
        except FileNotFoundError:
            sys.exit("power_floor: nvidia-smi is not on PATH (it samples clock and power; run "
                     "this on the GPU machine)")
        self.rows = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                self.rows.append((time.time() - self.t0, float(parts[0]), float(parts[1]),
                                  float(parts[2]), int(parts[3], 16)))
            except (ValueError, IndexError):
                continue  # a "[N/A]" field or a partial line

    def stop(self):
        self.proc.terminate()
        self.proc.wait()
        self.thread.join(timeout=2)
        return self.rows


def summarize(rows, since=0.0):
    """Medians over the busy samples taken `since` seconds after the sampler started."""
    busy = [r for r in rows if r[0] >= since and r[2] > BUSY_WATTS]
    if not busy:
        return {"busy_samples": 0}
    return {
        "busy_samples": len(busy),
        "sm_mhz_median": statistics.median(r[1] for r in busy),
        "sm_mhz_min": min(r[1] for r in busy),
        "power_w_median": statistics.median(r[2] for r in busy),
        "power_limit_w": busy[0][3],
        "power_cap_share": sum(1 for r in busy if r[4] & SW_POWER_CAP) / len(busy),
    }


def step_gemms(p, lce_chunk):
    """(m, n, k, kind) of every product of one step of preset shape `p` (pytorch_baseline's
    PRESETS entry): kind `fwd` is x·Wᵀ, `dx` dy·W, `dw` dyᵀ·x."""
    t = p["batch"] * p["seq"]
    c, i, heads = p["hidden_size"], p["intermediate_size"], p["num_attention_heads"]
    head_dim = c // heads
    q, kv = heads * head_dim, p["num_key_value_heads"] * head_dim
    linears = [(c, q), (c, kv), (c, kv), (q, c), (c, i), (c, i), (i, c)]  # (in, out)
    out = []
    for _ in range(p["num_hidden_layers"]):
        for fan_in, fan_out in linears:
            out += [(t, fan_out, fan_in, "fwd"), (t, fan_in, fan_out, "dx"),
                    (fan_out, fan_in, t, "dw")]
    chunk = min(lce_chunk, t)
    for _ in range(t // chunk):
        out += [(chunk, p["vocab_size"], c, "fwd"), (chunk, c, p["vocab_size"], "dx"),
                (p["vocab_size"], c, chunk, "dw")]
    return out


def gemm_graph(torch, gemms):
    """One CUDA graph of all the products, on buffers shared by shape (random values: the
    tensor cores' power depends on the bits they multiply)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    bufs = {}

    def buf(rows, cols, scale):
        key = (rows, cols, scale)
        if key not in bufs:
            bufs[key] = (torch.randn(rows, cols, device="cuda", generator=g) * scale).to(
                torch.bfloat16)
        return bufs[key]

    calls = []
    for m, n, k, kind in gemms:
        out = buf(m, n, 0.0)
        if kind == "fwd":  # activations [m, k] times weight [n, k] transposed
            a, b = buf(m, k, 1.0), buf(n, k, 0.02).t()
        elif kind == "dx":  # gradient [m, k] times weight [k, n]
            a, b = buf(m, k, 1e-3), buf(k, n, 0.02)
        else:  # gradient [k, m] transposed times activations [k, n]
            a, b = buf(k, m, 1e-3).t(), buf(k, n, 1.0)
        calls.append((a, b, out))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for a, b, out in calls:  # warm-up outside the graph: cuBLAS picks its kernels
            torch.mm(a, b, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for a, b, out in calls:
            torch.mm(a, b, out=out)
    return graph


def replay_loop(torch, fn, seconds, idle_s=3.0):
    """Runs `fn` once after `idle_s` seconds idle (the burst time, at full clock), then back to
    back for `seconds`; returns (burst ms, times ms, samples, loop start in sampler seconds)."""
    torch.cuda.synchronize()
    time.sleep(idle_s)
    sampler = Sampler()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    burst = start.elapsed_time(end)
    loop_start = time.time() - sampler.t0
    times, deadline = [], time.time() + seconds
    events = []
    while time.time() < deadline:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        events.append((e0, e1))
        if len(events) >= 4:  # keep a few replays queued, no more
            a, b = events.pop(0)
            b.synchronize()
            times.append(a.elapsed_time(b))
    for a, b in events:
        b.synchronize()
        times.append(a.elapsed_time(b))
    rows = sampler.stop()
    return burst, times, rows, loop_start


def torch_gemms(torch, p, args):
    """The step's products through torch.mm (cuBLAS), one CUDA graph replayed."""
    gemms = step_gemms(p, args.lce_chunk)
    tflop = sum(2.0 * m * n * k for m, n, k, _ in gemms) / 1e12
    graph = gemm_graph(torch, gemms)
    burst, times, rows, loop_start = replay_loop(torch, graph.replay, args.seconds)
    sustained = statistics.median(times[len(times) // 2:])
    return {"part": "gemm", "source": "torch.mm", "preset": args.preset,
            "products": len(gemms), "tflop": tflop, "burst_ms": burst,
            "sustained_ms": sustained, "replays": len(times),
            "burst_tflops": tflop / burst * 1e3, "sustained_tflops": tflop / sustained * 1e3,
            **summarize(rows, since=loop_start + args.seconds / 2)}


def tilearn_gemms(args):
    """The step's products through tilearn's own linear-layer calls (`gemm-bench step`)."""
    sampler = Sampler()
    done = subprocess.run([args.gemm_bench, "step", "--preset", args.preset,
                           "--seconds", str(args.seconds)], capture_output=True, text=True)
    rows = sampler.stop()
    if done.returncode != 0:
        sys.exit(f"power_floor: {args.gemm_bench} step failed: {done.stderr.strip()}")
    line = json.loads(done.stdout.strip().splitlines()[-1])
    end = rows[-1][0] if rows else 0.0
    return {"part": "gemm", "source": "tilearn gemm-bench step", **line,
            **summarize(rows, since=end - args.seconds / 2)}


def floor(args):
    try:
        import torch
    except ImportError:
        sys.exit("power_floor: PyTorch is not installed (the floor is measured with torch.mm)")
    if not torch.cuda.is_available():
        sys.exit("power_floor: no CUDA device (this measurement needs the GPU machine)")
    from pytorch_baseline import PRESETS  # imports transformers: only where the floor runs
    p = PRESETS[args.preset]
    gemms = [torch_gemms(torch, p, args)]
    print(json.dumps(gemms[-1]), flush=True)
    if args.gemm_bench:
        gemms.append(tilearn_gemms(args))
        print(json.dumps(gemms[-1]), flush=True)

    n = args.memory_mib << 20
    src = torch.randn(n // 2, device="cuda").to(torch.bfloat16)
    dst = torch.empty_like(src)
    copy = lambda: [dst.copy_(src) for _ in range(8)]
    _, times_c, rows_c, start_c = replay_loop(torch, copy, args.memory_seconds)
    copy_ms = statistics.median(times_c[len(times_c) // 2:])
    memory = {"part": "memory", "bytes_per_run": 16 * n, "sustained_ms": copy_ms,
              "tb_per_s": 16 * n / copy_ms / 1e9,
              **summarize(rows_c, since=start_c + args.memory_seconds / 2)}
    print(json.dumps(memory), flush=True)

    if args.attention_ms is None or args.memory_bound_ms is None:
        return
    limit, mem_w = memory.get("power_limit_w"), memory.get("power_w_median")
    if not limit or not mem_w:
        sys.exit("power_floor: no busy nvidia-smi samples, so no power figures for the floor")
    rest = (args.attention_ms + args.memory_bound_ms) * mem_w / limit
    tokens = p["batch"] * p["seq"]
    for g in gemms:
        floor_ms = g["sustained_ms"] + rest
        print(json.dumps({
            "part": "floor", "preset": args.preset, "gemm_source": g["source"],
            "gemm_sustained_ms": g["sustained_ms"], "attention_ms": args.attention_ms,
            "memory_bound_ms": args.memory_bound_ms, "rest_energy_ms": rest,
            "floor_ms": floor_ms, "max_tokens_per_s": tokens / floor_ms * 1e3}), flush=True)


def sample(args):
    if not args.command:
        sys.exit("power_floor sample: name the command after `--`")
    sampler = Sampler()
    rc = subprocess.call(args.command)
    rows = sampler.stop()
    print(json.dumps({"part": "sample", "label": args.label, "rc": rc, **summarize(rows)}),
          flush=True)
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("seconds,sm_mhz,power_w,limit_w,reasons\n")
            for r in rows:
                f.write(f"{r[0]:.2f},{r[1]:.0f},{r[2]:.1f},{r[3]:.0f},{r[4]:#x}\n")
    return rc


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("floor", help="measure the step's products and a copy at the power limit")
    f.add_argument("--preset", default="tinyllama-1.1b", choices=LLAMA_PRESETS)
    f.add_argument("--lce-chunk", type=int, default=2048,
                   help="tokens per lm_head chunk (tilearn's default at these presets)")
    f.add_argument("--seconds", type=float, default=20.0, help="how long the products replay")
    f.add_argument("--memory-seconds", type=float, default=8.0, help="how long the copy runs")
    f.add_argument("--memory-mib", type=int, default=1024, help="bytes of the copy's source")
    f.add_argument("--gemm-bench", metavar="PATH",
                   help="tilearn's gemm-bench binary: also measure the step's products through "
                        "tilearn's own cuBLASLt calls (`gemm-bench step`)")
    f.add_argument("--attention-ms", type=float,
                   help="the step's attention kernels at full clock (step_breakdown.py)")
    f.add_argument("--memory-bound-ms", type=float,
                   help="the step's norms, elementwise, loss and optimizer kernels at full clock")
    s = sub.add_parser("sample", help="run a command while nvidia-smi samples clock and power")
    s.add_argument("--label", default="run")
    s.add_argument("--csv", help="also write every sample here")
    s.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    if args.cmd == "sample":
        if args.command and args.command[0] == "--":
            args.command = args.command[1:]
        sys.exit(sample(args))
    floor(args)


if __name__ == "__main__":
    main()
