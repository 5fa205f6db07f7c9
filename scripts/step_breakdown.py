#!/usr/bin/env python3
"""Where one training step's time goes: kernel times from Nsight Compute grouped into GEMMs,
attention, norms and elementwise, loss, optimizer and idle, each against its ceiling.

The GPU machine has `ncu` but no `nsys`, so the step is profiled kernel by kernel:

    ncu --csv --page raw --metrics gpu__time_duration.sum,dram__bytes.sum \\
        --cache-control none --clock-control none \\
        tilearn bench --preset llama-134m --steps 1 --json > kernels.csv
    tilearn bench --preset llama-134m --steps 10 --json > bench.json
    python3 scripts/step_breakdown.py --kernels kernels.csv --bench bench.json \\
        --embedding-params 24576000

`tilearn bench` runs 3 warm-up steps and then the timed ones; every step ends with the fused
AdamW kernel, so the kernels after the second-to-last AdamW launch up to the last one are one
whole step. ncu runs the kernels one at a time, so their sum is the step's busy time without
overlap; idle is the unprofiled step time (from the bench line) minus that sum. Ceilings: the
GEMMs against the measured bf16 cuBLAS rate, everything memory-bound against the measured device
copy bandwidth (H200.md: about 870 TFLOP/s and 4.2 TB/s; override with the flags).
"""
import argparse
import csv
import glob
import json
import os
import re
import sys

# Our kernels are grouped by the source file that defines them (their names are generic:
# `forward_vec_kernel`), library kernels (cuBLASLt) by name fragments.
FILE_CATEGORIES = {
    "flash_attention.cu": "attention", "flash_attention_sm90.cu": "attention",
    "attention.cu": "attention",
    "cached_attention.cu": "attention", "cross_entropy.cu": "loss",
    "optim_adam.cu": "optimizer", "optim_norm.cu": "optimizer", "optim_lion.cu": "optimizer",
    "optim_lamb.cu": "optimizer", "optim_sgd.cu": "optimizer",
    # reduce.cu: the clip norm's sum of squares and the GradScaler's unscale-and-check.
    "reduce.cu": "optimizer",
}
LIBRARY_GEMM = ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm80_", "splitk")
KERNELS_DIR = os.path.join(os.path.dirname(__file__), "..", "crates", "tilearn-kernels", "kernels")


def kernel_files(kernels_dir):
    """Kernel name -> category, from the `__global__` definitions of every .cu file."""
    # __launch_bounds__'s arguments may hold one level of parentheses (`f<N>() / WGS`).
    pattern = re.compile(r"__global__\s+(?:void\s+)?"
                         r"(?:__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s+)?"
                         r"(?:void\s+)?([A-Za-z_0-9]+)\s*\(")
    names = {}
    for path in sorted(glob.glob(os.path.join(kernels_dir, "*.cu"))):
        base = os.path.basename(path)
        with open(path) as f:
            for m in pattern.finditer(f.read()):
                names.setdefault(m.group(1), FILE_CATEGORIES.get(base, "norms+elementwise"))
    return names


OURS = kernel_files(KERNELS_DIR)


def category(name):
    """The part of the step a kernel launch belongs to."""
    ident = re.search(r"([A-Za-z_][A-Za-z_0-9]*)\s*(?:<|\(|$)", name.replace("void ", "", 1))
    if ident and ident.group(1) in OURS:
        return OURS[ident.group(1)]
    if any(f in name.lower() for f in LIBRARY_GEMM):
        return "gemm"
    return "other"


def read_kernels(path):
    """(name, seconds, dram bytes) per kernel launch, in launch order, from ncu's raw CSV page."""
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    rows = list(csv.reader(lines))
    if not rows:
        sys.exit(f"{path}: no CSV rows (was ncu run with --csv --page raw?)")
    header = rows[0]

    def col(*names):
        for n in names:
            if n in header:
                return header.index(n)
        sys.exit(f"{path}: no column {names[0]!r} in the ncu CSV header")

    i_id, i_name = col("ID"), col("Kernel Name")
    i_time, i_bytes = col("gpu__time_duration.sum"), col("dram__bytes.sum")
    units = {}
    out = []
    for r in rows[1:]:
        if not r[i_id].strip().isdigit():  # the units row
            units = {"time": r[i_time], "bytes": r[i_bytes]}
            continue
        t = float(r[i_time].replace(",", "")) * time_scale(units.get("time", "nsecond"))
        b = float(r[i_bytes].replace(",", "") or 0) * byte_scale(units.get("bytes", "byte"))
        out.append((r[i_name], t, b))
    return out


def time_scale(unit):
    return {"nsecond": 1e-9, "ns": 1e-9, "usecond": 1e-6, "us": 1e-6, "msecond": 1e-3,
            "ms": 1e-3, "second": 1.0, "s": 1.0}.get(unit, 1e-9)


def byte_scale(unit):
    return {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}.get(unit, 1)


def last_step(kernels):
    """The kernels of the last whole step: after the second-to-last optimizer launch, through
    the last one."""
    ends = [i for i, (name, _, _) in enumerate(kernels) if "adam_kernel" in name]
    if len(ends) < 2:
        sys.exit("fewer than two AdamW launches in the profile: profile at least two steps")
    return kernels[ends[-2] + 1: ends[-1] + 1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", required=True, help="ncu --csv --page raw output")
    ap.add_argument("--bench", required=True, help="file holding `tilearn bench --json` lines")
    ap.add_argument("--gemm-tflops", type=float, default=870.0)
    ap.add_argument("--copy-tbps", type=float, default=4.2)
    ap.add_argument("--embedding-params", type=int, default=0,
                    help="vocab × hidden: the embedding table, a gather rather than a product")
    ap.add_argument("--label", default="")
    args = ap.parse_args()

    bench = None
    with open(args.bench) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                bench = json.loads(line)
    if bench is None:
        sys.exit(f"{args.bench}: no JSON line")
    step_s = bench["step_ms"] / 1e3
    tokens = bench["batch"] * bench["seq"]

    step = last_step(read_kernels(args.kernels))
    parts = {}
    for name, t, b in step:
        p = parts.setdefault(category(name), {"s": 0.0, "bytes": 0.0, "launches": 0})
        p["s"] += t
        p["bytes"] += b
        p["launches"] += 1
    busy = sum(p["s"] for p in parts.values())
    # Matmul FLOPs of forward + backward: 6 per parameter per token, less the embedding lookup
    # (a gather, not a product).
    matmul_params = bench["params"] - args.embedding_params
    gemm_flops = 6 * matmul_params * tokens
    rows = []
    for cat, p in sorted(parts.items(), key=lambda kv: -kv[1]["s"]):
        row = {"part": cat, "ms": p["s"] * 1e3, "share": p["s"] / step_s,
               "launches": p["launches"], "gb_moved": p["bytes"] / 1e9}
        if p["s"] > 0:
            row["tb_per_s"] = p["bytes"] / p["s"] / 1e12
            row["of_copy_ceiling"] = row["tb_per_s"] / args.copy_tbps
        if cat == "gemm" and p["s"] > 0:
            row["tflops"] = gemm_flops / p["s"] / 1e12
            row["of_gemm_ceiling"] = row["tflops"] / args.gemm_tflops
        rows.append(row)
    rows.append({"part": "idle", "ms": (step_s - busy) * 1e3, "share": (step_s - busy) / step_s})
    summary = {"label": args.label, "preset": bench.get("preset"), "step_ms": step_s * 1e3,
               "kernels_ms": busy * 1e3, "kernels_per_step": len(step), "parts": rows}
    print(json.dumps(summary))
    print(f"# {args.label or bench.get('preset')}: step {step_s*1e3:.2f} ms, kernels "
          f"{busy*1e3:.2f} ms in {len(step)} launches", file=sys.stderr)
    for r in rows:
        extra = ""
        if "tflops" in r:
            extra += f"  {r['tflops']:.0f} TFLOP/s ({r['of_gemm_ceiling']:.0%} of GEMM ceiling)"
        if "tb_per_s" in r and r["part"] != "gemm":
            extra += f"  {r['tb_per_s']:.2f} TB/s ({r['of_copy_ceiling']:.0%} of copy)"
        print(f"#   {r['part']:<18} {r['ms']:8.2f} ms {r['share']:6.1%}{extra}", file=sys.stderr)


if __name__ == "__main__":
    main()
