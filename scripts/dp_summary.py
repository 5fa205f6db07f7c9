#!/usr/bin/env python3
"""Summarises the multi-GPU runs of scripts/multi_gpu_call.sh (phases dp, zero, split).

For each preset: per-GPU tokens/s of one GPU (a plain run, one_PRESET) and of N GPUs (data
parallel with the all-reduce overlapped and after the backward, dp*_; ZeRO stages, zero*_;
tensor and pipeline parallel, tp*_ and pp*_), the ratio to one GPU, the all-reduce's mean ms per
step and the share of it hidden behind the backward, the peak memory from the run's last line
and, for the ZeRO runs, each rank's model-state line (held bytes against the formula). Then
the loss check: the per-step losses of one GPU (gradient accumulation N) against N GPUs with the
same global batch.

    python3 scripts/dp_summary.py DIR     # DIR holds NAME.jsonl and NAME.log files
"""
import glob
import json
import os
import re
import sys


def records(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def steady(recs):
    """Records after the first window (which holds the warm-up steps)."""
    return recs[1:] if len(recs) > 1 else recs


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def peak(log):
    if not os.path.exists(log):
        return None
    m = re.findall(r"peak memory ([0-9.]+ \w+)", open(log).read())
    return m[-1] if m else None


def run_figures(directory, name):
    recs = steady(records(os.path.join(directory, name + ".jsonl")))
    if not recs:
        return None
    world = recs[-1].get("world_size", 1)
    out = {
        "run": name,
        "world": world,
        "tokens_per_s": mean([r["tokens_per_sec"] for r in recs]),
        "peak": peak(os.path.join(directory, name + ".log")),
    }
    out["tokens_per_s_per_gpu"] = out["tokens_per_s"] / world
    log = os.path.join(directory, name + ".log")
    if name.startswith("zero") and os.path.exists(log):
        out["model_states"] = re.findall(r"model states on rank \d+: [^\n]*", open(log).read())
    hidden = [r["allreduce_hidden"] for r in recs if r.get("allreduce_hidden") is not None]
    if hidden:
        out["allreduce_ms"] = mean([r["allreduce_ms"] for r in recs if r.get("allreduce_ms")])
        out["allreduce_hidden"] = mean(hidden)
    return out


def main(directory):
    for preset in ("llama-134m", "tinyllama-1.1b"):
        one = run_figures(directory, f"one_{preset}")
        names = sorted(
            os.path.basename(p)[:-6]
            for kind in ("dp", "zero", "tp", "pp")
            for p in glob.glob(os.path.join(directory, f"{kind}*_{preset}.jsonl")))
        for name in names:
            fig = run_figures(directory, name)
            if fig is None:
                continue
            if one:
                fig["per_gpu_vs_one"] = fig["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"]
            print(json.dumps({"preset": preset, **fig}))
    one = records(os.path.join(directory, "loss_one.jsonl"))
    all_ = records(os.path.join(directory, "loss_all.jsonl"))
    if one and all_:
        pairs = list(zip([r["loss"] for r in one], [r["loss"] for r in all_]))
        diff = max(abs(a - b) for a, b in pairs)
        print(json.dumps({
            "loss_check": "one GPU with accumulation vs all GPUs, same global batch",
            "steps": len(pairs),
            "final_one": pairs[-1][0],
            "final_all": pairs[-1][1],
            "max_abs_step_loss_diff": diff,
        }))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
