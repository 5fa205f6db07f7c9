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

`--deepfm-data DIR`: the same DeepFM trained on the batches `tilearn ctr bench --export DIR`
wrote (synthetic Criteo-shaped samples, ids already hashed into tilearn's tables, in tilearn's
step order), with tilearn's initialisation scheme and hyper-parameters from DIR/meta.json; it
reports samples/s (every step synchronised by reading its loss, as tilearn's loop does) and the
exact AUC on the exported held-out split after the same samples. The samples are moved to the
GPU once before timing (tilearn uploads each batch inside its timed loop).

One JSON line per measurement. Run on the GPU machine in the same call as `recsys-bench`:

    python3 benches/pytorch_recsys_baseline.py --op --rows 100000 --dim 16 --batch 16384
    python3 benches/pytorch_recsys_baseline.py --deepfm --batch 16384
    python3 benches/pytorch_recsys_baseline.py --deepfm-data DIR
"""
import argparse
import json
import pathlib
import statistics
import time

import numpy as np
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

    def __init__(self, field_rows, k, dense, hidden):
        super().__init__()
        self.emb = torch.nn.ModuleList(
            [torch.nn.EmbeddingBag(r, k, mode="sum", sparse=True) for r in field_rows])
        self.first = torch.nn.ModuleList(
            [torch.nn.EmbeddingBag(r, 1, mode="sum", sparse=True) for r in field_rows])
        self.dense_w = torch.nn.Linear(dense, 1)
        layers, width = [], len(field_rows) * k + dense
        for h in hidden:
            layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
            width = h
        layers.append(torch.nn.Linear(width, 1))
        self.mlp = torch.nn.Sequential(*layers)

    def tilearn_init_(self):
        """tilearn's scheme: tables uniform in +-1/sqrt(rows) (FBGEMM's default), the global
        bias 0; torch's Linear default (+-1/sqrt(fan_in)) is tilearn's for the rest."""
        with torch.no_grad():
            for table in list(self.emb) + list(self.first):
                bound = table.weight.shape[0] ** -0.5
                table.weight.uniform_(-bound, bound)
            self.dense_w.bias.zero_()

    def forward(self, ids, offsets, dense):
        """ids / offsets: one (ids, offsets) per field, or ids per field sharing `offsets`."""
        if not isinstance(offsets, list):
            offsets = [offsets] * len(ids)
        v = torch.stack([e(i, o) for e, i, o in zip(self.emb, ids, offsets)], dim=1)  # [B, F, k]
        first = sum(f(i, o) for f, i, o in zip(self.first, ids, offsets)).squeeze(1)
        fm = 0.5 * (v.sum(1).pow(2) - v.pow(2).sum(1)).sum(1)
        deep = self.mlp(torch.cat([v.flatten(1), dense], dim=1)).squeeze(1)
        return first + fm + deep + self.dense_w(dense).squeeze(1)


def bench_deepfm(a):
    gen = torch.Generator().manual_seed(2)
    model = DeepFM([a.rows] * a.tables, a.dim, 13, a.hidden).cuda()
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


MISSING = 2**32 - 1  # an empty field in the exported ids


def exact_auc(scores, labels):
    """Mann-Whitney AUC with tied scores sharing their mean rank (tilearn_recsys::auc)."""
    scores = np.asarray(scores, dtype=np.float64)
    positive = np.asarray(labels) > 0.5
    p, n = int(positive.sum()), int((~positive).sum())
    if p == 0 or n == 0:
        return None
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    starts = np.cumsum(counts) - counts  # 0-based first rank of each distinct score
    mean_rank = starts + (counts + 1) / 2.0
    rank_sum = mean_rank[inverse][positive].sum()
    return float((rank_sum - p * (p + 1) / 2.0) / (p * n))


def load_split(d, name, meta, dev):
    n, fields, nd = meta[f"{name}_samples"], len(meta["field_rows"]), meta["num_dense"]
    ids = np.fromfile(d / f"{name}_ids.u32", dtype=np.uint32).reshape(n, fields)
    dense = np.fromfile(d / f"{name}_dense.f32", dtype=np.float32).reshape(n, nd)
    labels = np.fromfile(d / f"{name}_labels.f32", dtype=np.float32)
    return (torch.from_numpy(ids.astype(np.int64)).to(dev), torch.from_numpy(dense).to(dev),
            torch.from_numpy(labels).to(dev))


def jagged(ids):
    """Per field: the present ids and the offsets of one bag (0 or 1 id) per sample."""
    out = []
    for f in range(ids.shape[1]):
        col = ids[:, f]
        present = col != MISSING
        counts = present.long()
        offsets = torch.cumsum(counts, 0) - counts
        out.append((col[present], offsets))
    return [i for i, _ in out], [o for _, o in out]


def train_deepfm_on(a):
    d = pathlib.Path(a.deepfm_data)
    meta = json.loads((d / "meta.json").read_text())
    # The CPU only for a smoke test of the script on a machine without a GPU.
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(a.seed)
    model = DeepFM(meta["field_rows"], meta["embed_dim"], meta["num_dense"], meta["hidden"]).to(dev)
    model.tilearn_init_()
    sparse = [p for n, p in model.named_parameters() if n.startswith(("emb", "first"))]
    dense = [p for n, p in model.named_parameters() if not n.startswith(("emb", "first"))]
    adamw = torch.optim.AdamW(dense, lr=meta["learning_rate"], weight_decay=0.0, fused=True)
    accs = [torch.zeros(p.shape[0], device=dev) for p in sparse]
    loss_fn = torch.nn.BCEWithLogitsLoss()
    ids, x, y = load_split(d, "train", meta, dev)
    batch, steps = meta["batch_size"], meta["steps"]
    sparse_lr = meta["sparse_learning_rate"]

    def step(i):
        rows = slice(i * batch, (i + 1) * batch)
        field_ids, offsets = jagged(ids[rows])
        loss = loss_fn(model(field_ids, offsets, x[rows]), y[rows])
        loss.backward()
        with torch.no_grad():
            for p, acc in zip(sparse, accs):
                rowwise_adagrad_(p, acc, p.grad, sparse_lr)
                p.grad = None
        adamw.step()
        adamw.zero_grad(set_to_none=True)
        return loss.item()  # synchronises, as tilearn reads each step's loss

    sync()
    start = time.perf_counter()
    ends, loss = [], float("nan")
    for i in range(steps):
        loss = step(i)
        ends.append(time.perf_counter() - start)
    warmup = min(meta.get("warmup", 5), steps - 1)
    durations = sorted(np.diff([0.0] + ends))
    steady = (steps - warmup) * batch / (ends[-1] - (ends[warmup - 1] if warmup else 0.0))
    eids, ex, ey = load_split(d, "eval", meta, dev)
    logits = []
    with torch.no_grad():
        for s in range(0, ex.shape[0], 16384):
            field_ids, offsets = jagged(eids[s:s + 16384])
            logits.append(model(field_ids, offsets, ex[s:s + 16384]))
    logits = torch.cat(logits)
    eval_loss = float(loss_fn(logits, ey))
    print(json.dumps(dict(
        bench="ctr_e2e", impl="pytorch", model="DeepFm",
        device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        batch=batch, steps=steps, samples=steps * batch,
        samples_per_sec=steps * batch / ends[-1], steady_samples_per_sec=steady,
        step_ms_median=durations[len(durations) // 2] * 1e3, final_train_loss=loss,
        eval_loss=eval_loss, eval_auc=exact_auc(logits.float().cpu().numpy(), ey.cpu().numpy()),
        ground_truth_auc=meta.get("ground_truth_auc"), data=f"preloaded on {dev.type}",
        torch=torch.__version__)))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--op", action="store_true", help="the embedding operator alone")
    p.add_argument("--deepfm", action="store_true", help="a DeepFM training step")
    p.add_argument("--deepfm-data", metavar="DIR",
                   help="train the DeepFM on the batches of `tilearn ctr bench --export DIR`")
    p.add_argument("--fbgemm", action="store_true", help="also time fbgemm_gpu's TBE")
    p.add_argument("--seed", type=int, default=0)
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
    if not (a.op or a.deepfm or a.deepfm_data):
        p.error("choose --op, --deepfm and/or --deepfm-data")
    if a.op:
        bench_op(a)
    if a.deepfm:
        bench_deepfm(a)
    if a.deepfm_data:
        train_deepfm_on(a)


if __name__ == "__main__":
    main()
