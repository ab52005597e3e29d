"""Cross-rank helpers, in one place: who this process is, agreeing, sharing, and printing once.

Every function that communicates is a collective: every rank must call it, in the same order.
With no process group (a plain single-process run) they return at once and communicate nothing.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.distributed as dist

from ..logging import DistributedLogger, get_dist_logger

__all__ = ["is_distributed", "world_size", "rank", "is_rank_0", "broadcast_object", "all_gather_object", "barrier",
           "all_agree", "all_reduce_sum_", "all_reduce_min_", "all_reduce_max_", "all_gather_rows", "collective_device", "log_rank_0"]


def is_distributed() -> bool:
    """A process group is up (``launch`` or a hand-made ``init_process_group``)."""
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def is_rank_0() -> bool:
    return rank() == 0


def collective_device() -> torch.device:
    """Where the default process group's collectives take tensors: this rank's GPU for nccl, else the CPU (also
    with no process group, where nothing is communicated)."""
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` (any picklable object) on every rank."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> List[Any]:
    """Every rank's ``obj`` (any picklable object), in rank order."""
    if world_size() == 1:
        return [obj]
    out: List[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    """Wait until every rank has reached this call."""
    if world_size() > 1:
        dist.barrier()


def all_reduce_sum_(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over the ranks, in place; returns it."""
    if world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_min_(tensor: torch.Tensor) -> torch.Tensor:
    """The smallest value of ``tensor`` over the ranks, in place; returns it."""
    if world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return tensor


def all_reduce_max_(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """The largest value of ``tensor`` over the ranks (of ``group``; None: all), in place; returns it."""
    if world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def all_gather_rows(tensor: torch.Tensor) -> List[torch.Tensor]:
    """Every rank's ``tensor``, in rank order; the ranks' tensors may differ in their first dimension (the rest
    of the shape and the dtype must agree). Each is padded to the longest for the collective, then cut back."""
    if world_size() == 1:
        return [tensor]
    rows = torch.tensor([tensor.shape[0]], device=tensor.device)
    counts = [torch.zeros_like(rows) for _ in range(world_size())]
    dist.all_gather(counts, rows)
    counts = torch.cat(counts).tolist()  # (one read of every rank's count)
    longest = max(counts)
    padded = tensor.contiguous()
    if tensor.shape[0] < longest:
        padded = torch.cat([padded, padded.new_zeros((longest - tensor.shape[0],) + tuple(tensor.shape[1:]))])
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded)
    return [part[:n] for part, n in zip(parts, counts)]


def all_agree(ok: bool, device: Optional[torch.device] = None) -> bool:
    """True when ``ok`` is true on every rank. Reads one flag back to the host (so every rank decides alike);
    ``device`` is where the flag travels (the process group's device: CUDA with nccl)."""
    if world_size() == 1:
        return bool(ok)
    flag = torch.tensor([1.0 if ok else 0.0], device=device)
    return bool(all_reduce_min_(flag).item() > 0)


def log_rank_0(logger, message: str) -> None:
    """``logger.info(message)`` on rank 0 only; ``logger`` is a colossal_lite or a standard logger (None: the
    library's own). Nothing is communicated, so a rank that does not print never skips a collective."""
    if not is_rank_0():
        return
    if logger is None:
        logger = get_dist_logger()
    if isinstance(logger, DistributedLogger):
        logger.info(message, ranks=[0])
    else:
        logger.info(message)
