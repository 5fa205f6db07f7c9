#!/usr/bin/env python3
"""NCCL collective bandwidth through torch.distributed, reported as nccl-tests does.

Times all_reduce (in place on S bytes), reduce_scatter_tensor (input S bytes, output S/N) and
all_gather_into_tensor (input S/N, output S bytes) on bf16 tensors, S = --min-bytes doubling to
--max-bytes (default 1 MiB .. 1 GiB). For each (op, S): --warmup calls, torch.cuda.synchronize and
a barrier, then --iters back-to-back calls between two CUDA events on the current stream (a
blocking collective makes the current stream wait for NCCL's, so the end event marks the last
call's completion); time = elapsed / iters, the max over ranks (as nccl-tests reports it).
  algbw = S / time (GB/s, 1e9 bytes)
  busbw = algbw * 2(N-1)/N for all_reduce, algbw * (N-1)/N for reduce_scatter and all_gather
S is always the full buffer (all_reduce's tensor, reduce_scatter's input, all_gather's output),
rounded down to a multiple of N elements. NCCL_NVLS_ENABLE is forced to 0 (see bench_dist.py).
Rank 0 prints one JSON line per (op, S):
  {"impl":"torch","op":..,"bytes":S,"world":N,"time_us":..,"algbw_gbs":..,"busbw_gbs":..}

    torchrun --standalone --nproc-per-node 2 benches/pytorch_comm_baseline.py
    torchrun --standalone --nproc-per-node 2 benches/pytorch_comm_baseline.py \\
        --ops all_reduce reduce_scatter all_gather --min-bytes 1048576 --max-bytes 1073741824 \\
        --iters 20 --warmup 5

Smoke test without a GPU (gloo, CPU tensors, wall-clock timing; the figures mean nothing):
    torchrun --standalone --nproc-per-node 2 benches/pytorch_comm_baseline.py --cpu \\
        --max-bytes 4194304 --iters 2 --warmup 1
"""
import argparse
import time

import bench_dist
import torch
import torch.distributed as dist

DTYPE = torch.bfloat16


def bus_factor(op, world):
    """nccl-tests' busbw/algbw ratio: the fraction of the buffer each rank's link must carry."""
    return (2 if op == "all_reduce" else 1) * (world - 1) / world


def make_call(op, elems, world, device):
    """The collective on freshly allocated buffers of `elems` total elements (S bytes)."""
    if op == "all_reduce":
        buf = torch.randn(elems, dtype=DTYPE, device=device)
        return lambda: dist.all_reduce(buf)
    full = torch.randn(elems, dtype=DTYPE, device=device)
    shard = torch.empty(elems // world, dtype=DTYPE, device=device)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(shard, full)
    return lambda: dist.all_gather_into_tensor(full, shard)


def time_per_call_s(call, iters, device):
    """Seconds per call of `iters` back-to-back calls: CUDA events on the current stream, or
    the wall clock on CPU (gloo's collectives are synchronous there)."""
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - t0) / iters


def sizes(min_bytes, max_bytes):
    s = min_bytes
    while s <= max_bytes:
        yield s
        s *= 2


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", nargs="+", default=["all_reduce", "reduce_scatter", "all_gather"],
                    choices=["all_reduce", "reduce_scatter", "all_gather"])
    ap.add_argument("--min-bytes", type=int, default=1 << 20)
    ap.add_argument("--max-bytes", type=int, default=1 << 30)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--cpu", action="store_true",
                    help="smoke test: gloo on CPU tensors, wall-clock timing")
    args = ap.parse_args()
    if args.min_bytes <= 0 or args.max_bytes < args.min_bytes:
        ap.error("need 0 < --min-bytes <= --max-bytes")
    if args.iters < 1 or args.warmup < 0:
        ap.error("need --iters >= 1 and --warmup >= 0")
    _, world, device = bench_dist.init(cpu=args.cpu)
    elem_size = torch.finfo(DTYPE).bits // 8
    for op in args.ops:
        for s in sizes(args.min_bytes, args.max_bytes):
            elems = s // elem_size // world * world
            if elems == 0:
                continue
            call = make_call(op, elems, world, device)
            for _ in range(args.warmup):
                call()
            bench_dist.sync(device)
            dist.barrier()
            t = bench_dist.all_reduce_float(time_per_call_s(call, args.iters, device), "max",
                                            device)
            nbytes = elems * elem_size
            algbw = nbytes / t / 1e9
            bench_dist.print0({
                "impl": "torch", "op": op, "bytes": nbytes, "world": world,
                "dtype": "bf16", "time_us": t * 1e6, "algbw_gbs": algbw,
                "busbw_gbs": algbw * bus_factor(op, world),
            })
            del call
            if device.type == "cuda":
                torch.cuda.empty_cache()
    bench_dist.finish()


if __name__ == "__main__":
    main()
