#!/usr/bin/env python3
"""transformers' `generate` baseline for `tilearn generate` on the GPU (batch 1, greedy).

Writes a llama-134m-shaped LlamaForCausalLM with random weights (seed 0, f32 safetensors, no
end-of-sequence id so every run generates exactly the requested tokens) to --dir, with the
prompt ids in --dir/prompt_ids.txt, then times `model.generate` in each --precision on the GPU
and prints one JSON line per precision: the decode speed in tokens/s (the time of N new tokens
minus the time of 1, i.e. the N-1 one-token steps after the prefill, the figure `tilearn
generate` prints) and the greedy tokens, to compare with tilearn's in the same call:

    python3 benches/generate_baseline.py --dir /tmp/gen134m --precision fp32 bf16
    tilearn generate --model /tmp/gen134m --prompt-ids "$(cat /tmp/gen134m/prompt_ids.txt)" \\
        --max-new-tokens 256 --device cuda --precision bf16 > ours_bf16.txt
    python3 benches/generate_baseline.py --compare ours_bf16.txt --with torch.log --precision bf16

`--compare FILE --with LOG` prints how many leading tokens of tilearn's output (the ids line of
FILE) equal those of this script's JSON line for that precision in LOG.
"""
import argparse
import json
import os
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

# llama-134m, as crates/tilearn-llm/src/presets.rs and benches/pytorch_baseline.py.
SHAPE = dict(vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=12, intermediate_size=2048)
PROMPT_LEN = 16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def create(directory):
    cfg = LlamaConfig(**SHAPE, max_position_embeddings=2048, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = None
    model.save_pretrained(directory, safe_serialization=True)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, SHAPE["vocab_size"], (PROMPT_LEN,), generator=g).tolist()
    with open(os.path.join(directory, "prompt_ids.txt"), "w") as f:
        f.write(",".join(map(str, prompt)))


def timed_generate(model, ids, new_tokens):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - start, out[0, ids.shape[1]:].tolist()


def bench(directory, precision, new_tokens, repeats):
    model = LlamaForCausalLM.from_pretrained(directory, dtype=DTYPES[precision]).cuda().eval()
    with open(os.path.join(directory, "prompt_ids.txt")) as f:
        prompt = [int(t) for t in f.read().split(",")]
    ids = torch.tensor([prompt], device="cuda")
    with torch.inference_mode():
        timed_generate(model, ids, 8)  # warm-up: kernels, allocator, cuBLAS handles
        full = min(timed_generate(model, ids, new_tokens)[0] for _ in range(repeats))
        one = min(timed_generate(model, ids, 1)[0] for _ in range(repeats))
        _, tokens = timed_generate(model, ids, new_tokens)
    decode = full - one
    print(json.dumps({
        "impl": "transformers.generate", "precision": precision, "batch": 1,
        "prompt_tokens": len(prompt), "new_tokens": new_tokens,
        "total_s": round(full, 4), "prefill_and_first_token_s": round(one, 4),
        "decode_tokens_per_s": round((new_tokens - 1) / decode, 1),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "tokens": tokens,
    }), flush=True)
    del model
    torch.cuda.empty_cache()


def compare(ours_log, torch_log, precision):
    ours = next(line.strip() for line in open(ours_log)
                if line.strip() and all(c.isdigit() or c == "," for c in line.strip()))
    ours = [int(t) for t in ours.split(",")]
    theirs = None
    for line in open(torch_log):
        start = line.find('{"impl"')
        if start >= 0:
            record = json.loads(line[start:])
            if record["precision"] == precision:
                theirs = record["tokens"]
    if theirs is None:
        raise SystemExit(f"{torch_log}: no {precision} record")
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                min(len(ours), len(theirs)))
    print(json.dumps({"greedy_agreement": precision, "equal_leading_tokens": same,
                      "tilearn_tokens": len(ours), "transformers_tokens": len(theirs)}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="model directory (created when missing)")
    ap.add_argument("--compare", help="a `tilearn generate --prompt-ids` log to compare")
    ap.add_argument("--with", dest="torch_log", help="this script's log, for --compare")
    ap.add_argument("--precision", nargs="+", default=["bf16"], choices=sorted(DTYPES))
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    if args.compare:
        for p in args.precision:
            compare(args.compare, args.torch_log, p)
        return
    if not args.dir:
        ap.error("--dir is required (or --compare with --with)")
    if not os.path.exists(os.path.join(args.dir, "config.json")):
        create(args.dir)
    for p in args.precision:
        bench(args.dir, p, args.new_tokens, args.repeats)


if __name__ == "__main__":
    main()
