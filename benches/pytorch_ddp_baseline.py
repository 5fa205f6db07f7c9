#!/usr/bin/env python3
"""Data-parallel PyTorch baselines for `tilearn bench` on N GPUs (torchrun; N=1 gives the
single-GPU figure of the same code path).

Same model and step as benches/pytorch_baseline.py (its PRESETS, config and MFU formula are
imported from there): LlamaForCausalLM from random weights (seed 0 on every rank), bf16 autocast
over fp32 master weights, SDPA attention, fused AdamW lr 1e-4, clip_grad_norm_ 1.0. --batch is per
GPU (default the preset's: llama-134m 16 x 1024, tinyllama-1.1b 8 x 2048). Modes, each a separate
run in this process one after the other (memory freed in between):
  ddp        DistributedDataParallel, bucket_cap_mb 25, gradient_as_bucket_view=True
  ddp-liger  ddp on a model built with Liger-Kernel's apply_liger_kernel_to_llama (rope,
             rms_norm, swiglu, fused_linear_cross_entropy); without liger_kernel it prints a JSON
             line with "error" and goes on
  zero1      ddp + torch.distributed.optim.ZeroRedundancyOptimizer over fused AdamW (optimizer
             state sharded)
  fsdp2      torch.distributed.fsdp.fully_shard on each decoder layer and the root,
             MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): ZeRO-3-like (parameters,
             gradients and optimizer state sharded)
Each rank trains on its own random token batch (seed 1000 + rank, like distinct data shards;
one batch reused every step, as pytorch_baseline.py does). --warmup steps (default 3), then
--steps (default 10) timed steps, each bracketed by torch.cuda.synchronize and
time.perf_counter; step_ms is the median, max over ranks. Rank 0 prints one JSON line per mode:
  {"impl":"pytorch","mode":..,"preset":..,"world":N,"batch_per_gpu":..,"seq":..,"step_ms":..,
   "tokens_per_s": global,"tokens_per_s_per_gpu":..,"mfu": per GPU,"peak_gib": max over ranks of
   max_memory_allocated after warm-up,"final_loss": last step's loss averaged over ranks, ...}

    torchrun --standalone --nproc-per-node 2 benches/pytorch_ddp_baseline.py \\
        --preset llama-134m --mode ddp ddp-liger zero1 fsdp2
    torchrun --standalone --nproc-per-node 1 benches/pytorch_ddp_baseline.py \\
        --preset llama-134m --mode ddp ddp-liger zero1 fsdp2
    torchrun --standalone --nproc-per-node 2 benches/pytorch_ddp_baseline.py \\
        --preset tinyllama-1.1b --mode ddp ddp-liger zero1 fsdp2

--loss-check compares a data-parallel run with a one-GPU run on the same data: one GLOBAL batch
of --global-batch rows (default the preset's batch) is drawn from one seed, whatever N is, rank r
trains on rows r::N, and the same batch is reused for --check-steps (default 20) steps so the loss
falls visibly. Rank 0 prints one JSON line per step with the loss averaged over ranks (equal row
counts, so it is the global batch's mean loss):
    torchrun --standalone --nproc-per-node 1 benches/pytorch_ddp_baseline.py \\
        --preset llama-134m --mode ddp fsdp2 --loss-check
    torchrun --standalone --nproc-per-node 2 benches/pytorch_ddp_baseline.py \\
        --preset llama-134m --mode ddp fsdp2 --loss-check

Smoke test without a GPU (gloo, CPU, a tiny model; the figures mean nothing):
    torchrun --standalone --nproc-per-node 2 benches/pytorch_ddp_baseline.py --cpu --tiny \\
        --batch 2 --seq 64 --steps 2 --warmup 1 --mode ddp zero1 fsdp2
"""
import argparse
import contextlib
import gc
import statistics
import time

import bench_dist
import torch
import torch.distributed as dist
import transformers
from liger_patch import liger_llama, liger_version
from pytorch_baseline import (DEFAULT_PRESETS, PEAK_BF16_FLOPS, PRESETS, flops_per_token,
                              llama_config)
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import LlamaForCausalLM

MODES = ["ddp", "ddp-liger", "zero1", "fsdp2"]
SHARDING = {
    "ddp": "none (replicated; gradients all-reduced)",
    "ddp-liger": "none (replicated; gradients all-reduced)",
    "zero1": "ZeRO-1 (optimizer state sharded)",
    "fsdp2": "ZeRO-3-like (parameters, gradients and optimizer state sharded)",
}
# --tiny shrinks the preset to something a CPU runs in seconds (smoke tests only).
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=512)


def build(cfg, mode, device):
    """The wrapped model and its optimizer for one mode; every rank builds the same weights."""
    torch.manual_seed(0)
    # Built on the device: initialising 1.1e9 parameters on the CPU would take longer than the
    # run. Same seed and same kernels on every rank, so fully_shard (which does not broadcast)
    # starts from identical weights everywhere.
    with device:
        model = LlamaForCausalLM(cfg)
    n_params = sum(t.numel() for t in model.parameters())
    device_ids = [device.index] if device.type == "cuda" else None
    if mode == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        return model, opt, n_params
    model = DDP(model, device_ids=device_ids, bucket_cap_mb=25, gradient_as_bucket_view=True)
    if mode == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                      lr=1e-4, fused=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return model, opt, n_params


def train_step(model, opt, ids, device):
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def run_throughput(cfg, mode, preset, batch, seq, args, rank, world, device):
    model, opt, n_params = build(cfg, mode, device)
    g = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device)
    for _ in range(args.warmup):
        train_step(model, opt, ids, device)
    bench_dist.sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.steps):
        bench_dist.sync(device)
        t0 = time.perf_counter()
        loss = train_step(model, opt, ids, device)
        bench_dist.sync(device)
        times.append(time.perf_counter() - t0)
    step_s = bench_dist.all_reduce_float(statistics.median(times), "max", device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    peak_gib = bench_dist.all_reduce_float(peak / 2**30, "max", device)
    final_loss = bench_dist.all_reduce_float(loss.item(), "mean", device)
    tps_gpu = batch * seq / step_s
    return {
        "impl": "pytorch", "mode": mode, "preset": preset, "world": world,
        "sharding": SHARDING[mode], "batch_per_gpu": batch, "seq": seq, "params": n_params,
        "step_ms": step_s * 1e3, "tokens_per_s": tps_gpu * world,
        "tokens_per_s_per_gpu": tps_gpu,
        "mfu": tps_gpu * flops_per_token(cfg, n_params, seq) / PEAK_BF16_FLOPS,
        "peak_gib": peak_gib, "final_loss": final_loss,
    }


def run_loss_check(cfg, mode, preset, global_batch, seq, args, rank, world, device):
    model, opt, _ = build(cfg, mode, device)
    g = torch.Generator().manual_seed(1234)
    global_ids = torch.randint(0, cfg.vocab_size, (global_batch, seq), generator=g)
    ids = global_ids[rank::world].contiguous().to(device)
    losses = []
    for step in range(args.check_steps):
        loss = bench_dist.all_reduce_float(train_step(model, opt, ids, device).item(), "mean",
                                           device)
        losses.append(loss)
        bench_dist.print0({"impl": "pytorch", "loss_check": True, "mode": mode,
                           "preset": preset, "world": world, "global_batch": global_batch,
                           "seq": seq, "step": step, "loss": loss})
    return {"impl": "pytorch", "loss_check": True, "mode": mode, "preset": preset,
            "world": world, "global_batch": global_batch, "seq": seq, "losses": losses}


def run_mode(mode, preset, args, rank, world, device):
    cfg, batch, seq = llama_config(preset, args.batch, args.seq)
    if args.tiny:
        for key, value in TINY.items():
            setattr(cfg, key, value)
        cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    if args.loss_check:
        global_batch = args.global_batch or PRESETS[preset]["batch"]
        if global_batch % world:
            raise SystemExit(f"--global-batch {global_batch} is not a multiple of the world "
                             f"size {world}: pick one both runs divide")
        return run_loss_check(cfg, mode, preset, global_batch, seq, args, rank, world, device)
    return run_throughput(cfg, mode, preset, batch, seq, args, rank, world, device)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Llama presets only: llama_config builds a Llama of the preset's shape.
    ap.add_argument("--preset", nargs="+", default=DEFAULT_PRESETS, choices=DEFAULT_PRESETS)
    ap.add_argument("--mode", nargs="+", default=MODES, choices=MODES)
    ap.add_argument("--batch", type=int, help="per GPU (default: the preset's)")
    ap.add_argument("--seq", type=int)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--loss-check", action="store_true",
                    help="print the loss per step on a fixed global batch (see the docstring)")
    ap.add_argument("--global-batch", type=int, help="--loss-check's rows over all ranks")
    ap.add_argument("--check-steps", type=int, default=20)
    ap.add_argument("--cpu", action="store_true", help="smoke test: gloo on CPU")
    ap.add_argument("--tiny", action="store_true", help="smoke test: a tiny Llama")
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.check_steps < 1:
        ap.error("need --steps >= 1, --warmup >= 0 and --check-steps >= 1")
    rank, world, device = bench_dist.init(cpu=args.cpu)
    liger, liger_error = liger_version()
    if args.cpu:
        liger, liger_error = None, "Liger-Kernel's Triton kernels need a GPU: no ddp-liger on --cpu"
    for preset in args.preset:
        for mode in args.mode:
            if mode == "ddp-liger" and liger is None:
                bench_dist.print0({"impl": "pytorch", "mode": mode, "preset": preset,
                                   "world": world, "error": liger_error})
                continue
            t0 = time.time()
            with liger_llama() if mode == "ddp-liger" else contextlib.nullcontext():
                result = run_mode(mode, preset, args, rank, world, device)
            result.update(wall_s=time.time() - t0, torch=torch.__version__,
                          transformers=transformers.__version__,
                          liger=liger if mode == "ddp-liger" else None,
                          gpu=torch.cuda.get_device_name(device) if device.type == "cuda"
                          else "cpu")
            bench_dist.print0(result)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            dist.barrier()
    bench_dist.finish()


if __name__ == "__main__":
    main()
