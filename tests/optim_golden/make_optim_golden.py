#!/usr/bin/env python3
"""Records 20-step optimizer trajectories from PyTorch for tilearn-optim's parity tests.

Usage:
    python3 tests/optim_golden/make_optim_golden.py [--out DIR] [--device cpu|cuda] [--seed N]

Writes into DIR (default: tests/optim_golden/fixtures next to this script):

* inputs.safetensors: the shared inputs of every case, all float32:
    `params0` [N]      the initial parameters, the model's tensors flattened in order;
    `grads`   [S, N]   the gradient of each of the S = 20 steps.
  Metadata: `tensors` (JSON list of {name, shape, offset, numel}), `steps`, `seed`, `numel`.
* <case>.safetensors for each case, float32:
    `trajectory`   [S, N]  the flat parameters after each step;
    `state.<name>` [N]     the optimizer state after the last step (e.g. `state.exp_avg`),
                           flattened in the tensor order of inputs.safetensors.
  Metadata `case` (JSON): optimizer name, hyper-parameters, parameter groups (tensor indices and
  weight decay), the learning rate of every step, which implementation produced it, the torch
  version and device.

AdamW, Adam and SGD are torch.optim's own classes with their default implementation (the
single-tensor loop on CPU, the foreach kernels on CUDA). torch has no LAMB or Lion: for those
the REFERENCE FORMULAS below are written in plain torch ops:
  * LAMB as NVIDIA Apex FusedLAMB computes it (adam_w_mode=True): global gradient-norm
    clipping by division, Adam moments with bias correction, update m̂/(sqrt(v̂)+eps) + wd·p,
    per-tensor trust ratio ||p||/||u|| applied only where weight_decay != 0 unless use_nvlamb.
  * Lion as lion-pytorch computes it: decoupled decay, p -= lr·sign(beta1·m + (1-beta1)·g),
    m = beta2·m + (1-beta2)·g.
Each elementwise product and sum in those formulas is its own torch op (rounded to float32),
the norms are taken in float64, and every scalar is a Python float, as in tilearn-optim's
CPU implementation.

The inputs are drawn from a seeded CPU generator and only then moved to the device, so a CUDA
run records trajectories on exactly the same inputs.
"""

import argparse
import json
import math
import os

import torch
from safetensors.torch import save_file

STEPS = 20

# (name, shape, decays): matrices decay, vectors (biases, norms) do not — Hugging Face's
# grouping. Odd sizes on purpose; about 800 elements keeps all fixtures under 1 MB.
TENSORS = [
    ("layer0.weight", (23, 19), True),
    ("layer0.bias", (19,), False),
    ("conv.weight", (7, 6, 5), True),
    ("norm.weight", (31,), False),
    ("head.weight", (11, 7), True),
]


def lr_schedule(base):
    """A linearly decaying learning rate per step, rounded to 6 significant digits so the f32
    value the Rust side reads widens back to exactly this Python float."""
    return [float(f"{base * (1.0 - t / (2 * STEPS)):.6g}") for t in range(STEPS)]


def make_inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(shape, generator=gen) * 0.5 for _, shape, _ in TENSORS]
    grads = []
    for t in range(STEPS):
        # Vary the gradient scale so amsgrad's running maximum and LAMB's clipping both matter.
        scale = 0.05 if t % 3 == 2 else 1.0
        grads.append([torch.randn(shape, generator=gen) * scale for _, shape, _ in TENSORS])
    return params, grads


def flat(tensors):
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


def groups_for(decay_wd):
    decay = [i for i, (_, _, d) in enumerate(TENSORS) if d]
    no_decay = [i for i, (_, _, d) in enumerate(TENSORS) if not d]
    return [
        {"name": "decay", "tensors": decay, "weight_decay": decay_wd},
        {"name": "no_decay", "tensors": no_decay, "weight_decay": 0.0},
    ]


def run_torch(cls, hyper, groups, lrs, params0, grads, device):
    params = [torch.nn.Parameter(p.clone().to(device)) for p in params0]
    pg = [
        {"params": [params[i] for i in g["tensors"]], "weight_decay": g["weight_decay"]}
        for g in groups
    ]
    opt = cls(pg, **hyper)
    traj = []
    for t in range(STEPS):
        for p, g in zip(params, grads[t]):
            p.grad = g.clone().to(device)
        for group in opt.param_groups:
            group["lr"] = lrs[t]
        opt.step()
        traj.append(flat(params))
    state = {}
    names = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"}
    for key in sorted(names):
        bufs = [opt.state[p].get(key) for p in params]
        if all(b is not None for b in bufs):
            state[key] = flat(bufs)
    return traj, state


# ---------------------------------------------------------------------------------------------
# REFERENCE FORMULA: NVIDIA Apex FusedLAMB (adam_w_mode=True), in plain torch ops.
# ---------------------------------------------------------------------------------------------
def run_lamb_reference(hyper, groups, lrs, params0, grads, device):
    beta1, beta2 = hyper["betas"]
    eps = hyper["eps"]
    max_norm = hyper["max_grad_norm"]
    params = [p.clone().to(device) for p in params0]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    traj = []
    for t in range(STEPS):
        step = t + 1
        g = [x.clone().to(device) for x in grads[t]]
        # Global L2 norm of every gradient (Apex: over all parameters of the optimizer).
        gnorm = math.sqrt(sum(float(x.double().pow(2).sum()) for x in g))
        clip = gnorm / max_norm if (max_norm is not None and gnorm > max_norm) else 1.0
        if hyper["bias_correction"]:
            bc1, bc2 = 1.0 - beta1**step, 1.0 - beta2**step
        else:
            bc1, bc2 = 1.0, 1.0
        beta3 = 1.0 - beta1 if hyper["grad_averaging"] else 1.0
        lr = lrs[t]
        for grp in groups:
            wd = grp["weight_decay"]
            for i in grp["tensors"]:
                p = params[i]
                s = g[i] / clip
                m[i] = m[i] * beta1 + s * beta3
                v[i] = v[i] * beta2 + (s * (1.0 - beta2)) * s
                m_hat = m[i] / bc1
                v_hat = v[i] / bc2
                denom = v_hat.sqrt() + eps
                u = m_hat / denom
                if wd != 0.0:
                    u = u + p * wd
                # Per-tensor trust ratio (Apex stage 2).
                pn = float(p.double().norm())
                un = float(u.double().norm())
                if (hyper["use_nvlamb"] or wd != 0.0) and pn != 0.0 and un != 0.0:
                    ratio = lr * (pn / un)
                else:
                    ratio = lr
                params[i] = p - u * ratio
        traj.append(flat(params))
    return traj, {"exp_avg": flat(m), "exp_avg_sq": flat(v)}


# ---------------------------------------------------------------------------------------------
# REFERENCE FORMULA: Lion (Chen et al. 2023) as lion-pytorch computes it, in plain torch ops.
# ---------------------------------------------------------------------------------------------
def run_lion_reference(hyper, groups, lrs, params0, grads, device):
    beta1, beta2 = hyper["betas"]
    params = [p.clone().to(device) for p in params0]
    m = [torch.zeros_like(p) for p in params]
    traj = []
    for t in range(STEPS):
        lr = lrs[t]
        for grp in groups:
            wd = grp["weight_decay"]
            for i in grp["tensors"]:
                g = grads[t][i].to(device)
                p = params[i]
                if wd != 0.0:
                    p = p * (1.0 - lr * wd)
                c = m[i] * beta1 + g * (1.0 - beta1)
                params[i] = p + torch.sign(c) * (-lr)
                m[i] = m[i] * beta2 + g * (1.0 - beta2)
        traj.append(flat(params))
    return traj, {"exp_avg": flat(m)}


def cases():
    adamw = {"betas": (0.9, 0.999), "eps": 1e-8}
    sgd_m = {"momentum": 0.9, "dampening": 0.1}
    lamb = {
        "betas": (0.9, 0.999),
        "eps": 1e-6,
        "bias_correction": True,
        "grad_averaging": True,
        "max_grad_norm": 1.0,
        "use_nvlamb": False,
    }
    return [
        ("adamw", "adamw", torch.optim.AdamW, adamw, 0.1, 1e-3),
        ("adamw_amsgrad", "adamw", torch.optim.AdamW, {**adamw, "amsgrad": True}, 0.1, 1e-3),
        ("adam", "adam", torch.optim.Adam, adamw, 0.01, 1e-3),
        ("adam_amsgrad", "adam", torch.optim.Adam, {**adamw, "amsgrad": True}, 0.01, 1e-3),
        ("sgd", "sgd", torch.optim.SGD, {}, 1e-3, 1e-2),
        ("sgd_momentum", "sgd", torch.optim.SGD, sgd_m, 1e-3, 1e-2),
        (
            "sgd_nesterov",
            "sgd",
            torch.optim.SGD,
            {"momentum": 0.9, "nesterov": True},
            1e-3,
            1e-2,
        ),
        ("lamb", "lamb", None, lamb, 0.01, 1e-2),
        (
            "lamb_nvlamb_noclip",
            "lamb",
            None,
            {**lamb, "grad_averaging": False, "max_grad_norm": None, "use_nvlamb": True},
            0.01,
            1e-2,
        ),
        ("lion", "lion", None, {"betas": (0.9, 0.99)}, 0.1, 1e-4),
    ]


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(here, "fixtures"))
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible to torch")
    # Plain IEEE float32 math everywhere (no TF32; the ops here are elementwise anyway).
    torch.backends.cuda.matmul.allow_tf32 = False
    os.makedirs(args.out, exist_ok=True)

    params0, grads = make_inputs(args.seed)
    layout, offset = [], 0
    for (name, shape, _), p in zip(TENSORS, params0):
        layout.append({"name": name, "shape": list(shape), "offset": offset, "numel": p.numel()})
        offset += p.numel()
    save_file(
        {"params0": flat(params0), "grads": torch.stack([flat(g) for g in grads])},
        os.path.join(args.out, "inputs.safetensors"),
        metadata={
            "tensors": json.dumps(layout),
            "steps": str(STEPS),
            "seed": str(args.seed),
            "numel": str(offset),
        },
    )

    impl_torch = "torch default (single-tensor on cpu, foreach on cuda)"
    for name, kind, cls, hyper, wd, base_lr in cases():
        groups = groups_for(wd)
        lrs = lr_schedule(base_lr)
        if kind == "lamb":
            traj, state = run_lamb_reference(hyper, groups, lrs, params0, grads, args.device)
            impl = "reference formula: Apex FusedLAMB in plain torch ops (this script)"
        elif kind == "lion":
            traj, state = run_lion_reference(hyper, groups, lrs, params0, grads, args.device)
            impl = "reference formula: lion-pytorch in plain torch ops (this script)"
        else:
            traj, state = run_torch(cls, hyper, groups, lrs, params0, grads, args.device)
            impl = f"torch.optim.{cls.__name__}, {impl_torch}"
        meta = {
            "optimizer": kind,
            "hyper": {k: list(v) if isinstance(v, tuple) else v for k, v in hyper.items()},
            "groups": groups,
            "lrs": lrs,
            "implementation": impl,
            "torch_version": torch.__version__,
            "device": args.device,
        }
        tensors = {"trajectory": torch.stack(traj)}
        tensors.update({f"state.{k}": v for k, v in state.items()})
        path = os.path.join(args.out, f"{name}.safetensors")
        save_file(tensors, path, metadata={"case": json.dumps(meta)})
        moved = float((traj[-1] - flat(params0)).norm() / flat(params0).norm())
        print(f"{name}: {impl}; relative change after {STEPS} steps {moved:.3e} -> {path}")


if __name__ == "__main__":
    main()
