#!/usr/bin/env python3
"""Sums the kernels of an `ncu --csv --page raw --metrics gpu__time_duration.sum,dram__bytes.sum`
log (other output, such as the profiled program's own lines, may be interleaved): launches,
milliseconds, DRAM bytes and the bandwidth they make. The log is read by step_breakdown.py's
`read_kernels`.

    python3 scripts/ncu_kernel_sum.py norm_ncu.log "rmsnorm backward"
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_breakdown import read_kernels  # noqa: E402


def main(path, label):
    kernels = read_kernels(path)
    seconds = sum(t for _, t, _ in kernels)
    dram = sum(b for _, _, b in kernels)
    if not kernels or seconds == 0:
        sys.exit(f"{path}: no kernel launches profiled")
    print(f"{label}: {len(kernels)} launches, {seconds * 1e3:.3f} ms, {dram / 1e9:.2f} GB of DRAM "
          f"traffic, {dram / seconds / 1e12:.2f} TB/s")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "kernels")
