#!/usr/bin/env python3
"""Reads a `tilearn train --report-to tensorboard` run back with TensorBoard's own readers and
checks that every tag is there at the steps and values of the JSON-lines log: the
`EventAccumulator` of `event_processing`, and the plugin accumulator behind the TensorBoard
server (which converts the scalars for its dashboard and keeps each tag's description):

    pip install tensorboard
    python3 scripts/check_tensorboard.py OUTPUT_DIR [LOGGING_DIR]

LOGGING_DIR defaults to the only directory under OUTPUT_DIR/runs. Prints one line per tag and
exits non-zero on the first mismatch. CI does not run it (it needs the tensorboard package).
"""
import json
import math
import os
import sys

from tensorboard.backend.event_processing import plugin_event_accumulator
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

TRAIN_TAGS = [
    "train/loss",
    "train/learning_rate",
    "train/grad_norm",
    "train/tokens_per_second",
    "train/epoch",
    "train/precision",
]
EVAL_TAGS = ["eval/loss", "eval/perplexity"]
# `train/precision`: significand bits of the compute format.
PRECISION_BITS = {"fp32": 24, "fp16": 11, "bf16": 8}


def fail(message):
    sys.exit(f"check_tensorboard: FAIL: {message}")


def number(value):
    """JSON has no NaN: the log writes it as null."""
    return float("nan") if value is None else value


def expected(log_path):
    """tag -> [(step, value)] as the JSON-lines log says."""
    want = {tag: [] for tag in TRAIN_TAGS + EVAL_TAGS + ["train/loss_scale"]}
    with open(log_path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            step = r["step"]
            if "eval_loss" in r:
                want["eval/loss"].append((step, number(r["eval_loss"])))
                want["eval/perplexity"].append((step, number(r["eval_perplexity"])))
                continue
            want["train/loss"].append((step, number(r["loss"])))
            want["train/learning_rate"].append((step, number(r["lr"])))
            want["train/grad_norm"].append((step, number(r["grad_norm"])))
            want["train/tokens_per_second"].append((step, number(r["tokens_per_sec"])))
            want["train/epoch"].append((step, number(r["epoch"])))
            want["train/precision"].append((step, PRECISION_BITS[r["precision"]]))
            if r["precision"] == "fp16":
                want["train/loss_scale"].append((step, number(r["loss_scale"])))
    return {tag: points for tag, points in want.items() if points}


def close(a, b):
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    # simple_value is a float32.
    return abs(a - b) <= 1e-6 * max(1.0, abs(b))


def main(args):
    if not 1 <= len(args) <= 2:
        sys.exit(__doc__)
    output_dir = args[0]
    if len(args) == 2:
        logging_dir = args[1]
    else:
        runs = os.path.join(output_dir, "runs")
        found = sorted(os.listdir(runs)) if os.path.isdir(runs) else []
        if len(found) != 1:
            fail(f"{runs}: want exactly one run directory, found {found}; pass LOGGING_DIR")
        logging_dir = os.path.join(runs, found[0])

    accumulator = EventAccumulator(logging_dir, size_guidance={"scalars": 0})
    accumulator.Reload()
    have = set(accumulator.Tags()["scalars"])
    want = expected(os.path.join(output_dir, "train_log.jsonl"))
    if have != set(want):
        fail(f"tags {sorted(have)} != expected {sorted(want)}")
    for tag, points in want.items():
        events = accumulator.Scalars(tag)
        got = [(e.step, e.value) for e in events]
        if [s for s, _ in got] != [s for s, _ in points]:
            fail(f"{tag}: steps {[s for s, _ in got]} != log's {[s for s, _ in points]}")
        for (step, value), (_, logged) in zip(got, points):
            if not close(value, logged):
                fail(f"{tag} at step {step}: {value} != log's {logged}")
        print(f"ok {tag}: {len(got)} values at steps {got[0][0]}..{got[-1][0]}")

    # What the server's scalars dashboard sees: the migrated tensors, with descriptions.
    server = plugin_event_accumulator.EventAccumulator(logging_dir, tensor_size_guidance={"scalars": 0})
    server.Reload()
    dashboard = set(server.PluginTagToContent("scalars"))
    if dashboard != set(want):
        fail(f"the scalars dashboard has {sorted(dashboard)}, want {sorted(want)}")
    for tag, points in want.items():
        got = [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in server.Tensors(tag)]
        same = len(got) == len(points) and all(
            s == step and close(v, logged) for (s, v), (step, logged) in zip(got, points)
        )
        if not same:
            fail(f"{tag}: the dashboard's (step, value) {got} differ from the log's {points}")
    description = server.SummaryMetadata("train/precision").summary_description
    if "fp32 24" not in description:
        fail(f"train/precision's description is {description!r}")
    print(f"ok scalars dashboard: {len(dashboard)} tags; train/precision: {description!r}")
    print(f"check_tensorboard: OK: {len(want)} tags in {logging_dir} match the JSON-lines log")


if __name__ == "__main__":
    main(sys.argv[1:])
