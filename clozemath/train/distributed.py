"""One worker among the ranks: joining torch.distributed through DeepSpeed, and the reductions over the ranks."""

from __future__ import annotations

import os
import socket
from typing import TypeVar

import torch
import torch.distributed as dist


def ensure_distributed_env() -> None:
    """Single-process defaults for the variables DeepSpeed reads, when no launcher (or Ray Train) set them."""
    if "RANK" in os.environ:
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    defaults = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


def init_distributed(device: torch.device) -> None:
    """Join torch.distributed through DeepSpeed; an existing process group (Ray Train's) is reused."""
    import deepspeed

    ensure_distributed_env()
    if device.type == "cpu":
        # DeepSpeed would compile its shared-memory all-reduce (a minute and more on a fresh machine, and a C++
        # compiler) for inference; training's collectives are torch.distributed's.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")


def world_size() -> int:
    """The ranks taking part (1 outside torch.distributed: one process alone)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def world_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def all_ranks_sum(values: list[float], device: torch.device) -> list[float]:
    """Sums over the ranks (on `device`: NCCL reduces GPU tensors only)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if world_size() > 1:
        dist.all_reduce(tensor)
    return tensor.tolist()


def all_ranks_reduce(value: int, op: dist.ReduceOp, device: torch.device) -> int:
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    if world_size() > 1:
        dist.all_reduce(tensor, op=op)
    return int(tensor.item())


T = TypeVar("T")


def from_rank_zero(value: T, device: torch.device) -> T:
    """Rank 0's `value` (picklable) on every rank."""
    if world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, device=device)
    return box[0]
