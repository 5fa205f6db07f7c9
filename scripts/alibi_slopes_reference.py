#!/usr/bin/env python3
"""Reference ALiBi slopes for crates/tilearn-ops/tests/cpu_family_ops.rs.

Prints, for each head count, the slopes transformers' Bloom computes (`_get_alibi_slopes`, used
by `build_alibi_tensor`) when torch and transformers are importable, else the same arithmetic
emulated in numpy float32 (an f32 base raised to integer powers in f32, as Bloom does); the test
hard-codes the printed values. With `--check` it needs transformers and fails unless both
sources agree within 1e-6 relative (run on the GPU machine by scripts/gpu-phases/fam-ops.sh,
which is what ties the hard-coded values to transformers).
"""
import math
import sys

HEADS = [1, 5, 6, 8, 12, 16, 40]


def numpy_slopes(n):
    import numpy as np

    c = 2 ** math.floor(math.log2(n))
    base = np.float32(2 ** (-(2 ** -(math.log2(c) - 3))))
    out = [np.float32(base ** np.float32(p)) for p in range(1, c + 1)]
    if c != n:
        extra = np.float32(2 ** (-(2 ** -(math.log2(2 * c) - 3))))
        out += [np.float32(extra ** np.float32(p)) for p in range(1, 1 + 2 * min(c, n - c), 2)]
    return [float(x) for x in out]


def transformers_slopes(n):
    import torch
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    # One row of ones: key position j gets slope * j; position 1 holds the slopes themselves.
    alibi = build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), n, torch.float32)
    return [float(x) for x in alibi[:, 0, 1]]


def main():
    check = "--check" in sys.argv
    try:
        ref = transformers_slopes
        ref(1)
        source = "transformers build_alibi_tensor"
    except ImportError as e:
        if check:
            sys.exit(f"--check needs torch and transformers: {e}")
        ref, source = numpy_slopes, "numpy float32 emulation"
    print(f"# source: {source}")
    worst = 0.0
    for n in HEADS:
        got = ref(n)
        print(f"{n}: [{', '.join(repr(x) for x in got)}]")
        if check:
            emu = numpy_slopes(n)
            worst = max(worst, max(abs(a - b) / abs(b) for a, b in zip(emu, got)))
    if check:
        print(f"max rel diff numpy emulation vs transformers: {worst:.3e}")
        if worst > 1e-6:
            sys.exit("the hard-coded slopes no longer match transformers")


if __name__ == "__main__":
    main()
