"""Several processes with PyTorch's DistributedDataParallel: gloo on the CPU, NCCL on GPUs.

``torchrun --nproc_per_node=N -m attnlab train CONFIG.toml`` sets RANK, WORLD_SIZE, LOCAL_RANK and
MASTER_ADDR/PORT; :func:`from_environment` reads them and joins the process group. Only rank 0
writes checkpoints, metrics and plots.

Each global batch (``train.batch_size`` examples) is dealt out row by row: rank r takes rows
r, r+N, r+2N, ... . Every rank divides its summed loss by the *global* token count, and DDP averages
gradients over the N ranks, so the update equals that of one process on the whole batch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DistInfo", "from_environment", "shutdown", "all_reduce_sum", "broadcast_from_main"]


@dataclass(frozen=True)
class DistInfo:
    """This process's place among the training processes."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def from_environment(device: str) -> DistInfo:
    """Join the process group that torchrun describes; a single process when there is none."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistInfo()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return DistInfo(rank, world_size, local_rank)


def shutdown(info: DistInfo, *, wait_for_peers: bool = False) -> None:
    """Leave the process group; with ``wait_for_peers``, first wait until every process has come
    this far (the end of a successful run). A rank that tears its connections down while a peer
    still works on them can end a gloo worker thread with an exception, which aborts the process
    ("terminate called without an active exception", seen once on rank 1 of a 2-process test)."""
    if info.enabled and dist.is_initialized():
        if wait_for_peers:
            dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """The sum of ``value`` over all processes (itself when there is one)."""
    if info.enabled:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def broadcast_from_main(value: Any, info: DistInfo) -> Any:
    """Rank 0's ``value`` (any picklable object) on every process; ``value`` itself when there is one."""
    if not info.enabled:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
