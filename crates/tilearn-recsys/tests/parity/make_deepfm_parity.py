#!/usr/bin/env python3
"""Writes deepfm_parity.safetensors: a PyTorch DeepFM's loss over 200 training steps, from
initial weights and batches stored in the same file, for tilearn-recsys' `deepfm_parity` test.

The reference is written from the published architecture (Guo et al. 2017) in plain torch, with
tilearn's parameter layout so the weights map one to one:

    logit = bias + dense . w + sum_f first_f[id_f] + 0.5 * sum_j ((sum_f v_fj)^2 - sum_f v_fj^2)
            + MLP([v_1 .. v_F, dense])      (Linear + ReLU per hidden width, then Linear to 1)
    loss  = BCEWithLogitsLoss (mean)

Each field is one `nn.EmbeddingBag(mode="sum", sparse=True)` for its dim-k embeddings and one for
its first-order weight; an empty field is an empty bag (zeros). The dense part (w, bias, MLP) is
stepped by `torch.optim.AdamW(weight_decay=0)`; the tables by two sparse rules, one run each:
`torch.optim.SparseAdam` and FBGEMM's EXACT_ROWWISE_ADAGRAD written in torch ops (torch has no
row-wise Adagrad): `G[r] += mean(g_r^2)`, `w_r -= lr / (sqrt(G[r]) + eps) * g_r`.

Run with torch (CPU is enough):  python3 make_deepfm_parity.py [--out deepfm_parity.safetensors]

Tensors (all little-endian): `ids` u32 [steps * batch, fields] (row in the field's table,
0xFFFFFFFF for an empty field), `dense` f32 [steps * batch, num_dense], `labels` f32 [..],
`tables` f32 (tilearn's flat table buffer: the fields' [rows_f, k] embeddings, then their
[rows_f, 1] first-order weights), `dense_params` f32 (tilearn's DenseLayout: w [num_dense],
bias [1], then per layer W [out, in] and b [out]), `loss_adagrad` / `loss_adam` f64 [steps].
Metadata `config`: JSON with the shapes and hyper-parameters.
"""
import argparse
import json

import numpy as np
import torch
from safetensors.numpy import save_file

FIELD_ROWS = [23, 17, 31, 11, 7]
EMBED_DIM = 4
NUM_DENSE = 3
HIDDEN = [8, 6]
BATCH = 16
STEPS = 200
DENSE_LR = 3e-3
SPARSE_LR = {"adagrad": 0.05, "adam": 1e-2}
MISSING = 0xFFFFFFFF


def make_data(rng):
    n = STEPS * BATCH
    ids = np.stack([rng.integers(0, r, n) for r in FIELD_ROWS], axis=1).astype(np.uint32)
    ids[rng.random(ids.shape) < 0.1] = MISSING
    dense = rng.uniform(0.0, 3.0, (n, NUM_DENSE)).astype(np.float32)
    # Labels from a hidden logistic model of the ids, so the loss has something to learn.
    effect = [rng.normal(0.0, 1.0, r) for r in FIELD_ROWS]
    z = -0.5 + 0.3 * dense[:, 0] - 0.2 * dense[:, 1]
    for f, e in enumerate(effect):
        present = ids[:, f] != MISSING
        z[present] += e[ids[present, f]]
    labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-z))).astype(np.float32)
    return ids, dense, labels


def make_init(rng):
    k = EMBED_DIM
    tables = [rng.uniform(-(r ** -0.5), r ** -0.5, r * k) for r in FIELD_ROWS]
    tables += [rng.uniform(-(r ** -0.5), r ** -0.5, r) for r in FIELD_ROWS]
    dense = [rng.uniform(-(NUM_DENSE ** -0.5), NUM_DENSE ** -0.5, NUM_DENSE), np.zeros(1)]
    fan_in = len(FIELD_ROWS) * k + NUM_DENSE
    for out in HIDDEN + [1]:
        bound = fan_in ** -0.5
        dense += [rng.uniform(-bound, bound, out * fan_in), rng.uniform(-bound, bound, out)]
        fan_in = out
    return (np.concatenate(tables).astype(np.float32), np.concatenate(dense).astype(np.float32))


class DeepFM(torch.nn.Module):
    def __init__(self, tables, dense_params):
        super().__init__()
        k, fields = EMBED_DIM, len(FIELD_ROWS)
        self.emb = torch.nn.ModuleList(
            [torch.nn.EmbeddingBag(r, k, mode="sum", sparse=True) for r in FIELD_ROWS])
        self.first = torch.nn.ModuleList(
            [torch.nn.EmbeddingBag(r, 1, mode="sum", sparse=True) for r in FIELD_ROWS])
        self.linear = torch.nn.Linear(NUM_DENSE, 1)
        layers, width = [], fields * k + NUM_DENSE
        for h in HIDDEN:
            layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
            width = h
        layers.append(torch.nn.Linear(width, 1))
        self.mlp = torch.nn.Sequential(*layers)
        with torch.no_grad():
            at = 0
            for bag in list(self.emb) + list(self.first):
                n = bag.weight.numel()
                bag.weight.copy_(torch.from_numpy(tables[at:at + n]).view_as(bag.weight))
                at += n
            assert at == tables.size
            at = 0
            params = [self.linear.weight, self.linear.bias]
            params += [p for layer in self.mlp if isinstance(layer, torch.nn.Linear)
                       for p in (layer.weight, layer.bias)]
            for p in params:
                n = p.numel()
                p.copy_(torch.from_numpy(dense_params[at:at + n]).view_as(p))
                at += n
            assert at == dense_params.size

    def forward(self, ids, dense):
        bags = []
        for f in range(ids.shape[1]):
            present = ids[:, f] != MISSING
            counts = present.long()
            bags.append((ids[present, f], torch.cumsum(counts, 0) - counts))
        v = torch.stack([e(i, o) for e, (i, o) in zip(self.emb, bags)], dim=1)  # [B, F, k]
        first = sum(f(i, o) for f, (i, o) in zip(self.first, bags)).squeeze(1)
        fm = 0.5 * (v.sum(1).pow(2) - v.pow(2).sum(1)).sum(1)
        deep = self.mlp(torch.cat([v.flatten(1), dense], dim=1)).squeeze(1)
        return self.linear(dense).squeeze(1) + first + fm + deep


def rowwise_adagrad_(weight, acc, grad, lr, eps=1e-8):
    grad = grad.coalesce()
    rows, values = grad.indices()[0], grad.values()
    acc.index_add_(0, rows, values.pow(2).mean(dim=1))
    weight.index_add_(0, rows, -(lr / (acc[rows].sqrt() + eps)).unsqueeze(1) * values)


def train(rule, ids, dense, labels, tables, dense_params):
    model = DeepFM(tables, dense_params)
    sparse = [p for n, p in model.named_parameters() if n.startswith(("emb", "first"))]
    dense_ps = [p for n, p in model.named_parameters() if not n.startswith(("emb", "first"))]
    adamw = torch.optim.AdamW(dense_ps, lr=DENSE_LR, weight_decay=0.0, foreach=False)
    if rule == "adam":
        sparse_opt = torch.optim.SparseAdam(sparse, lr=SPARSE_LR["adam"])
    else:
        accs = [torch.zeros(p.shape[0]) for p in sparse]
    loss_fn = torch.nn.BCEWithLogitsLoss()
    ids = torch.from_numpy(ids.astype(np.int64))
    dense, labels = torch.from_numpy(dense), torch.from_numpy(labels)
    losses = []
    for step in range(STEPS):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        loss = loss_fn(model(ids[rows], dense[rows]), labels[rows])
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            if rule == "adam":
                sparse_opt.step()
                sparse_opt.zero_grad(set_to_none=True)
            else:
                for p, acc in zip(sparse, accs):
                    rowwise_adagrad_(p, acc, p.grad, SPARSE_LR["adagrad"])
                    p.grad = None
        adamw.step()
        adamw.zero_grad(set_to_none=True)
    return np.array(losses, dtype=np.float64)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="deepfm_parity.safetensors")
    a = p.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(16)
    ids, dense, labels = make_data(rng)
    tables, dense_params = make_init(rng)
    curves = {f"loss_{rule}": train(rule, ids, dense, labels, tables, dense_params)
              for rule in ("adagrad", "adam")}
    config = dict(field_rows=FIELD_ROWS, embed_dim=EMBED_DIM, num_dense=NUM_DENSE, hidden=HIDDEN,
                  batch=BATCH, steps=STEPS, dense_lr=DENSE_LR, sparse_lr=SPARSE_LR,
                  torch=torch.__version__)
    save_file(dict(ids=ids, dense=dense, labels=labels, tables=tables,
                   dense_params=dense_params, **curves), a.out,
              metadata={"config": json.dumps(config)})
    for name, curve in curves.items():
        print(f"{name}: {curve[0]:.5f} -> {curve[-1]:.5f} (mean of the last 20: "
              f"{curve[-20:].mean():.5f})")


if __name__ == "__main__":
    main()
