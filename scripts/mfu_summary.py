#!/usr/bin/env python3
"""MFU of a measured run against the advisor's prediction for the same layout.

The advisor's MFU is (FLOPs per token × tokens/s) / (GPUs × peak), so at the same FLOPs per
token the measured MFU is the predicted one scaled by measured / predicted tokens/s. The
measured tokens/s is the mean over the run's logged steps after the first (warm-up).

    python3 scripts/mfu_summary.py PLAN.json train_log.jsonl   # PLAN: tilearn plan --json
"""
import json
import sys


def main(plan_path, log_path):
    plan = json.load(open(plan_path))
    rec = plan["recommended"]
    with open(log_path) as f:
        logs = [json.loads(line) for line in f if line.strip()]
    steps = [r for r in logs if "tokens_per_sec" in r]
    steady = steps[1:] if len(steps) > 1 else steps
    if not steady:
        print(json.dumps({"error": f"no training records in {log_path}"}))
        return 1
    measured = sum(r["tokens_per_sec"] for r in steady) / len(steady)
    predicted = rec["cost"]["tokens_per_s"]
    print(json.dumps({
        "layout": rec["layout"],
        "train_flags": " ".join(plan["recommended_train_flags"]),
        "gpus": plan["hardware"]["gpus"],
        "steps_averaged": len(steady),
        "measured_tokens_per_s": measured,
        "predicted_tokens_per_s": predicted,
        "measured_over_predicted": measured / predicted,
        "predicted_mfu": rec["cost"]["mfu"],
        "measured_mfu": rec["cost"]["mfu"] * measured / predicted,
        "predicted_gib_per_gpu": rec["memory_total"] / 2**30,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
