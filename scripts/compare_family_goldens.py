#!/usr/bin/env python3
"""Compares regenerated model-family golden fixtures with the committed ones.

    python scripts/compare_family_goldens.py COMMITTED_DIR REGENERATED_DIR [CASE ...]

For every case directory of COMMITTED_DIR holding golden.safetensors, every tensor of it and of
model.safetensors must be in the regenerated case too, with the same shape, and agree within a
relative error (max |a - b| / max |b|) of 1e-6: the fixtures are computed in float64 on the CPU
and stored in float32, so another machine with the same torch gives the same values up to the
last float32 bit. Only the named cases when CASE arguments are given. Prints one line per case;
exits 1 if any case differs or is missing.
"""

import os
import sys

from safetensors.torch import load_file

TOL = 1e-6


def compare(committed, regenerated):
    worst, exact, count = 0.0, 0, 0
    for fn in ("golden.safetensors", "model.safetensors"):
        a = load_file(os.path.join(committed, fn))
        b = load_file(os.path.join(regenerated, fn))
        if set(a) != set(b):
            return None, f"{fn}: tensor names differ: {sorted(set(a) ^ set(b))}"
        for k in a:
            x, y = a[k].double(), b[k].double()
            if x.shape != y.shape:
                return None, f"{fn}: {k}: shape {tuple(x.shape)} vs {tuple(y.shape)}"
            count += 1
            n = y.numel()
            scale = max(float(y.abs().max()), 1e-30) if n else 1.0
            err = float((x - y).abs().max()) / scale if n else 0.0
            exact += int(err == 0.0)
            worst = max(worst, err)
    return worst, f"{exact}/{count} tensors bit-identical, worst rel err {worst:.3e}"


def main():
    committed, regenerated, only = sys.argv[1], sys.argv[2], sys.argv[3:]
    ok = True
    for case in sorted(only or os.listdir(committed)):
        path = os.path.join(committed, case)
        if not os.path.isfile(os.path.join(path, "golden.safetensors")):
            continue
        other = os.path.join(regenerated, case)
        if not os.path.isdir(other):
            print(f"{case}: MISSING from {regenerated}")
            ok = False
            continue
        worst, line = compare(path, other)
        good = worst is not None and worst <= TOL
        ok &= good
        print(f"{case}: {line} -> {'ok' if good else 'DIFFERS'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
