#!/usr/bin/env python3
"""Record torch.amp.GradScaler's trajectory on planted gradients, for adaptfp16's exactness test.

For each scenario (scaler settings + a sequence of "scaled" gradients, some with planted
inf / -inf / NaN), every step does what a training loop does:

    scaled = scaler.scale(loss)      # recorded: scaled loss
    <grads are set to the planted values>
    scaler.unscale_(opt)             # recorded: unscaled grads, found_inf
    scaler.step(opt)                 # recorded: whether opt.step() ran
    scaler.update()                  # recorded: scale and growth tracker after

Writes two files to --out:
  scaler_golden.json         settings and per-step records (f32 values as their bit patterns,
                             so nothing depends on decimal parsing), torch's own state_dict()
                             at the middle and the end of each scenario
  scaler_golden.safetensors  per step and tensor: "<scenario>.<step>.<i>.in" (the planted
                             scaled gradient) and ".out" (what unscale_ made of it), float32

crates/adaptfp16/tests/torch_trajectory.rs replays it and demands bit equality.

Usage:
  python3 tests/amp_golden/make_scaler_golden.py --device cpu  --out tests/amp_golden
  python3 tests/amp_golden/make_scaler_golden.py --device cuda --out $OUT/amp_golden

Deterministic: inputs come from a seeded CPU generator and are moved to the device, and the
scaler's arithmetic is exact IEEE f32/f64 on both devices, so cpu and cuda runs must agree
byte for byte on everything but the "device"/"torch" metadata.
"""

import argparse
import json
import math
import os
import struct

import torch
from safetensors.torch import save_file

SIZES = (37, 35, 65)  # three gradient tensors, none a multiple of a vector width


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def f64_bits(x: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", x))[0]


SCENARIOS = [
    # torch defaults except a short growth interval, so growth happens many times.
    dict(name="defaults_gi3", init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
         growth_interval=3, steps=60,
         planted={4: [(0, 3, "inf")], 5: [(1, 0, "nan")], 11: [(2, 64, "-inf")],
                  20: [(0, 0, "inf")], 21: [(1, 34, "nan")], 22: [(2, 10, "inf")],
                  33: [(0, 36, "nan"), (2, 1, "inf")], 47: [(1, 7, "-inf")],
                  55: [(2, 30, "nan"), (2, 31, "inf")]}),
    # Factors that are not powers of two: every growth/backoff rounds (f32 scale * f64 factor
    # -> f32), and 1/scale rounds (f64 reciprocal -> f32).
    dict(name="odd_factors_gi2", init_scale=3000.7, growth_factor=1.37, backoff_factor=0.29,
         growth_interval=2, steps=60,
         planted={3: [(0, 5, "inf")], 9: [(1, 1, "nan")], 10: [(2, 2, "inf")],
                  17: [(0, 0, "-inf")], 30: [(1, 33, "inf")], 31: [(1, 34, "nan")],
                  44: [(2, 60, "inf")], 58: [(0, 12, "nan")]}),
    # Growth that would overflow f32 is refused (torch keeps the old scale, resets the tracker).
    dict(name="growth_cap_gi1", init_scale=1.5 * 2.0**126, growth_factor=2.0,
         backoff_factor=0.5, growth_interval=1, steps=20,
         planted={6: [(0, 0, "inf")], 13: [(2, 2, "nan")]}),
    # Collapse: back off every step until the scale is subnormal and then 0 (inv_scale = inf),
    # then clean steps. Edge semantics must still match.
    dict(name="collapse_to_zero", init_scale=2.0**-120, growth_factor=2.0, backoff_factor=0.5,
         growth_interval=4, steps=40,
         planted={s: [(s % 3, (7 * s) % 35, ("inf", "nan", "-inf")[s % 3])] for s in range(32)}),
]


def planted_value(kind: str) -> float:
    return {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}[kind]


def make_grads(gen: torch.Generator, step: int, planted: dict):
    """Scaled gradients with magnitudes spread over many binades (so products round, and some
    go subnormal), plus the planted non-finite values."""
    grads = []
    for n in SIZES:
        mant = torch.randn(n, generator=gen, dtype=torch.float64)
        expo = torch.randint(-60, 61, (n,), generator=gen, dtype=torch.int64).to(torch.float64)
        g = (mant * torch.pow(2.0, expo)).to(torch.float32)
        grads.append(g)
    for tensor, index, kind in planted.get(step, []):
        grads[tensor][index] = planted_value(kind)
    return grads


class CountingSGD(torch.optim.SGD):
    """SGD that records whether its step ran (GradScaler skips it on inf/NaN)."""

    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.calls = 0

    def step(self, closure=None):
        self.calls += 1
        return super().step(closure)


def run_scenario(sc, device, tensors):
    gen = torch.Generator().manual_seed(20240611 + len(sc["name"]))
    scaler = torch.amp.GradScaler(device, init_scale=sc["init_scale"],
                                  growth_factor=sc["growth_factor"],
                                  backoff_factor=sc["backoff_factor"],
                                  growth_interval=sc["growth_interval"])
    assert scaler.is_enabled(), f"GradScaler disabled on {device}"
    params = [torch.nn.Parameter(torch.zeros(n, device=device)) for n in SIZES]
    opt = CountingSGD(params)
    records, mid_state = [], None
    for step in range(sc["steps"]):
        loss = torch.rand((), generator=gen, dtype=torch.float32) * 10.0
        scale_before = scaler.get_scale()
        scaled = scaler.scale(loss.to(device))
        grads = make_grads(gen, step, sc["planted"])
        for p, g in zip(params, grads):
            p.grad = g.clone().to(device)
        scaler.unscale_(opt)
        found = sum(v.item() for v in scaler._found_inf_per_device(opt).values())
        calls = opt.calls
        scaler.step(opt)
        stepped = opt.calls != calls
        scaler.update()
        state = scaler.state_dict()
        expect_inf = any(not math.isfinite(float(v)) for g in grads for v in g.tolist())
        assert bool(found) == expect_inf, (sc["name"], step, found)
        assert stepped == (not expect_inf), (sc["name"], step)
        for i, (g, p) in enumerate(zip(grads, params)):
            tensors[f"{sc['name']}.{step:03d}.{i}.in"] = g.contiguous()
            tensors[f"{sc['name']}.{step:03d}.{i}.out"] = p.grad.detach().cpu().contiguous()
        records.append(dict(
            step=step,
            loss_bits=f32_bits(loss.item()),
            scaled_loss_bits=f32_bits(scaled.item()),
            scale_before_bits=f32_bits(scale_before),
            found_inf=bool(found),
            optimizer_stepped=stepped,
            scale_after_bits=f32_bits(scaler.get_scale()),
            growth_tracker=state["_growth_tracker"],
            scale_after=scaler.get_scale(),  # readable copy; tests use the bits
        ))
        if step == sc["steps"] // 2 - 1:
            mid_state = dict(after_step=step, state_dict=state)
    out = {k: v for k, v in sc.items() if k != "planted"}
    out["planted"] = {str(k): v for k, v in sc["planted"].items()}
    # The settings as bit patterns too: the Rust side must not depend on decimal parsing.
    for key in ("init_scale", "growth_factor", "backoff_factor"):
        out[key + "_bits"] = f64_bits(sc[key])
    out["sizes"] = list(SIZES)
    out["records"] = records
    out["mid_state"] = mid_state
    out["final_state_dict"] = scaler.state_dict()
    skipped = sum(not r["optimizer_stepped"] for r in records)
    grown = sum(r["scale_after_bits"] != r["scale_before_bits"] and not r["found_inf"]
                for r in records)
    print(f"{sc['name']}: steps {sc['steps']} skipped {skipped} grown {grown} "
          f"final scale {scaler.get_scale()!r} tracker {state['_growth_tracker']}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cpu", "cuda"])
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch.cuda.is_available() is False")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    tensors = {}
    scenarios = [run_scenario(sc, args.device, tensors) for sc in SCENARIOS]
    meta = dict(
        torch=torch.__version__,
        device=args.device,
        device_name=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        scenarios=scenarios,
    )
    with open(os.path.join(args.out, "scaler_golden.json"), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
        f.write("\n")
    save_file(tensors, os.path.join(args.out, "scaler_golden.safetensors"))
    size = sum(os.path.getsize(os.path.join(args.out, n))
               for n in ("scaler_golden.json", "scaler_golden.safetensors"))
    print(f"wrote {len(tensors)} tensors, {size} bytes to {args.out} (device {args.device}, "
          f"torch {torch.__version__})")


if __name__ == "__main__":
    main()
