#!/usr/bin/env python3
"""The README's "Choosing a parallel layout" table, from `tilearn plan --json`.

For each Llama-2-shaped config in tests/plan/ and each GPU memory, the recommendation on 8 GPUs
of one node; a model that fits no layout there gets a "does not fit" row and, on as many nodes
of 8 as the command's error says would fit it, that recommendation. Usage: scripts/plan_table.py [path/to/tilearn]
"""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TILEARN = sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "target/debug/tilearn")
MODELS = ["llama2-7b", "llama2-13b", "llama2-70b"]
MEMORIES = ["80GiB", "141GiB"]
COMMON = ["--seq-len", "4096", "--global-batch-size", "256"]
GIB = float(1 << 30)


def plan(model, memory, gpus, nnodes):
    args = [TILEARN, "plan", "--model", str(ROOT / "tests/plan" / f"{model}.json"),
            "--gpus", str(gpus), "--nnodes", str(nnodes), "--gpu-memory", memory,
            "--json", *COMMON]
    out = subprocess.run(args, capture_output=True, text=True)
    if out.returncode != 0:
        return None, out.stderr.strip()
    return json.loads(out.stdout), None


def row(model, memory, gpus, nnodes, p):
    r = p["recommended"]
    l, c = r["layout"], r["cost"]
    v = f" (v={l['virtual_stages']})" if l["virtual_stages"] > 1 else ""
    return (f"| {model} | {gpus} × {memory} ({nnodes} node{'s' if nnodes > 1 else ''}) "
            f"| {l['tp']} | {l['pp']}{v} | {l['dp']} | {l['zero']} "
            f"| {l['micro_batch']} × {l['micro_batches']} | {'on' if l['checkpointing'] else 'off'} "
            f"| {r['memory_total'] / GIB:.1f} | {c['tokens_per_s'] / 1e3:.1f} K "
            f"| {c['mfu'] * 100:.1f} % |")


def main():
    print("| model | GPUs | TP | PP | DP | ZeRO | micro-batch × steps | ckpt "
          "| GiB/GPU | tokens/s | MFU |")
    print("|" + "---|" * 11)
    notes = []
    for model in MODELS:
        for memory in MEMORIES:
            p, err = plan(model, memory, 8, 1)
            if p is not None:
                print(row(model, memory, 8, 1, p))
                continue
            print(f"| {model} | 8 × {memory} | does not fit | | | | | | | | |")
            notes.append(f"{model}, 8 × {memory}: {err}")
            fits = re.search(r"(\d+) GPUs would fit", err)
            if fits is None:
                continue
            gpus = int(fits.group(1))
            p, err = plan(model, memory, gpus, gpus // 8)
            if p is not None:
                print(row(model, memory, gpus, gpus // 8, p))
            else:
                notes.append(f"{model}, {gpus} × {memory}: {err}")
    for note in notes:
        print(f"\n{note}")


if __name__ == "__main__":
    main()
