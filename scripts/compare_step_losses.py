#!/usr/bin/env python3
"""Compares the per-step losses of training runs: for each pair of output directories (under
ROOT) prints how many logged steps they share and the worst relative loss difference.

    compare_step_losses.py ROOT A:B:LABEL [A:B:LABEL ...]

Each directory's `train_log.jsonl` is read (records with "step" and "loss"); a run that left no
log is named rather than skipped, so a failed run shows in the summary.
"""
import json
import os
import sys


def losses(path):
    log = os.path.join(path, "train_log.jsonl")
    if not os.path.exists(log):
        return {}
    out = {}
    with open(log) as f:
        for line in f:
            record = json.loads(line)
            if "loss" in record and "step" in record:
                out[record["step"]] = record["loss"]
    return out


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    root = argv[1]
    for spec in argv[2:]:
        a, b, label = spec.split(":", 2)
        la, lb = losses(os.path.join(root, a)), losses(os.path.join(root, b))
        common = sorted(set(la) & set(lb))
        if not common:
            print(f"{label}: no common steps ({len(la)} vs {len(lb)} records)")
            continue
        worst = max(abs(la[s] - lb[s]) / abs(la[s]) for s in common)
        last = common[-1]
        print(f"{label}: {len(common)} steps, worst relative loss difference {worst:.2e}; "
              f"last step {last}: {la[last]:.6f} vs {lb[last]:.6f}")


if __name__ == "__main__":
    main(sys.argv)
