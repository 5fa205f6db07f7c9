#!/usr/bin/env python3
"""PyTorch + Hugging Face transformers baseline for `tilearn bench`.

Runs the same presets as `tilearn bench` (LlamaForCausalLM from random weights, SDPA attention,
fused AdamW) in eager mode, with torch.compile, and with Liger-Kernel's Llama patch (`liger`:
fused RMSNorm, RoPE, SwiGLU and linear + cross entropy), and prints one JSON line per run with
the same fields tilearn prints: step time, tokens/s, MFU and peak device memory. Run it on the GPU
machine in the same call as `tilearn bench`.

Weights: `--weights fp32` (default) keeps fp32 master weights under bf16 autocast (or fp16
autocast with torch.amp.GradScaler for `--precision fp16`), as the HF Trainer's `--bf16` does;
`--weights bf16` casts the model to bf16 and steps AdamW on bf16 parameters (no master copy),
the lean setting Liger's own benchmarks use.

    python3 benches/pytorch_baseline.py --preset llama-134m --mode eager compile liger
    python3 benches/pytorch_baseline.py --preset llama-134m --mode liger --weights bf16
"""
import argparse
import contextlib
import json
import statistics
import time

import torch
import transformers
from liger_patch import liger_llama, liger_version
from transformers import (BloomConfig, BloomForCausalLM, LlamaConfig, LlamaForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM)

# Keep in sync with crates/tilearn-llm/src/presets.rs.
PRESETS = {
    "llama-134m": dict(vocab_size=32000, hidden_size=768, num_hidden_layers=12,
                       num_attention_heads=12, num_key_value_heads=12,
                       intermediate_size=2048, batch=16, seq=1024),
    "tinyllama-1.1b": dict(vocab_size=32000, hidden_size=2048, num_hidden_layers=22,
                           num_attention_heads=32, num_key_value_heads=4,
                           intermediate_size=5632, batch=8, seq=2048),
    # Qwen2ForCausalLM (q/k/v biases, tied embeddings, rope_theta 1e6); not in the default list.
    "qwen2-0.5b": dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2,
                       intermediate_size=4864, batch=8, seq=2048),
    # BloomForCausalLM (bigscience/bloom-560m: ALiBi, LayerNorm, GeLU MLP of 4 x hidden,
    # biases, tied embeddings); not in the default list.
    "bloom-560m": dict(vocab_size=250880, hidden_size=1024, num_hidden_layers=24,
                       num_attention_heads=16, num_key_value_heads=16,
                       intermediate_size=4096, batch=8, seq=2048),
}
# What runs without --preset (the Llama presets; the family ones are asked for by name).
DEFAULT_PRESETS = ["llama-134m", "tinyllama-1.1b"]

# Dense bf16 peak used for MFU, the same constant as tilearn bench (H100/H200 SXM datasheet).
PEAK_BF16_FLOPS = 989e12


def flops_per_token(cfg, n_params, seq):
    """6·N for the matmuls of forward+backward plus 6·L·T·(Hq·D) for causal attention scores
    and values (12·L·T·d halved for the causal mask). Same formula as tilearn bench."""
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    attn = 6 * cfg.num_hidden_layers * seq * cfg.num_attention_heads * head_dim
    return 6 * n_params + attn


def llama_config(preset, batch=None, seq=None):
    """The preset's LlamaConfig (untied embeddings, SDPA attention) and its batch and sequence
    length, either overridable. Shared by the single-GPU and the data-parallel baselines."""
    p = dict(PRESETS[preset])
    batch = batch or p.pop("batch")
    seq = seq or p.pop("seq")
    p.pop("batch", None)
    p.pop("seq", None)
    cfg = LlamaConfig(**p, max_position_embeddings=max(seq, 2048), tie_word_embeddings=False,
                      attn_implementation="sdpa")
    return cfg, batch, seq


def qwen2_config(preset, batch=None, seq=None):
    """The preset's Qwen2Config (tied embeddings, rope_theta 1e6, SDPA attention)."""
    p = dict(PRESETS[preset])
    batch = batch or p.pop("batch")
    seq = seq or p.pop("seq")
    p.pop("batch", None)
    p.pop("seq", None)
    rope = dict(rope_type="default", rope_theta=1e6)
    rope_kw = ({"rope_parameters": rope} if hasattr(Qwen2Config(), "rope_parameters")
               else {"rope_theta": 1e6})
    cfg = Qwen2Config(**p, max_position_embeddings=max(seq, 32768), tie_word_embeddings=True,
                      attn_implementation="sdpa", **rope_kw)
    return cfg, batch, seq


def bloom_config(preset, batch=None, seq=None):
    """The preset's BloomConfig (n_layer, n_head; the MLP is 4 x hidden by construction)."""
    p = dict(PRESETS[preset])
    batch = batch or p["batch"]
    seq = seq or p["seq"]
    cfg = BloomConfig(vocab_size=p["vocab_size"], hidden_size=p["hidden_size"],
                      n_layer=p["num_hidden_layers"], n_head=p["num_attention_heads"],
                      layer_norm_epsilon=1e-5, tie_word_embeddings=True)
    return cfg, batch, seq


def run(preset, mode, batch, seq, steps, warmup, precision, checkpointing, weights):
    if preset.startswith("bloom"):
        cfg, batch, seq = bloom_config(preset, batch, seq)
        model_cls = BloomForCausalLM
    elif preset.startswith("qwen2"):
        cfg, batch, seq = qwen2_config(preset, batch, seq)
        model_cls = Qwen2ForCausalLM
    else:
        cfg, batch, seq = llama_config(preset, batch, seq)
        model_cls = LlamaForCausalLM
    torch.manual_seed(0)
    model = model_cls(cfg).cuda()
    if weights == "bf16":
        model = model.to(torch.bfloat16)
    if checkpointing:
        # Non-reentrant checkpointing per decoder layer, as transformers recommends.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n_params = sum(t.numel() for t in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    step_fn = model
    if mode == "compile":
        step_fn = torch.compile(model)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    # fp16 needs loss scaling; the scaler's unscale and inf check are part of the timed step,
    # as they are in tilearn's fp16 step. Disabled, it passes everything through (bf16).
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")

    def step():
        with torch.autocast("cuda", dtype=dtype, enabled=weights == "fp32"):
            out = step_fn(input_ids=ids, labels=ids)
        scaler.scale(out.loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return out.loss

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000.0)
    step_s = statistics.median(times)
    tokens = batch * seq
    tps = tokens / step_s
    mfu = tps * flops_per_token(cfg, n_params, seq) / PEAK_BF16_FLOPS
    return {
        "impl": "pytorch", "preset": preset, "mode": mode, "precision": precision,
        "weights": weights,
        "gradient_checkpointing": checkpointing,
        "batch": batch, "seq": seq,
        "params": n_params, "step_ms": step_s * 1e3, "tokens_per_sec": tps, "mfu": mfu,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "loss": float(loss), "torch": torch.__version__,
        "transformers": transformers.__version__, "gpu": torch.cuda.get_device_name(),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", nargs="+", default=DEFAULT_PRESETS, choices=list(PRESETS))
    ap.add_argument("--mode", nargs="+", default=["eager", "compile"],
                    choices=["eager", "compile", "liger"])
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--precision", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--weights", choices=["fp32", "bf16"], default="fp32",
                    help="fp32 master weights under autocast, or pure bf16 weights")
    args = ap.parse_args()
    if args.weights == "bf16" and args.precision != "bf16":
        ap.error("--weights bf16 needs --precision bf16")
    liger, liger_error = liger_version()
    for preset in args.preset:
        for mode in args.mode:
            if mode == "liger" and liger is None:
                print(json.dumps({"impl": "pytorch", "preset": preset, "mode": mode,
                                  "skipped": liger_error}), flush=True)
                continue
            t0 = time.time()
            with liger_llama() if mode == "liger" else contextlib.nullcontext():
                result = run(preset, mode, args.batch, args.seq, args.steps, args.warmup,
                             args.precision, args.gradient_checkpointing, args.weights)
            result["wall_s"] = time.time() - t0
            if mode == "liger":
                result["liger_kernel"] = liger
            print(json.dumps(result), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
