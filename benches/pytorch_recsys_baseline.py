#!/usr/bin/env python3
"""PyTorch baseline for tilearn-recsys' embedding-bag operator (`recsys-bench`) and DeepFM.

`--op`: 26 (by default) `nn.EmbeddingBag(mode="sum", sparse=True)` tables, zipf-skewed ids, the
same shapes and byte accounting as `recsys-bench` (forward: every entry's row read + the pooled
output written; backward + update: every entry's dout row read + each distinct row's weights read
and written + its optimizer state). The update is the matching optimizer: `torch.optim.SGD` or
`torch.optim.SparseAdam` on the sparse gradients, or row-wise Adagrad written with torch ops
(torch has no row-wise Adagrad; FBGEMM's TBE does: `--fbgemm` also times
`fbgemm_gpu`'s SplitTableBatchedEmbeddingBagsCodegen with EXACT_ROWWISE_ADAGRAD when it imports).

`--deepfm`: a PyTorch DeepFM with tilearn's layout (26 fields of dim k, first-order dim-1
tables, FM, MLP over embeddings + 13 dense features, BCE-with-logits), sparse row-wise Adagrad on
the tables and fused AdamW on the dense part, on random zipf batches: samples/s.

One JSON line per measurement. Run on the GPU machine in the same call as `recsys-bench`:

    python3 benches/pytorch_recsys_baseline.py --op --rows 100000 --dim 16 --batch 16384
    python3 benches/pytorch_recsys_baseline.py --deepfm --batch 16384
"""
import argparse
import json
import statistics

import torch


def zipf_ids(n, rows, s, gen):
    """Continuous power-law inversion, as tilearn_recsys::Zipf."""
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    if abs(s - 1.0) < 1e-9:
        x = torch.exp(torch.log(torch.tensor(rows + 1.0, dtype=torch.float64)) * u)
    else:
        a = 1.0 - s
        x = (((rows + 1.0) ** a - 1.0) * u + 1.0) ** (1.0 / a)
    return (x.floor().long().clamp(min=1) - 1).clamp(max=rows - 1)


def timed(fn, iters, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth():
    src = torch.empty(2 << 28, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), 20)
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def rowwise_adagrad_(weight, acc, grad, lr, eps=1e-8):
    """FBGEMM's EXACT_ROWWISE_ADAGRAD on a sparse (coalesced) gradient."""
    grad = grad.coalesce()
    rows, values = grad.indices()[0], grad.values()
    acc.index_add_(0, rows, values.pow(2).mean(dim=1))
    mult = lr / (acc[rows].sqrt() + eps)
    weight.index_add_(0, rows, -mult.unsqueeze(1) * values)


def bench_op(a):
    gen = torch.Generator().manual_seed(1)
    tables = [torch.nn.EmbeddingBag(a.rows, a.dim, mode="sum", sparse=True).cuda()
              for _ in range(a.tables)]
    ids = [zipf_ids(a.batch * a.bag, a.rows, a.zipf, gen).cuda() for _ in range(a.tables)]
    offsets = torch.arange(0, a.batch * a.bag, a.bag, device="cuda")
    unique = sum(int(torch.unique(i).numel()) for i in ids)
    params = [t.weight for t in tables]
    if a.optimizer == "sgd":
        opt, state_bytes = torch.optim.SGD(params, lr=0.01), 0
    elif a.optimizer == "adam":
        opt, state_bytes = torch.optim.SparseAdam(params, lr=1e-3), 8 * a.dim
    else:
        opt, state_bytes = None, 4
        accs = [torch.zeros(a.rows, device="cuda") for _ in range(a.tables)]
    dout = torch.full((a.batch, a.dim), 1e-3, device="cuda")

    def forward():
        return [t(i, offsets) for t, i in zip(tables, ids)]

    def step():
        outs = forward()
        torch.autograd.backward(outs, [dout] * len(outs))
        with torch.no_grad():
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                for t, acc in zip(tables, accs):
                    rowwise_adagrad_(t.weight, acc, t.weight.grad, 0.01)
                    t.weight.grad = None

    entries = a.tables * a.batch * a.bag
    row = 4 * a.dim
    fwd_bytes = entries * row + a.batch * a.tables * a.dim * 4
    bwd_bytes = entries * row + unique * (2 * row + state_bytes)
    copy = copy_bandwidth()
    with torch.no_grad():
        fwd_ms = timed(forward, a.iters)
    step_ms = timed(step, a.iters)
    for name, ms, nbytes in [("forward", fwd_ms, fwd_bytes),
                             ("forward_backward_update", step_ms, fwd_bytes + bwd_bytes)]:
        print(json.dumps(dict(bench="embedding_bag", impl="torch.nn.EmbeddingBag", **{"pass": name},
                              tables=a.tables, rows=a.rows, dim=a.dim, batch=a.batch, bag=a.bag,
                              zipf=a.zipf, optimizer=a.optimizer, unique_rows=unique,
                              ms_median=ms, gb_per_s=nbytes / (ms * 1e-3) / 1e9,
                              copy_gb_per_s=copy, torch=torch.__version__)))
    if a.fbgemm:
        bench_fbgemm(a, ids, entries, fwd_bytes, bwd_bytes, copy)


def bench_fbgemm(a, ids, entries, fwd_bytes, bwd_bytes, copy):
    try:
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            SplitTableBatchedEmbeddingBagsCodegen, EmbeddingLocation, ComputeDevice, OptimType)
    except Exception as e:  # noqa: BLE001 - report why, never crash the baseline
        print(json.dumps(dict(bench="embedding_bag", impl="fbgemm_gpu", error=str(e))))
        return
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(a.rows, a.dim, EmbeddingLocation.DEVICE, ComputeDevice.CUDA)] * a.tables,
        optimizer=OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.01).cuda()
    indices = torch.cat(ids).int()
    offsets = torch.arange(0, entries + 1, a.bag, device="cuda", dtype=torch.int32)
    dout = torch.full((a.batch, a.tables * a.dim), 1e-3, device="cuda")
    with torch.no_grad():
        fwd_ms = timed(lambda: tbe(indices, offsets), a.iters)
    step_ms = timed(lambda: tbe(indices, offsets).backward(dout), a.iters)
    for name, ms, nbytes in [("forward", fwd_ms, fwd_bytes),
                             ("forward_backward_update", step_ms, fwd_bytes + bwd_bytes)]:
        print(json.dumps(dict(bench="embedding_bag", impl="fbgemm_gpu", **{"pass": name},
                              ms_median=ms, gb_per_s=nbytes / (ms * 1e-3) / 1e9,
                              copy_gb_per_s=copy)))


class DeepFM(torch.nn.Module):
    """tilearn_recsys' DeepFM: first-order + FM over field embeddings + MLP(emb, dense)."""

    def __init__(self, fields, rows, k, dense, hidden):
        super().__init__()
        self.emb = torch.nn.ModuleList(
            [torch.nn.EmbeddingBag(rows, k, mode="sum", sparse=True) for _ in range(fields)])
        self.first = torch.nn.ModuleList(
            [torch.nn.EmbeddingBag(rows, 1, mode="sum", sparse=True) for _ in range(fields)])
        self.dense_w = torch.nn.Linear(dense, 1)
        layers, width = [], fields * k + dense
        for h in hidden:
            layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
            width = h
        layers.append(torch.nn.Linear(width, 1))
        self.mlp = torch.nn.Sequential(*layers)

    def forward(self, ids, offsets, dense):
        v = torch.stack([e(i, offsets) for e, i in zip(self.emb, ids)], dim=1)  # [B, F, k]
        first = sum(f(i, offsets) for f, i in zip(self.first, ids)).squeeze(1)
        fm = 0.5 * (v.sum(1).pow(2) - v.pow(2).sum(1)).sum(1)
        deep = self.mlp(torch.cat([v.flatten(1), dense], dim=1)).squeeze(1)
        return first + fm + deep + self.dense_w(dense).squeeze(1)


def bench_deepfm(a):
    gen = torch.Generator().manual_seed(2)
    model = DeepFM(a.tables, a.rows, a.dim, 13, a.hidden).cuda()
    sparse = [p for n, p in model.named_parameters() if n.startswith(("emb", "first"))]
    dense = [p for n, p in model.named_parameters() if not n.startswith(("emb", "first"))]
    adamw = torch.optim.AdamW(dense, lr=1e-3, weight_decay=0.0, fused=True)
    accs = [torch.zeros(p.shape[0], device="cuda") for p in sparse]
    ids = [zipf_ids(a.batch, a.rows, a.zipf, gen).cuda() for _ in range(a.tables)]
    offsets = torch.arange(a.batch, device="cuda")
    x = torch.rand(a.batch, 13, device="cuda")
    y = (torch.rand(a.batch, device="cuda") < 0.25).float()
    loss_fn = torch.nn.BCEWithLogitsLoss()

    def step():
        loss = loss_fn(model(ids, offsets, x), y)
        loss.backward()
        with torch.no_grad():
            for p, acc in zip(sparse, accs):
                rowwise_adagrad_(p, acc, p.grad, 0.02)
                p.grad = None
        adamw.step()
        adamw.zero_grad(set_to_none=True)

    ms = timed(step, a.iters)
    print(json.dumps(dict(bench="deepfm", impl="pytorch", batch=a.batch, fields=a.tables,
                          rows=a.rows, embed_dim=a.dim, hidden=a.hidden, ms_median=ms,
                          samples_per_sec=a.batch / (ms * 1e-3), torch=torch.__version__)))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--op", action="store_true", help="the embedding operator alone")
    p.add_argument("--deepfm", action="store_true", help="a DeepFM training step")
    p.add_argument("--fbgemm", action="store_true", help="also time fbgemm_gpu's TBE")
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=16_384)
    p.add_argument("--bag", type=int, default=1)
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--optimizer", choices=["adagrad", "adam", "sgd"], default="adagrad")
    p.add_argument("--hidden", type=lambda s: [int(x) for x in s.split(",")], default=[256, 128])
    p.add_argument("--iters", type=int, default=50)
    a = p.parse_args()
    if not (a.op or a.deepfm):
        p.error("choose --op and/or --deepfm")
    if a.op:
        bench_op(a)
    if a.deepfm:
        bench_deepfm(a)


if __name__ == "__main__":
    main()
