#!/usr/bin/env python3
"""Compares two `tilearn train` JSONL logs step by step (issue 13 goal 4: the lean memory mode's
loss must track the default mode's). Prints one JSON line: steps compared, the largest and the
mean absolute loss difference, the largest relative one, the final losses, the mean
tokens/s of each run, and the grad norms' largest relative difference.

    python3 scripts/lean_compare.py NAME default.jsonl lean.jsonl
"""
import json
import sys


def train_lines(path):
    rows = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            r = json.loads(line)
            # Training lines carry a loss and a learning rate (evaluation lines have eval_*).
            if "loss" in r and "lr" in r and r.get("loss") is not None:
                rows[r["step"]] = r
    return rows


def main():
    name, a_path, b_path = sys.argv[1:4]
    a, b = train_lines(a_path), train_lines(b_path)
    steps = sorted(set(a) & set(b))
    if not steps:
        print(json.dumps({"run": name, "error": "no common training steps",
                          "default_steps": len(a), "lean_steps": len(b)}))
        return 1
    diffs = [abs(a[s]["loss"] - b[s]["loss"]) for s in steps]
    rels = [d / max(abs(a[s]["loss"]), 1e-30) for d, s in zip(diffs, steps)]
    norms = [abs(a[s]["grad_norm"] - b[s]["grad_norm"]) / max(abs(a[s]["grad_norm"]), 1e-30)
             for s in steps
             if isinstance(a[s].get("grad_norm"), (int, float))
             and isinstance(b[s].get("grad_norm"), (int, float))]
    tps = lambda rows: sum(r.get("tokens_per_sec") or 0 for r in rows.values()) / len(rows)
    last = steps[-1]
    print(json.dumps({
        "run": name,
        "steps_compared": len(steps),
        "loss_max_abs_diff": max(diffs),
        "loss_mean_abs_diff": sum(diffs) / len(diffs),
        "loss_max_rel_diff": max(rels),
        "grad_norm_max_rel_diff": max(norms) if norms else None,
        "final_step": last,
        "final_loss_default": a[last]["loss"],
        "final_loss_lean": b[last]["loss"],
        "tokens_per_sec_default": tps(a),
        "tokens_per_sec_lean": tps(b),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
