#!/usr/bin/env python3
"""Write the greedy-generation fixtures for tilearn, computed by Hugging Face `transformers`.

For every golden checkpoint `<dir>/<case>/` (made by make_golden.py) this script loads the model
with `LlamaForCausalLM.from_pretrained(..., torch_dtype=torch.float32)` and runs
`generate(input_ids, max_new_tokens=16, do_sample=False)` (greedy, transformers' KV cache) for
each fixed prompt below, one prompt per call (no padding). It writes
`<dir>/<case>/generate_greedy.json`:

    max_new_tokens     16
    eos_token_ids      the ids generation stops at (from the checkpoint's config)
    prompts            [{input_ids, generated, min_top2_margin}], `generated` = new tokens only
                       (ending with the eos id when generation stopped there); min_top2_margin =
                       the smallest gap between the two largest logits over the steps, so a
                       near-tie (where f32 rounding could pick either) would be visible
    versions, generated_on

The model is loaded afresh for every prompt: transformers' dynamic-NTK rotary embedding keeps the
longest length it has seen as state, and a fresh model is what one `generate` call sees.

Usage:
    python make_generate_golden.py [--dir DIR] [--only CASE ...]
"""

import argparse
import json
import os
import platform

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = ["mha_untied", "gqa_tied_llama3", "gqa_linear_bias_v4config", "dynamic_rope"]
MAX_NEW_TOKENS = 16
# Ids below 200 (the smallest vocabulary). The second prompt is longer than dynamic_rope's
# max_position_embeddings (16), so its prefill already uses the rescaled frequencies; the first
# one crosses 16 while decoding.
PROMPTS = [
    [1, 15, 42, 7, 99],
    [1, 5, 123, 77, 8, 150, 3, 64, 190, 21, 9, 33, 180, 2, 47, 111, 6, 58],
]


def eos_ids(model):
    eos = model.generation_config.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def run_prompt(case_dir, prompt):
    model = LlamaForCausalLM.from_pretrained(case_dir, torch_dtype=torch.float32,
                                             attn_implementation="eager")
    model.eval()
    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS,
                             do_sample=False, output_scores=True, return_dict_in_generate=True,
                             pad_token_id=eos_ids(model)[0] if eos_ids(model) else 0)
    generated = out.sequences[0, len(prompt):].tolist()
    margins = []
    for scores in out.scores:
        top2 = torch.topk(scores[0].double(), 2).values
        margins.append(float(top2[0] - top2[1]))
    return model, generated, min(margins)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=HERE, help="folder holding the golden cases (default: this one)")
    ap.add_argument("--only", nargs="*", help="case names (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    print(f"torch {torch.__version__} transformers {transformers.__version__}", flush=True)
    for case in CASES:
        if args.only and case not in args.only:
            continue
        case_dir = os.path.join(args.dir, case)
        prompts = []
        for prompt in PROMPTS:
            model, generated, margin = run_prompt(case_dir, prompt)
            assert all(0 <= t < model.config.vocab_size for t in generated)
            prompts.append(dict(input_ids=prompt, generated=generated, min_top2_margin=margin))
            print(f"{case}: prompt of {len(prompt)} -> {generated} (min top-2 margin {margin:.3g})",
                  flush=True)
        fixture = dict(
            description="transformers greedy generate (do_sample=False, KV cache), float32, CPU, "
                        "one prompt per call; `generated` holds the new tokens only",
            max_new_tokens=MAX_NEW_TOKENS,
            eos_token_ids=eos_ids(model),
            prompts=prompts,
            versions=dict(torch=torch.__version__, transformers=transformers.__version__,
                          python=platform.python_version()),
            generated_on=dict(platform=platform.platform(), device="cpu",
                              cpu=platform.processor() or platform.machine(),
                              note=os.environ.get("GOLDEN_MACHINE_NOTE", "")),
        )
        with open(os.path.join(case_dir, "generate_greedy.json"), "w") as f:
            json.dump(fixture, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
