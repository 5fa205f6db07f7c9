#!/usr/bin/env python3
"""Write golden fixtures for tilearn, computed by Hugging Face `transformers`.

For every case below this script builds a tiny random-weight Llama (`LlamaForCausalLM`,
eager attention), saves it as a Hugging Face checkpoint in float32, then upcasts exactly those
float32 weights to float64 and runs forward + backward with labels. It writes, per case, into
`<out>/<case>/`:

    config.json          as written by `save_pretrained` (v5 form on transformers 5.x), except
                         for the case that is rewritten into the transformers v4 form
    model.safetensors    float32 weights, Hugging Face names
    golden.safetensors   input_ids, labels, logits, loss, rope.inv_freq and grad.<param name>
    golden.json          description, config fields, versions, device, loss (for humans)

See README.md beside this file for the exact format and for what the numbers mean.

Usage:
    python make_golden.py [--out DIR] [--device cpu|cuda] [--verify] [--only CASE ...]
"""

import argparse
import json
import math
import os
import platform
import sys

# Deterministic cuBLAS; no network (the GPU machine has none and we never download anything).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import numpy as np  # noqa: E402
import safetensors  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

try:
    transformers.utils.logging.disable_progress_bar()
except Exception:  # pragma: no cover - older versions
    pass

BATCH = 2
IGNORE = -100
HERE = os.path.dirname(os.path.abspath(__file__))

# transformers 5 keeps every RoPE field in `rope_parameters`; transformers 4 has top-level
# `rope_theta` and an optional `rope_scaling` dict.
HF_V5 = hasattr(LlamaConfig(), "rope_parameters")

# ---------------------------------------------------------------------------------------------
# The cases. `rope` is the v5 `rope_parameters` dict (rope_type, rope_theta, scaling fields).
# ---------------------------------------------------------------------------------------------
CASES = [
    dict(
        name="mha_untied",
        description="multi-head attention (4 q heads, 4 kv heads), untied embeddings, plain RoPE",
        seed=1001,
        seq=16,
        config=dict(
            vocab_size=256,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=64,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
        rope=dict(rope_type="default", rope_theta=10000.0),
        v4_config=False,
    ),
    dict(
        name="gqa_tied_llama3",
        description=(
            "grouped-query attention (4 q heads, 2 kv heads), tied embeddings, llama3 RoPE scaling "
            "(factor 8, low 1, high 4, original_max_position_embeddings 64 so that head_dim 16 has "
            "inverse frequencies in all three llama3 bands), vocab 257, rope_theta 500000"
        ),
        seed=2002,
        seq=20,
        config=dict(
            vocab_size=257,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
        rope=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
        v4_config=False,
    ),
    dict(
        name="gqa_linear_bias_v4config",
        description=(
            "grouped-query attention (4 q heads, 1 kv head), explicit head_dim 16 != hidden/heads "
            "(48/4 = 12), attention_bias and mlp_bias with non-zero random biases, linear RoPE "
            "scaling factor 2, untied, vocab 300; config.json rewritten into the transformers v4 "
            "form (top-level rope_theta, rope_scaling {type: linear}, torch_dtype)"
        ),
        seed=3003,
        seq=24,
        config=dict(
            vocab_size=300,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=64,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            attention_bias=True,
            mlp_bias=True,
        ),
        rope=dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
        v4_config=True,
    ),
    dict(
        name="dynamic_rope",
        description=(
            "dynamic NTK RoPE scaling factor 2 with max_position_embeddings 16 and T = 24 > 16, so "
            "transformers recomputes the inverse frequencies for seq_len 24 (checked against an "
            "unscaled model: logits differ); 2 q heads, 2 kv heads, head_dim 16, untied, vocab 200"
        ),
        seed=4004,
        seq=24,
        config=dict(
            vocab_size=200,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=16,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
        rope=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
        v4_config=False,
    ),
]

INITIALIZER_RANGE = 0.2


def ignored_positions(seq):
    """(row, position) pairs whose label is -100: first and last position of row 0, a run of two
    in row 1, and one more in each row."""
    return [(0, 0), (0, 5), (0, seq - 1), (1, 2), (1, 3), (1, 9)]


# ---------------------------------------------------------------------------------------------
def make_config(case, rope):
    kw = dict(case["config"])
    kw["initializer_range"] = INITIALIZER_RANGE
    if HF_V5:
        kw["rope_parameters"] = dict(rope)
    else:
        kw["rope_theta"] = rope["rope_theta"]
        if rope["rope_type"] != "default":
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
            kw["rope_scaling"] = scaling
    cfg = LlamaConfig(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def build_model_f32(case):
    """Random init in float32 on the CPU (so the weights depend only on the seed and the torch /
    transformers versions, not on the device), then non-trivial RMSNorm weights and biases."""
    cfg = make_config(case, case["rope"])
    torch.manual_seed(case["seed"])
    model = LlamaForCausalLM(cfg)
    model.to(torch.float32)
    gen = torch.Generator().manual_seed(case["seed"] + 17)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                # random around 1, so a wrong norm-weight handling shows
                p.copy_(1.0 + 0.25 * torch.randn(p.shape, generator=gen, dtype=torch.float32))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float32))
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32, name
    if case["config"].get("tie_word_embeddings"):
        assert model.lm_head.weight is model.model.embed_tokens.weight, "embeddings not tied"
    model.eval()  # no dropout (attention_dropout is 0 anyway)
    return model


def make_inputs(case):
    seq, vocab = case["seq"], case["config"]["vocab_size"]
    gen = torch.Generator().manual_seed(case["seed"] + 29)
    ids = torch.randint(0, vocab, (BATCH, seq), generator=gen, dtype=torch.int64)
    ids[0, 1] = 0  # smallest id, also a target
    ids[1, 4] = vocab - 1  # largest id, also a target
    labels = ids.clone()
    for b, t in ignored_positions(seq):
        labels[b, t] = IGNORE
    return ids, labels


def forward_backward(model, ids, labels, device):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids.to(device), labels=labels.to(device))
    out.loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, f"no gradient for {name}"
        grads[name] = p.grad.detach().clone()
    return out.logits.detach(), out.loss.detach(), grads


def rotary(model):
    return model.model.rotary_emb


def manual_loss(logits, labels):
    """Causal LM loss as transformers defines it, in float64: targets are labels shifted left by
    one, -100 ignored, mean over the non-ignored targets."""
    logits = logits.double()
    targets = labels[:, 1:].reshape(-1).to(logits.device)
    flat = logits[:, :-1, :].reshape(-1, logits.shape[-1])
    keep = targets != IGNORE
    logp = torch.log_softmax(flat[keep], dim=-1)
    return -logp.gather(1, targets[keep][:, None]).mean()


def to_f32_cpu(t):
    return t.detach().to("cpu", torch.float32).contiguous()


def rewrite_config_v4(path):
    """Turn a v5 config.json (rope_parameters, dtype) into the transformers v4 form."""
    with open(path) as f:
        cfg = json.load(f)
    if "rope_parameters" in cfg:
        rp = dict(cfg.pop("rope_parameters"))
    else:  # written by transformers 4: already v4 form, normalise the scaling dict below
        rp = dict(cfg.pop("rope_scaling") or {})
        rp["rope_theta"] = cfg.pop("rope_theta")
        rp["rope_type"] = rp.pop("rope_type", rp.pop("type", "default"))
    cfg["rope_theta"] = rp.pop("rope_theta")
    rope_type = rp.pop("rope_type")
    rp.pop("type", None)
    # oldest v4 spelling (Llama 2 era): {"type": "linear", "factor": 2.0}
    cfg["rope_scaling"] = None if rope_type == "default" else dict(type=rope_type, **rp)
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    cfg.pop("transformers_version", None)
    cfg["transformers_version"] = "4.46.0"
    with open(path, "w") as f:
        json.dump(dict(sorted(cfg.items())), f, indent=2)
        f.write("\n")
    return cfg


def machine_description(device):
    d = dict(platform=platform.platform(), python=platform.python_version(), device=device)
    if device == "cuda":
        d["gpu"] = torch.cuda.get_device_name(0)
        d["cuda"] = torch.version.cuda
    else:
        d["cpu"] = platform.processor() or platform.machine()
    d["note"] = os.environ.get("GOLDEN_MACHINE_NOTE", "")
    return d


def versions():
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
    }


def rel_err(a, b):
    a = a.detach().double().cpu()
    b = b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


# ---------------------------------------------------------------------------------------------
def make_case(case, out_dir, device):
    name = case["name"]
    case_dir = os.path.join(out_dir, name)
    os.makedirs(case_dir, exist_ok=True)
    for stale in ("config.json", "model.safetensors", "golden.safetensors", "golden.json",
                  "generation_config.json", "model.safetensors.index.json"):
        if os.path.exists(os.path.join(case_dir, stale)):
            os.remove(os.path.join(case_dir, stale))

    model = build_model_f32(case)
    model.save_pretrained(case_dir, safe_serialization=True)
    gen_cfg = os.path.join(case_dir, "generation_config.json")
    if os.path.exists(gen_cfg):
        os.remove(gen_cfg)  # not part of the fixture
    if case["v4_config"]:
        rewrite_config_v4(os.path.join(case_dir, "config.json"))

    # The weights on disk are exactly the f32 weights we compute with (upcast to f64 below).
    on_disk = load_file(os.path.join(case_dir, "model.safetensors"))
    params = dict(model.named_parameters())
    for k, v in on_disk.items():
        assert v.dtype == torch.float32, k
        assert torch.equal(v, params[k].detach()), k
    assert set(on_disk) == set(params), (sorted(on_disk), sorted(params))
    if case["config"].get("tie_word_embeddings"):
        assert "lm_head.weight" not in on_disk and "lm_head.weight" not in params

    ids, labels = make_inputs(case)
    model = model.to(device=device, dtype=torch.float64)
    logits, loss, grads = forward_backward(model, ids, labels, device)
    inv_freq = rotary(model).inv_freq.detach().clone()

    # --- sanity ---------------------------------------------------------------------------
    vocab, seq = case["config"]["vocab_size"], case["seq"]
    assert logits.shape == (BATCH, seq, vocab) and logits.dtype == torch.float64
    assert math.isfinite(loss.item()), loss
    assert torch.isfinite(logits).all()
    # loss semantics: shift inside, mean over non-ignored targets (recomputed here in f64)
    assert abs(manual_loss(logits, labels).item() - loss.item()) < 1e-5 * abs(loss.item()), \
        (manual_loss(logits, labels).item(), loss.item())
    for k, g in grads.items():
        assert torch.isfinite(g).all(), k
        assert g.abs().max().item() > 0, f"zero gradient for {k}"
    # labels at the first position of a row never count (they are never a target): a different
    # first label must give the same loss
    alt = labels.clone()
    alt[1, 0] = IGNORE if alt[1, 0] != IGNORE else 0
    with torch.no_grad():
        alt_loss = model(input_ids=ids.to(device), labels=alt.to(device)).loss.item()
    assert abs(alt_loss - loss.item()) <= 1e-12 * abs(loss.item()), (alt_loss, loss.item())

    checks = {}
    rope = case["rope"]
    base_cfg = make_config(case, dict(rope_type="default", rope_theta=rope["rope_theta"]))
    if rope["rope_type"] != "default":
        # RoPE scaling must actually change the result at this length: same weights, no scaling
        plain = LlamaForCausalLM(base_cfg).to(torch.float64)
        plain.load_state_dict(model.state_dict())
        plain = plain.to(device).eval()
        with torch.no_grad():
            plain_logits = plain(input_ids=ids.to(device)).logits
        diff = float((plain_logits - logits).abs().max())
        assert diff > 1e-3, f"{name}: rope scaling has no effect on the logits ({diff})"
        plain_inv = rotary(plain).inv_freq.detach().double().cpu()
        ratio = (inv_freq.double().cpu() / plain_inv).tolist()
        checks["max_abs_logit_change_vs_unscaled_rope"] = diff
        checks["inv_freq_ratio_vs_unscaled"] = ratio
        if rope["rope_type"] == "linear":
            assert all(abs(r - 1 / rope["factor"]) < 1e-6 for r in ratio), ratio
        if rope["rope_type"] == "dynamic":
            assert all(r < 1 for r in ratio[1:]), ratio
            checks["dynamic_seq_len"] = seq
        if rope["rope_type"] == "llama3":
            kept = sum(abs(r - 1) < 1e-6 for r in ratio)
            divided = sum(abs(r - 1 / rope["factor"]) < 1e-6 for r in ratio)
            smoothed = len(ratio) - kept - divided
            assert kept and divided and smoothed, ratio
            checks["llama3_bands"] = dict(unchanged=kept, smoothed=smoothed, divided=divided)
        del plain

    # --- write ----------------------------------------------------------------------------
    tensors = {
        "input_ids": ids.contiguous(),
        "labels": labels.contiguous(),
        "logits": to_f32_cpu(logits),
        "loss": to_f32_cpu(loss.reshape(1)),
        "rope.inv_freq": to_f32_cpu(inv_freq),
    }
    for k, g in grads.items():
        tensors["grad." + k] = to_f32_cpu(g)
    golden_path = os.path.join(case_dir, "golden.safetensors")
    # a single metadata key: safetensors writes a multi-key metadata map in random order
    save_file(tensors, golden_path, metadata={"format": "pt"})

    num_targets = int((labels[:, 1:] != IGNORE).sum())
    with open(os.path.join(case_dir, "config.json")) as f:
        written_cfg = json.load(f)
    info = {
        "case": name,
        "description": case["description"],
        "seed": case["seed"],
        "batch": BATCH,
        "seq": seq,
        "initializer_range": INITIALIZER_RANGE,
        "weights": "random init (seeded, CPU, float32); RMSNorm weights 1 + 0.25*N(0,1); "
                   "biases 0.1*N(0,1); saved float32, computed in float64 from those values",
        "config_fields_set": dict(case["config"], rope=case["rope"],
                                  attn_implementation="eager"),
        "config_json_form": "v4" if case["v4_config"] else ("v5" if HF_V5 else "v4"),
        "config_json": written_cfg,
        "ignored_label_positions": [list(p) for p in ignored_positions(seq)],
        "num_loss_targets": num_targets,
        "loss": float(loss.item()),
        "loss_definition": "transformers ForCausalLMLoss: targets = labels[:, 1:] (the model "
                           "shifts), -100 ignored, mean over the non-ignored targets",
        "compute_dtype": "float64 (transformers keeps some internals in float32: RMSNorm "
                         "normalisation, attention softmax, RoPE angles, the loss)",
        "checks": checks,
        "tensors": {k: {"dtype": str(v.dtype).replace("torch.", ""), "shape": list(v.shape)}
                    for k, v in tensors.items()},
        "versions": versions(),
        "generated_on": machine_description(device),
    }
    with open(os.path.join(case_dir, "golden.json"), "w") as f:
        json.dump(info, f, indent=2)
        f.write("\n")

    sizes = {fn: os.path.getsize(os.path.join(case_dir, fn)) for fn in sorted(os.listdir(case_dir))}
    total = sum(sizes.values())
    assert total < 1_000_000, sizes
    print(f"{name}: loss {loss.item():.9f} targets {num_targets} files "
          + " ".join(f"{k}={v}" for k, v in sizes.items()) + f" total={total}", flush=True)
    return case_dir


def verify_case(case, out_dir, device):
    """Independent round trip: from_pretrained (f64, eager) on the written folder must reproduce
    the stored logits, loss and gradients."""
    case_dir = os.path.join(out_dir, case["name"])
    gold = load_file(os.path.join(case_dir, "golden.safetensors"))
    dtype_kw = {"dtype": torch.float64} if HF_V5 else {"torch_dtype": torch.float64}
    model = LlamaForCausalLM.from_pretrained(case_dir, attn_implementation="eager", **dtype_kw)
    model = model.to(device).eval()
    assert next(model.parameters()).dtype == torch.float64
    ids, labels = gold["input_ids"], gold["labels"]
    logits, loss, grads = forward_backward(model, ids, labels, device)
    e_logits = rel_err(logits, gold["logits"])
    e_loss = abs(loss.item() - gold["loss"].item()) / abs(gold["loss"].item())
    e_grad = max(rel_err(g, gold["grad." + k]) for k, g in grads.items())
    assert set("grad." + k for k in grads) == {k for k in gold if k.startswith("grad.")}
    e_inv = rel_err(rotary(model).inv_freq, gold["rope.inv_freq"])
    ok = e_logits < 1e-6 and e_loss < 1e-6 and e_grad < 1e-5 and e_inv < 1e-6
    print(f"verify {case['name']}: rel err logits {e_logits:.2e} loss {e_loss:.2e} "
          f"grads {e_grad:.2e} inv_freq {e_inv:.2e} -> {'ok' if ok else 'FAILED'}", flush=True)
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=HERE, help="output folder (default: this script's folder)")
    ap.add_argument("--device", choices=["cpu", "cuda"],
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--verify", action="store_true",
                    help="after writing, reload each case with from_pretrained in f64 and check "
                         "that it reproduces the stored logits, loss and gradients")
    ap.add_argument("--verify-only", action="store_true",
                    help="only run the --verify check on existing fixtures")
    ap.add_argument("--only", nargs="*", help="case names to (re)make (default: all)")
    args = ap.parse_args()

    if args.device == "cuda":
        assert torch.cuda.is_available(), "--device cuda but no CUDA device"
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    # One CPU thread: multi-threaded CPU reductions can change the last bits from run to run.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    cases = [c for c in CASES if not args.only or c["name"] in args.only]
    if args.only:
        unknown = set(args.only) - {c["name"] for c in CASES}
        assert not unknown, f"unknown cases {unknown}"
    print(f"torch {torch.__version__} transformers {transformers.__version__} device {args.device} "
          f"out {os.path.abspath(args.out)}", flush=True)
    if not args.verify_only:
        for case in cases:
            make_case(case, args.out, args.device)
    if args.verify or args.verify_only:
        results = [verify_case(case, args.out, args.device) for case in cases]
        if not all(results):
            sys.exit(1)


if __name__ == "__main__":
    main()
