#!/usr/bin/env python3
"""Sums the kernels of an `ncu --csv --page raw --metrics gpu__time_duration.sum,dram__bytes.sum`
log (other output, such as the profiled program's own lines, may be interleaved): launches,
milliseconds, DRAM bytes and the bandwidth they make.

    python3 scripts/ncu_kernel_sum.py norm_ncu.log "rmsnorm backward"
"""
import csv
import sys

TIME = {"ns": 1e-9, "nsecond": 1e-9, "us": 1e-6, "usecond": 1e-6, "ms": 1e-3, "msecond": 1e-3}
BYTES = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}


def main(path, label):
    rows = list(csv.reader(line for line in open(path) if line.startswith('"')))
    if len(rows) < 3:
        sys.exit(f"{path}: no ncu rows (was the kernel launched?)")
    head, units = rows[0], rows[1]
    dur, byt = head.index("gpu__time_duration.sum"), head.index("dram__bytes.sum")
    seconds = dram = 0.0
    for r in rows[2:]:
        seconds += float(r[dur].replace(",", "")) * TIME[units[dur]]
        dram += float(r[byt].replace(",", "")) * BYTES[units[byt]]
    print(f"{label}: {len(rows) - 2} launches, {seconds * 1e3:.3f} ms, {dram / 1e9:.2f} GB of DRAM "
          f"traffic, {dram / seconds / 1e12:.2f} TB/s")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "kernels")
