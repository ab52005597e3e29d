"""Helpers shared by the built-in hooks: rank checks, the data-parallel all-reduce, intervals."""
from __future__ import annotations

from typing import Union

import torch
import torch.distributed as dist

from ...context.parallel_mode import ParallelMode
from ...core.global_context import global_context as gpc
from ..time import Interval, Time, TimeUnit


def is_rank_0() -> bool:
    return gpc.get_global_rank() == 0


def data_parallel_size() -> int:
    return gpc.get_world_size(ParallelMode.DATA)


def all_reduce_sum_(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over the data-parallel ranks in place. Every rank must call it."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=gpc.get_group(ParallelMode.DATA))
    return tensor


def make_interval(spec: Union[int, str, Time], owner: str) -> Interval:
    try:
        return Interval(spec)
    except ValueError as err:
        raise ValueError(f"{owner}(interval={spec!r}): {err}") from None


def bind_interval(interval: Interval, trainer) -> None:
    """Tell ``interval`` the run's shape when ``fit`` is running (``evaluate`` alone has none)."""
    st = trainer.state
    if st.steps_per_epoch and st.total_steps:
        interval.bind(st.steps_per_epoch, st.total_steps)


def due_at_epoch_end(interval: Interval, trainer) -> bool:
    """Whether an epoch-end action with this interval runs now.

    ep intervals: when the epochs completed (``cur_epoch + 1``) are a multiple of the interval;
    ba/dur intervals: when a multiple of the interval's steps fell inside this epoch.
    Always True outside ``fit`` (no run shape to count against).
    """
    st = trainer.state
    if interval.unit is TimeUnit.EPOCH:
        return interval.is_epoch_boundary(st.epoch + 1)
    if interval.total_steps is None:
        return True
    period = max(1, interval.to_steps())
    return st.step // period > st.epoch_start_step // period


def device_of(trainer) -> torch.device:
    return trainer.engine.device
