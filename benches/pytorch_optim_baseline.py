#!/usr/bin/env python3
"""PyTorch baseline for the fused-optimizer bench (crates/tilearn-optim: optim-bench).

Times torch.optim.AdamW(fused=True), torch.optim.Adam(fused=True) and torch.optim.SGD
(momentum 0.9, foreach=True) over the same parameter count as optim-bench (default 1.1e9),
split into ~200 tensors like a real model (100 layers: one large matrix + one 4096-element norm
weight each; two parameter groups, weight decay on the matrices only). Prints one JSON line per
optimizer: {optimizer, params, bytes_per_param, ms_median, gb_per_s, copy_gb_per_s,
fraction_of_copy}, the same fields as optim-bench.

Layout and bytes actually moved per parameter (honest count):
  torch's fused AdamW/Adam need grads of the params' dtype, so params and grads are fp32 and
  there is no bf16 working copy:
    AdamW / Adam (fused): read p, g, m, v (4 x 4) + write p, m, v (3 x 4)        = 28 bytes
  (optim-bench's AdamW also moves 28: read p32, m, v, g16 + write p32, m, v, p16.)
    SGD momentum (foreach, fp32): torch's foreach path runs separate kernels: buf = buf *
    momentum + g (read buf, g; write buf = 12), p = p - lr * buf (read p, buf; write p = 12),
    plus the weight-decay add when wd != 0 (read g, p; write g = 12): we count the minimum the
    algorithm needs, read p, g, buf + write p, buf = 20 bytes (optim-bench's SGD also moves 20
    with bf16 grads and the bf16 copy), so torch's figure is an upper bound on its useful
    bandwidth.
Copy bandwidth: a 4 GiB device-to-device tensor copy (dst.copy_(src)), read + write counted.
Timing: torch.cuda.Event around each step after warm-up, median of --steps (>= 20) steps;
gradients are random (torch.randn), never zeros.

Usage: python3 benches/pytorch_optim_baseline.py [--params 1.1e9] [--steps 30]
"""

import argparse
import json
import statistics
import sys

LAYERS = 100
NORM_LEN = 4096


def median_ms(torch, fn, warmup, steps):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_gb_per_s(torch, steps):
    n = (4 << 30) // 4
    src = torch.rand(n, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    ms = median_ms(torch, lambda: dst.copy_(src), 3, steps)
    return 2 * n * 4 / (ms * 1e-3) / 1e9


def make_params(torch, n):
    layer = n // LAYERS
    decay, no_decay = [], []
    for l in range(LAYERS):
        start = l * layer
        end = n if l + 1 == LAYERS else start + layer
        big = end - start - NORM_LEN
        decay.append(torch.nn.Parameter(torch.rand(big, device="cuda") * 2 - 1))
        no_decay.append(torch.nn.Parameter(torch.rand(NORM_LEN, device="cuda") * 2 - 1))
    for p in decay + no_decay:
        p.grad = torch.randn_like(p)
    return decay, no_decay


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=1.1e9)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    if args.steps < 20:
        sys.exit("--steps must be at least 20")
    try:
        import torch
    except ImportError as e:
        sys.exit(f"skipped: torch is not installed: {e}")
    if not torch.cuda.is_available():
        sys.exit("skipped: torch sees no CUDA device")
    n = int(args.params)
    copy = copy_gb_per_s(torch, args.steps)
    print(f"pytorch baseline: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"copy {copy:.1f} GB/s", file=sys.stderr)
    decay, no_decay = make_params(torch, n)
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    cases = [
        ("torch_adamw_fused", 28, lambda: torch.optim.AdamW(groups, lr=1e-4, fused=True)),
        ("torch_adam_fused", 28, lambda: torch.optim.Adam(groups, lr=1e-4, fused=True)),
        ("torch_sgd_foreach", 20,
         lambda: torch.optim.SGD(groups, lr=1e-4, momentum=0.9, foreach=True)),
    ]
    for name, bytes_per_param, make in cases:
        opt = make()
        ms = median_ms(torch, opt.step, args.warmup, args.steps)
        gbs = n * bytes_per_param / (ms * 1e-3) / 1e9
        print(json.dumps({
            "optimizer": name,
            "params": n,
            "bytes_per_param": bytes_per_param,
            "ms_median": round(ms, 4),
            "gb_per_s": round(gbs, 1),
            "copy_gb_per_s": round(copy, 1),
            "fraction_of_copy": round(gbs / copy, 4),
        }), flush=True)
        # Free the optimizer state before the next one (3 x 4.4 GB for Adam).
        del opt
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
