"""PyTorch's scaled_dot_product_attention, causal with grouped-query heads, forward and backward,
at the shapes of `gemm-bench attention` (llama-134m 16 x 1024 x 12/12, TinyLlama 8 x 2048 x 32/4,
and one 16 K-token sequence with TinyLlama's heads, head_dim 64; Llama-2-7B's 1 x 4096 x 32/32 at
head_dim 128; bf16), per SDPA backend (cuDNN
and FlashAttention-2 by default; the memory-efficient one refuses grouped-query heads), timed as
gemm-bench times tilearn's kernels: one warm-up forward + backward, then 10 timed forwards and 10
timed backwards (CUDA events), medians. One JSON line per (shape, backend, layout) with the same
fields and the same FLOP count (forward 2·2·B·Hq·T²·D/2, backward 2.5x that), so the two
outputs sit side by side in one table.

Layout (`--layouts`): `bthd`, q, k, v as [B, H, T, D] views of [B, T, H, D] tensors (the
projections' layout, what transformers passes; tilearn's kernels read that layout too), and
`bhtd`, contiguous [B, H, T, D] tensors (what SDPA's kernels prefer). enable_gqa=True (no
repeated k / v). A backend that refuses a shape prints an "error" field instead of times.
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [("llama-134m", 16, 1024, 12, 12, 64), ("tinyllama", 8, 2048, 32, 4, 64),
          ("long-16k", 1, 16384, 32, 4, 64), ("llama2-7b", 1, 4096, 32, 32, 128)]
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash2": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}
RUNS = 10


def timed(fn):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def bench(b, t, hq, hkv, d, backend, layout):
    g = torch.Generator(device="cuda").manual_seed(0)
    if layout == "bthd":  # [B, H, T, D] views of [B, T, H, D]
        mk = lambda h: (torch.rand(b, t, h, d, device="cuda", generator=g) * 2 - 1).to(
            torch.bfloat16).transpose(1, 2)
    else:
        mk = lambda h: (torch.rand(b, h, t, d, device="cuda", generator=g) * 2 - 1).to(
            torch.bfloat16)
    q, k, v = (mk(hq).requires_grad_(), mk(hkv).requires_grad_(), mk(hkv).requires_grad_())
    dout = mk(hq)
    run = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with sdpa_kernel([BACKENDS[backend]]):
        out = run()
        out.backward(dout)
        torch.cuda.synchronize()
        fwd = [timed(run) for _ in range(RUNS)]
        outs = [run() for _ in range(RUNS)]
        bwd = [timed(lambda o=o: o.backward(dout)) for o in outs]
    return statistics.median(fwd), statistics.median(bwd)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", nargs="+", default=["cudnn", "flash2"], choices=list(BACKENDS))
    ap.add_argument("--layouts", nargs="+", default=["bthd", "bhtd"], choices=["bthd", "bhtd"])
    args = ap.parse_args()
    for name, b, t, hq, hkv, d in SHAPES:
        fwd_flops = 4.0 * b * hq * d * t * (t + 1) / 2
        for backend, layout in [(k, l) for k in args.backends for l in args.layouts]:
            row = {"bench": "attention", "shape": name, "batch": b, "seq": t, "q_heads": hq,
                   "kv_heads": hkv, "head_dim": d, "dtype": "bf16", "path": "torch-sdpa",
                   "kernels": backend, "layout": layout, "torch": torch.__version__}
            try:
                fwd, bwd = bench(b, t, hq, hkv, d, backend, layout)
                row.update(fwd_ms=round(fwd, 4), fwd_tflops=round(fwd_flops / fwd / 1e9, 1),
                           bwd_ms=round(bwd, 4), bwd_tflops=round(2.5 * fwd_flops / bwd / 1e9, 1))
            except RuntimeError as e:
                row["error"] = str(e).split("\n")[0][:200]
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
