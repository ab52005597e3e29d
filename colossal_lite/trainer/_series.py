"""``StepSeries``: one metric's per-step values, kept without a host-device sync until they are read together."""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch

from ..core.dist import all_reduce_sum_, world_size
from .progress import to_number

__all__ = ["StepSeries", "drain_series"]

Point = Tuple[int, float]


class StepSeries:
    """One metric's per-step points until they are read.

    A device value is held as it is for a few steps, then ``fold_every`` of them are copied into a
    preallocated float32 buffer on their device with one stack (no host sync, and one kernel per
    ``fold_every`` steps instead of one per step), so only a few small tensors are alive at a time (hundreds of
    them fragment the CPU heap); a host number is kept as it is. ``drain`` reads the buffer with one device
    transfer; ``drain_series`` reads several series with one transfer, averaged over the ranks if asked.
    """

    fold_every = 16

    def __init__(self, capacity: int, name: str = "metric", average: bool = True):
        self.capacity = capacity
        self.name = name
        self.average = average  # averaged over the ranks by ``drain_series`` (False: the same on every rank)
        self.buffer: Optional[torch.Tensor] = None
        self.points: List[Tuple[int, Optional[float]]] = []  # (step, number or None: in the buffer)
        self.on_device = 0  # how many of the points are device values (in the buffer or held)
        self._held: List[torch.Tensor] = []  # device values not yet in the buffer

    def __len__(self) -> int:
        return len(self.points)

    def add(self, value: Any, step: int) -> bool:
        """Keep one point; True when the series is full."""
        if isinstance(value, torch.Tensor):
            if self.buffer is None:
                self.buffer = torch.empty(self.capacity, dtype=torch.float32, device=value.device)
            if value.requires_grad:
                value = value.detach()
            if value.dim():
                if value.numel() != 1:
                    raise ValueError(f"train metric {self.name!r} gave a step value of shape {tuple(value.shape)}; "
                                     f"a per-step value must be one number (or set the metric's epoch_only so it "
                                     f"is recorded once per epoch)")
                value = value.reshape(())
            self._held.append(value)
            self.on_device += 1
            self.points.append((step, None))
            if len(self._held) >= self.fold_every:
                self.fold()
        else:
            self.points.append((step, value if type(value) is float else to_number(value)))
        return len(self.points) >= self.capacity

    def fold(self) -> None:
        """Copy the held device values into the buffer (one stack, one copy)."""
        held, self._held = self._held, []
        if held:
            end = self.on_device
            self.buffer[end - len(held):end].copy_(torch.stack(held))

    def drain(self) -> List[Point]:
        """This rank's points, in order, as Python numbers; the series is empty afterwards."""
        return drain_series([self], average=False)[0]


def drain_series(series: Sequence[StepSeries], average: bool = True,
                 device: Optional[torch.device] = None) -> List[List[Point]]:
    """The points of every series (emptied), read with one device transfer. With ``average`` and several ranks,
    the values of each series whose ``average`` is set are averaged over the ranks first (one all-reduce: a
    collective, so every rank calls it with series of the same lengths). ``device``: where host numbers are
    reduced (the process group's device), when no series has a buffer."""
    for s in series:
        s.fold()
    reduced = [average and world_size() > 1 and s.average and bool(s.points) for s in series]
    # one tensor: the device values of the averaged series and their host numbers (all-reduced), then the
    # device values of the others
    summed = [s.buffer[:s.on_device] for s, r in zip(series, reduced) if r and s.on_device]
    host = [number for s, r in zip(series, reduced) if r for _, number in s.points if number is not None]
    kept = [s.buffer[:s.on_device] for s, r in zip(series, reduced) if not r and s.on_device]
    values: List[float] = []
    if any(reduced):
        where = summed[0].device if summed else (device or torch.device("cpu"))
        flat = torch.cat([p.to(torch.float64) for p in summed] + [torch.tensor(host, dtype=torch.float64,
                                                                               device=where)])
        values = (all_reduce_sum_(flat) / world_size()).tolist()
    if kept:
        values += torch.cat([p.to(torch.float64) for p in kept]).tolist()
    return _rebuild(series, reduced, values)


def _rebuild(series: Sequence[StepSeries], reduced: List[bool], values: List[float]) -> List[List[Point]]:
    """The points of each series with the numbers read (``values`` in ``drain_series``'s order) in place of
    what was on the device, and the averaged host numbers in place of the host ones; empties the series."""
    read = iter(values)
    on_device = {i: [next(read) for _ in range(s.on_device)] for i, s in enumerate(series) if reduced[i]}
    averaged_host = {i: [next(read) for _, n in s.points if n is not None] for i, s in enumerate(series) if reduced[i]}
    on_device.update({i: [next(read) for _ in range(s.on_device)] for i, s in enumerate(series) if not reduced[i]})
    out = []
    for i, s in enumerate(series):
        device_values, host_values = iter(on_device[i]), iter(averaged_host.get(i, ()))
        out.append([(step, next(device_values) if number is None else (next(host_values) if reduced[i] else number))
                    for step, number in s.points])
        s.points, s.on_device = [], 0
    return out
