"""torch.distributed set-up shared by the multi-GPU baselines (pytorch_comm_baseline.py,
pytorch_ddp_baseline.py); both run under torchrun, which sets RANK, WORLD_SIZE and LOCAL_RANK.

NCCL's NVLink SHARP path (NVLS, multicast) must never be on for these runs on the lent H200
machines, so `init` sets NCCL_NVLS_ENABLE=0 before the process group exists and refuses any
other value.
`cpu=True` is a smoke test for machines without a GPU: gloo on CPU tensors.
"""
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def init(cpu=False, timeout_s=600):
    """Start the process group; return (rank, world, device). The device is cuda:LOCAL_RANK,
    bound to the NCCL communicator up front so every collective runs on that GPU."""
    nvls = os.environ.get("NCCL_NVLS_ENABLE")
    if nvls is None:
        os.environ["NCCL_NVLS_ENABLE"] = "0"
    elif nvls != "0":
        sys.exit(f"NCCL_NVLS_ENABLE={nvls}: NVLS must stay off for these baselines; "
                 "unset it or set NCCL_NVLS_ENABLE=0")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        if var not in os.environ:
            sys.exit(f"{var} is not set: run this script under torchrun "
                     "(torchrun --standalone --nproc-per-node N SCRIPT ...)")
    local_rank = int(os.environ["LOCAL_RANK"])
    timeout = timedelta(seconds=timeout_s)
    if cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device visible: run on the GPU machine (or --cpu for a smoke test)")
        if local_rank >= torch.cuda.device_count():
            sys.exit(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs visible: "
                     "lower --nproc-per-node")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    return dist.get_rank(), dist.get_world_size(), device


def sync(device):
    """Wait for the device's queued work (no-op on CPU, where ops are synchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def all_reduce_float(value, op, device):
    """One Python float reduced over ranks; op is "max" or "mean" (gloo has no AVG, so mean is
    a SUM divided by the world size)."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    out = t.item()
    return out / dist.get_world_size() if op == "mean" else out


def print0(record):
    """One JSON line on rank 0's stdout, flushed so torchrun's interleaving keeps it whole."""
    if dist.get_rank() == 0:
        print(json.dumps(record), flush=True)


def finish():
    dist.barrier()
    dist.destroy_process_group()
