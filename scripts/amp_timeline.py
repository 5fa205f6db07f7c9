#!/usr/bin/env python3
"""Summarises `tilearn train` logs (train_log.jsonl, one record per logged step): the precision
timeline as runs of consecutive steps, steps the GradScaler skipped, loss at the start and the
end, the final loss scale and the median throughput. Used by scripts/gpu-call.sh's `amp` phase
to put one GPU run per mixed-precision policy next to a plain bf16 run.

    python3 scripts/amp_timeline.py NAME=path/train_log.jsonl ...
"""
import json
import statistics
import sys


def timeline(records):
    """Runs of one precision as "fp32 1-30, fp16 31-270, ...". A record covers the steps since
    the previous record and names the precision of its last step, so with --logging-steps N > 1
    a boundary is only known to the window."""
    runs = []
    previous = 0
    for r in records:
        p = r.get("precision", "?")
        if runs and runs[-1][0] == p:
            runs[-1][2] = r["step"]
        else:
            runs.append([p, previous + 1, r["step"]])
        previous = r["step"]
    return ", ".join(f"{p} {a}-{b}" if a != b else f"{p} {a}" for p, a, b in runs)


def main(args):
    if not args:
        sys.exit(__doc__)
    for arg in args:
        name, _, path = arg.partition("=")
        try:
            with open(path) as f:
                records = [json.loads(line) for line in f if line.strip()]
        except OSError as e:
            print(f"{name}: no log ({e})")
            continue
        if not records:
            print(f"{name}: empty log {path}")
            continue
        last10 = [r["loss"] for r in records[-10:]]
        summary = {
            "run": name,
            "steps": records[-1]["step"],
            "timeline": timeline(records),
            "skipped_steps": sum(r.get("skipped_steps", 0) for r in records),
            "first_loss": round(records[0]["loss"], 4),
            "final_loss_mean_last10": round(sum(last10) / len(last10), 4),
            "final_loss_scale": records[-1].get("loss_scale"),
            "median_tokens_per_sec": round(statistics.median(r["tokens_per_sec"] for r in records)),
        }
        print(json.dumps(summary))


if __name__ == "__main__":
    main(sys.argv[1:])
