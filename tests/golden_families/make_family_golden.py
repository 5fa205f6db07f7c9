#!/usr/bin/env python3
"""Golden fixtures for tilearn's model families beyond Llama: Qwen2, Mistral, Baichuan-7B,
Baichuan2-7B, Baichuan-13B and Baichuan2-13B, small random-weight configs, in the format of tests/golden/ (see
tests/golden/README.md; this script reuses make_golden.py's inputs, labels and loss checks).

* Qwen2 and Mistral come from transformers' own `Qwen2ForCausalLM` / `MistralForCausalLM`
  (eager attention).
* Baichuan ships its modeling code with its checkpoints (`trust_remote_code`), which tilearn
  never executes. `BaichuanReference` below is a PyTorch model written from the published
  architecture of Baichuan-7B (`BaiChuanForCausalLM`) and Baichuan2-7B (`BaichuanForCausalLM`):
  RMSNorm, RoPE (base 10000, rotate_half), q/k/v fused in `W_pack` ([Q; K; V] along the rows),
  SwiGLU MLP, untied lm_head; Baichuan2 adds NormHead (`F.normalize(lm_head.weight)` before the
  product, which its code does at every training forward) and a z-loss whose weight is 0 in
  the published 7B config. The 13B models (Baichuan-13B, Baichuan2-13B) replace RoPE by ALiBi:
  `_get_interleave` slopes, the bias `slope * key_position` added to the scaled scores under
  the causal mask (`_gen_alibi_mask`), and Baichuan2-13B adds `z_loss_weight *
  mean(max(shift_logits)^2)` to the loss. A reduced-width 13B model is one only by
  TILEARN_LLM_BAICHUAN_13B (1 or 2), which this script reads as tilearn does.

Usage:
    python make_family_golden.py [--out DIR] [--only CASE ...] [--verify]
    python make_family_golden.py --check-saved DIR --expect FILE
        (load a checkpoint tilearn saved with the family's reference and check that it
         reproduces the logits in FILE, a safetensors with input_ids and logits; exit 0 if so)
"""

import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "golden"))

import make_golden as mg  # noqa: E402  (sets the offline / determinism environment)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from torch import nn  # noqa: E402
from transformers import (  # noqa: E402
    BloomConfig,
    BloomForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

INITIALIZER_RANGE = mg.INITIALIZER_RANGE

CASES = [
    dict(
        name="qwen2_tied",
        family="qwen2",
        description="Qwen2: q/k/v biases (o_proj none), GQA 4/2 (head_dim 4), tied embeddings, rope_theta 1e6",
        seed=5005,
        seq=16,
        config=dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                    rms_norm_eps=1e-6, tie_word_embeddings=True),
        rope_theta=1000000.0,
        v4_config=False,
    ),
    dict(
        name="qwen2_sliding_v4config",
        family="qwen2",
        description="Qwen2 with use_sliding_window, sliding_window 6, max_window_layers 1 (layer 0 "
                    "full, layer 1 sliding), T 20, untied; config.json in the transformers v4 "
                    "form without layer_types",
        seed=6006,
        seq=20,
        config=dict(vocab_size=72, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                    rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=True,
                    sliding_window=6, max_window_layers=1),
        rope_theta=10000.0,
        v4_config=True,
    ),
    dict(
        name="mistral_sliding",
        family="mistral",
        description="Mistral: sliding_window 5 on every layer with T 16, GQA 2/1, explicit "
                    "head_dim 12 (hidden 16 / 2 heads = 8), untied",
        seed=7007,
        seq=16,
        config=dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=12,
                    max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
                    sliding_window=5),
        rope_theta=10000.0,
        v4_config=False,
    ),
    dict(
        name="mistral_v4config",
        family="mistral",
        description="Mistral with sliding_window 7 and T 12, MHA 2/2; config.json in the "
                    "transformers v4 form",
        seed=8008,
        seq=12,
        config=dict(vocab_size=60, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                    rms_norm_eps=1e-6, tie_word_embeddings=False, sliding_window=7),
        rope_theta=10000.0,
        v4_config=True,
    ),
    dict(
        name="baichuan_7b",
        family="baichuan",
        architecture="BaiChuanForCausalLM",
        description="Baichuan-7B architecture (BaiChuanForCausalLM): W_pack, RoPE base 10000, "
                    "untied lm_head, MHA 2 heads",
        seed=9009,
        seq=16,
        config=dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                    num_attention_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6),
        v4_config=True,
    ),
    dict(
        name="baichuan2_7b",
        family="baichuan",
        architecture="BaichuanForCausalLM",
        description="Baichuan2-7B architecture (BaichuanForCausalLM): W_pack, RoPE base 10000, "
                    "NormHead (lm_head rows L2-normalised before the product), z_loss_weight 0, "
                    "MHA 2 heads",
        seed=10010,
        seq=20,
        config=dict(vocab_size=80, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                    num_attention_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                    z_loss_weight=0.0),
        v4_config=True,
    ),
    dict(
        name="baichuan_13b",
        family="baichuan",
        architecture="BaichuanForCausalLM",
        generation_13b=1,
        description="Baichuan-13B architecture (BaichuanForCausalLM, TILEARN_LLM_BAICHUAN_13B=1): "
                    "W_pack, ALiBi with 6 heads (not a power of two: the interleaved slopes), no "
                    "RoPE, untied lm_head without NormHead; model_max_length as its config",
        seed=11011,
        seq=16,
        config=dict(vocab_size=40, hidden_size=24, intermediate_size=16, num_hidden_layers=2,
                    num_attention_heads=6, model_max_length=64, rms_norm_eps=1e-6),
        v4_config=True,
    ),
    dict(
        name="baichuan2_13b",
        family="baichuan",
        architecture="BaichuanForCausalLM",
        generation_13b=2,
        description="Baichuan2-13B architecture (BaichuanForCausalLM, TILEARN_LLM_BAICHUAN_13B=2): "
                    "W_pack, ALiBi with 4 heads, NormHead, z_loss_weight 0.05; every label a "
                    "target (Baichuan2 averages the z-loss over all shifted positions, tilearn "
                    "over the targets: the same value when none is -100)",
        seed=12012,
        seq=20,
        all_labels=True,
        config=dict(vocab_size=80, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                    num_attention_heads=4, model_max_length=64, rms_norm_eps=1e-6,
                    z_loss_weight=0.05),
        v4_config=True,
    ),
]

CASES += [
    dict(
        name="bloom_tied",
        family="bloom",
        description="Bloom (transformers' BloomForCausalLM): ALiBi with 4 heads, LayerNorm with "
                    "bias (word_embeddings_layernorm too), tanh-GeLU MLP, biases everywhere, "
                    "query_key_value interleaved per head, tied lm_head; transformer. prefix",
        seed=13013,
        seq=16,
        config=dict(vocab_size=64, hidden_size=16, n_layer=2, n_head=4,
                    layer_norm_epsilon=1e-5),
        strip_prefix=False,
        v4_config=False,
    ),
    dict(
        name="bloom_v4config",
        family="bloom",
        description="Bloom with 3 heads (ALiBi slopes of a non-power of two), T 20, config.json "
                    "in the transformers v4 form (torch_dtype), tensors saved without the "
                    "transformer. prefix (as a bare BloomModel checkpoint)",
        seed=14014,
        seq=20,
        config=dict(vocab_size=56, hidden_size=12, n_layer=2, n_head=3,
                    layer_norm_epsilon=1e-5),
        strip_prefix=True,
        v4_config=True,
    ),
]

BAICHUAN_13B_ENV = "TILEARN_LLM_BAICHUAN_13B"
BAICHUAN_13B_HIDDEN = 5120
BAICHUAN2_VOCAB = 125696


# ---------------------------------------------------------------------------------------------
# Baichuan reference (written from the published architecture; no remote code).
# ---------------------------------------------------------------------------------------------
class BaichuanRMSNorm(nn.Module):
    def __init__(self, hidden, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def get_interleave(n):
    """Baichuan-13B's ALiBi slopes (`_get_interleave` of its modeling code)."""
    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]
    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + get_interleave(2 * closest)[0::2][: n - closest]


def alibi_mask(heads, t, dtype):
    """`_gen_alibi_mask`: slope * key_position on and below the diagonal, -inf above."""
    slopes = torch.tensor(get_interleave(heads), dtype=torch.float64)
    bias = slopes[:, None, None] * torch.arange(t, dtype=torch.float64)[None, None, :]
    causal = torch.triu(torch.full((t, t), float("-inf"), dtype=torch.float64), 1)
    return (causal[None] + bias).to(dtype)


class BaichuanLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        c, h = cfg["hidden_size"], cfg["num_attention_heads"]
        self.heads, self.head_dim = h, c // h
        self.self_attn = nn.Module()
        self.self_attn.W_pack = nn.Linear(c, 3 * c, bias=False)
        self.self_attn.o_proj = nn.Linear(c, c, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(c, cfg["intermediate_size"], bias=False)
        self.mlp.up_proj = nn.Linear(c, cfg["intermediate_size"], bias=False)
        self.mlp.down_proj = nn.Linear(cfg["intermediate_size"], c, bias=False)
        self.input_layernorm = BaichuanRMSNorm(c, cfg["rms_norm_eps"])
        self.post_attention_layernorm = BaichuanRMSNorm(c, cfg["rms_norm_eps"])

    def forward(self, x, cos, sin, alibi):
        b, t, c = x.shape
        n = self.input_layernorm(x)
        proj = self.self_attn.W_pack(n)
        # Baichuan: proj.unflatten(-1, (3, hidden)): q, k, v are consecutive row blocks.
        q, k, v = proj.unflatten(-1, (3, c)).unbind(-2)
        shape = (b, t, self.heads, self.head_dim)
        q, k, v = (z.reshape(shape).transpose(1, 2) for z in (q, k, v))
        if alibi is None:
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        if alibi is None:
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        else:
            # Baichuan-13B: scores + alibi mask, clamped at the dtype's minimum.
            scores = torch.max(scores + alibi, torch.tensor(torch.finfo(scores.dtype).min))
        att = torch.softmax(scores, dim=-1) @ v
        h = x + self.self_attn.o_proj(att.transpose(1, 2).reshape(b, t, c))
        m = self.post_attention_layernorm(h)
        return h + self.mlp.down_proj(F.silu(self.mlp.gate_proj(m)) * self.mlp.up_proj(m))


class BaichuanReference(nn.Module):
    """Baichuan-7B (`norm_head=False`), Baichuan2-7B (`norm_head=True`), and with `alibi` their
    13B counterparts Baichuan-13B and Baichuan2-13B."""

    def __init__(self, cfg, norm_head, alibi=False):
        super().__init__()
        self.cfg, self.norm_head, self.alibi = cfg, norm_head, alibi
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.model.layers = nn.ModuleList(BaichuanLayer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.model.norm = BaichuanRMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)

    def init_weights(self, seed):
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.25 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(INITIALIZER_RANGE * torch.randn(p.shape, generator=gen))

    def rope(self, t, dtype):
        d = self.cfg["hidden_size"] // self.cfg["num_attention_heads"]
        inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        freqs = torch.outer(torch.arange(t).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype), inv_freq

    def forward(self, input_ids, labels=None):
        x = self.model.embed_tokens(input_ids)
        t = input_ids.shape[1]
        cos, sin, _ = self.rope(t, x.dtype)
        mask = alibi_mask(self.cfg["num_attention_heads"], t, x.dtype) if self.alibi else None
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask)
        x = self.model.norm(x)
        head = F.normalize(self.lm_head.weight) if self.norm_head else self.lm_head.weight
        logits = F.linear(x, head)
        loss = None
        if labels is not None:
            shift_logits = logits[:, :-1, :].reshape(-1, logits.shape[-1])
            shift_labels = labels[:, 1:].reshape(-1)
            loss = F.cross_entropy(shift_logits, shift_labels, ignore_index=mg.IGNORE)
            z = self.cfg.get("z_loss_weight", 0.0)
            if z:
                loss = loss + z * (shift_logits.max(-1).values ** 2).mean()
        return type("Out", (), dict(logits=logits, loss=loss))()


def baichuan_config_json(case):
    arch = case["architecture"]
    cfg_cls = "BaiChuanConfig" if arch == "BaiChuanForCausalLM" else "BaichuanConfig"
    return dict(sorted(dict(
        case["config"],
        architectures=[arch],
        auto_map={"AutoConfig": f"configuration_baichuan.{cfg_cls}",
                  "AutoModelForCausalLM": f"modeling_baichuan.{arch}"},
        model_type="baichuan",
        hidden_act="silu",
        initializer_range=INITIALIZER_RANGE,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        torch_dtype="float32",
        transformers_version="4.29.2",
        use_cache=True,
    ).items()))


def baichuan_parts(cfg, generation_13b=None):
    """(norm_head, alibi) of a Baichuan config, by tilearn's rule: BaiChuanForCausalLM is
    Baichuan-7B; BaichuanForCausalLM is a 13B model when TILEARN_LLM_BAICHUAN_13B (or
    `generation_13b`) names its generation or the hidden size is 5120 (generation 2 when the
    vocabulary is Baichuan2's), else Baichuan2-7B."""
    if cfg["architectures"][0] == "BaiChuanForCausalLM":
        return False, False
    gen = generation_13b or os.environ.get(BAICHUAN_13B_ENV)
    if gen is None and cfg["hidden_size"] == BAICHUAN_13B_HIDDEN:
        gen = 2 if cfg["vocab_size"] == BAICHUAN2_VOCAB else 1
    if gen is None:
        return True, False
    return int(gen) == 2, True


def load_baichuan(case_dir, dtype=torch.float64, generation_13b=None):
    with open(os.path.join(case_dir, "config.json")) as f:
        cfg = json.load(f)
    norm_head, alibi = baichuan_parts(cfg, generation_13b)
    model = BaichuanReference(cfg, norm_head, alibi)
    state = load_file(os.path.join(case_dir, "model.safetensors"))
    model.load_state_dict(state, strict=True)
    return model.to(dtype).eval()


# ---------------------------------------------------------------------------------------------
def bloom_model(case):
    cfg = BloomConfig(**case["config"], initializer_range=INITIALIZER_RANGE,
                      tie_word_embeddings=True, apply_residual_connection_post_layernorm=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(case["seed"])
    model = BloomForCausalLM(cfg).to(torch.float32)
    gen = torch.Generator().manual_seed(case["seed"] + 17)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and name.endswith(".weight"):
                p.copy_(1.0 + 0.25 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def hf_model(case):
    if case["family"] == "bloom":
        return bloom_model(case)
    kw = dict(case["config"], initializer_range=INITIALIZER_RANGE)
    if mg.HF_V5:
        kw["rope_parameters"] = dict(rope_type="default", rope_theta=case["rope_theta"])
    else:
        kw["rope_theta"] = case["rope_theta"]
    cls_cfg, cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM),
                    "mistral": (MistralConfig, MistralForCausalLM)}[case["family"]]
    cfg = cls_cfg(**kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(case["seed"])
    model = cls(cfg).to(torch.float32)
    gen = torch.Generator().manual_seed(case["seed"] + 17)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.25 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def rewrite_v4(path, family):
    """The transformers v4 form of a v5 config.json: top-level rope_theta, torch_dtype, and for
    Qwen2 no layer_types (transformers 4 derives them from max_window_layers)."""
    with open(path) as f:
        cfg = json.load(f)
    rp = cfg.pop("rope_parameters", None) or {}
    cfg["rope_theta"] = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    cfg["rope_scaling"] = None
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    if family == "qwen2":
        cfg.pop("layer_types", None)
    if family == "bloom":
        cfg.pop("rope_theta", None)
        cfg.pop("rope_scaling", None)
    cfg["transformers_version"] = "4.46.0"
    with open(path, "w") as f:
        json.dump(dict(sorted(cfg.items())), f, indent=2)
        f.write("\n")


def load_reference(case_dir, family, generation_13b=None):
    if family == "baichuan":
        return load_baichuan(case_dir, generation_13b=generation_13b)
    cls = {"qwen2": Qwen2ForCausalLM, "mistral": MistralForCausalLM,
           "bloom": BloomForCausalLM}[family]
    kw = {"dtype": torch.float64} if mg.HF_V5 else {"torch_dtype": torch.float64}
    return cls.from_pretrained(case_dir, attn_implementation="eager", **kw).eval()


def family_of(case_dir):
    with open(os.path.join(case_dir, "config.json")) as f:
        return json.load(f)["model_type"]


def make_case(case, out_dir):
    name, family = case["name"], case["family"]
    case_dir = os.path.join(out_dir, name)
    os.makedirs(case_dir, exist_ok=True)
    for fn in os.listdir(case_dir):
        os.remove(os.path.join(case_dir, fn))
    gen13 = case.get("generation_13b")
    if family == "baichuan":
        norm_head, alibi = baichuan_parts(baichuan_config_json(case), gen13)
        model = BaichuanReference(baichuan_config_json(case), norm_head, alibi)
        model.init_weights(case["seed"])
        save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()},
                  os.path.join(case_dir, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(case_dir, "config.json"), "w") as f:
            json.dump(baichuan_config_json(case), f, indent=2)
            f.write("\n")
    else:
        model = hf_model(case)
        model.save_pretrained(case_dir, safe_serialization=True)
        gen_cfg = os.path.join(case_dir, "generation_config.json")
        if os.path.exists(gen_cfg):
            os.remove(gen_cfg)
        if case["v4_config"]:
            rewrite_v4(os.path.join(case_dir, "config.json"), family)
        if case.get("strip_prefix"):
            # A bare BloomModel's names: no `transformer.` prefix (transformers loads both).
            path = os.path.join(case_dir, "model.safetensors")
            state = load_file(path)
            state = {k.removeprefix("transformer."): v for k, v in state.items()}
            save_file(state, path, metadata={"format": "pt"})

    # Compute from the checkpoint as written (the reference loads it back), in float64.
    model = load_reference(case_dir, family, gen13)
    ids, labels = mg.make_inputs(case)
    if case.get("all_labels"):
        labels = ids.clone()
    logits, loss, grads = mg.forward_backward(model, ids, labels, "cpu")
    assert math.isfinite(loss.item())
    want = mg.manual_loss(logits, labels).item()
    z = case["config"].get("z_loss_weight", 0.0)
    if z:
        # Baichuan2: z_loss_weight * mean over every shifted position of max(logits)^2.
        want += z * float((logits[:, :-1].double().max(-1).values ** 2).mean())
    assert abs(want - loss.item()) < 1e-5 * abs(loss.item()), (want, loss.item())
    for k, g in grads.items():
        assert torch.isfinite(g).all(), k
        assert g.abs().max().item() > 0, f"zero gradient for {k}"
    checks = {}
    window = case["config"].get("sliding_window")
    if window is not None and window < case["seq"]:
        # The window must matter at this length: the same weights without it differ.
        cfg_path = os.path.join(case_dir, "config.json")
        with open(cfg_path) as f:
            saved = f.read()
        plain = json.loads(saved)
        plain["sliding_window"] = None
        plain.pop("layer_types", None)
        with open(cfg_path, "w") as f:
            json.dump(plain, f)
        try:
            full = load_reference(case_dir, family)
            with torch.no_grad():
                diff = float((full(input_ids=ids).logits - logits).abs().max())
        finally:
            with open(cfg_path, "w") as f:
                f.write(saved)
        assert diff > 1e-3, f"{name}: the sliding window changes nothing ({diff})"
        checks["max_abs_logit_change_vs_full_attention"] = diff
    if family == "baichuan" and model.norm_head:
        # NormHead must matter: the raw lm_head gives other logits.
        with torch.no_grad():
            model.norm_head = False
            diff = float((model(input_ids=ids).logits - logits).abs().max())
            model.norm_head = True
        assert diff > 1e-3, f"{name}: NormHead changes nothing ({diff})"
        checks["max_abs_logit_change_vs_raw_lm_head"] = diff
    if family == "baichuan" and model.alibi:
        # ALiBi must matter: the same weights with plain causal attention differ.
        with torch.no_grad():
            model.alibi = False
            diff = float((model(input_ids=ids).logits - logits).abs().max())
            model.alibi = True
        assert diff > 1e-3, f"{name}: ALiBi changes nothing ({diff})"
        checks["max_abs_logit_change_vs_no_alibi"] = diff
    if z:
        with torch.no_grad():
            plain = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                    labels[:, 1:].reshape(-1), ignore_index=mg.IGNORE)
        checks["z_loss_term"] = float(loss.item() - plain.item())
        assert checks["z_loss_term"] > 1e-4, f"{name}: the z-loss adds nothing"

    tensors = {
        "input_ids": ids.contiguous(),
        "labels": labels.contiguous(),
        "logits": mg.to_f32_cpu(logits),
        "loss": mg.to_f32_cpu(loss.reshape(1)),
    }
    for k, g in grads.items():
        tensors["grad." + k] = mg.to_f32_cpu(g)
    save_file(tensors, os.path.join(case_dir, "golden.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(case_dir, "config.json")) as f:
        written = json.load(f)
    info = {
        "case": name,
        "family": family,
        "tilearn_llm_baichuan_13b": gen13,
        "description": case["description"],
        "seed": case["seed"],
        "batch": mg.BATCH,
        "seq": case["seq"],
        "reference": "transformers" if family != "baichuan" else
                     "BaichuanReference in make_family_golden.py (published architecture)",
        "config_json": written,
        "ignored_label_positions": [list(p) for p in mg.ignored_positions(case["seq"])],
        "num_loss_targets": int((labels[:, 1:] != mg.IGNORE).sum()),
        "loss": float(loss.item()),
        "checks": checks,
        "versions": mg.versions(),
        "generated_on": mg.machine_description("cpu"),
    }
    with open(os.path.join(case_dir, "golden.json"), "w") as f:
        json.dump(info, f, indent=2)
        f.write("\n")
    sizes = {fn: os.path.getsize(os.path.join(case_dir, fn)) for fn in sorted(os.listdir(case_dir))}
    total = sum(sizes.values())
    assert total < 100_000, sizes
    print(f"{name}: loss {loss.item():.9f} checks {checks} total={total}", flush=True)


def check_saved(saved_dir, expect_path):
    """A checkpoint tilearn saved: the family's reference loads it and reproduces tilearn's
    logits (relative error, max-abs scaled, at most 1e-4: tilearn computes in f32)."""
    family = family_of(saved_dir)
    model = load_reference(saved_dir, family)
    want = load_file(expect_path)
    with torch.no_grad():
        logits = model(input_ids=want["input_ids"]).logits
    err = mg.rel_err(logits, want["logits"])
    ok = err <= 1e-4
    print(f"check-saved {saved_dir} ({family}): logits rel err {err:.3e} -> "
          f"{'ok' if ok else 'FAILED'}", flush=True)
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=HERE)
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--check-saved", metavar="DIR")
    ap.add_argument("--expect", metavar="FILE")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_float32_matmul_precision("highest")
    if args.check_saved:
        sys.exit(0 if check_saved(args.check_saved, args.expect) else 1)
    torch.use_deterministic_algorithms(True)
    cases = [c for c in CASES if not args.only or c["name"] in args.only]
    for case in cases:
        make_case(case, args.out)


if __name__ == "__main__":
    main()
