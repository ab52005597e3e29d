"""Where a run's time goes: a timeline of phases, each switch a mark on a clock, read later without a host sync.

A clock makes marks and tells the seconds between two of them once they are done. ``HostClock`` marks with
``time.perf_counter`` (the CPU's time is the host's). ``DeviceClock`` records CUDA events on the current
stream, so a span is the device's time between two points of the host program: work the device overlapped with
the host's costs nothing there, which is what "where the time went" means for a run that waits on its device.
Its events are read only when the timeline is settled (``settle``), at points where the run reads the device
anyway.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple

import torch

__all__ = ["HostClock", "DeviceClock", "Timeline", "make_clock"]


class HostClock:
    """Marks are ``time.perf_counter()`` readings."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def wait(self, last: Any) -> None:
        """Block until the mark ``last`` is done (a host mark is done when made)."""

    def done(self, mark: Any) -> bool:
        """Whether ``mark`` is done, without waiting."""
        return True

    def release(self, spans, keep: Any) -> None:
        """The ``(phase, start, end)`` spans are read: a clock may reuse their marks, all but those in ``keep``
        (a collection of marks still in use). Host marks are numbers: nothing to reuse."""


class DeviceClock(HostClock):
    """Marks are CUDA events (timing enabled) recorded on the current stream of ``device``; spent events are
    reused, so a long run makes a bounded number of them."""

    def __init__(self, device: torch.device):
        self.device = device
        self._free: List[Any] = []

    def mark(self):
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1000.0

    def wait(self, last) -> None:
        last.synchronize()

    def done(self, mark) -> bool:
        return mark.query()

    def release(self, spans, keep) -> None:
        # a mark ends one span and starts the next: each event once
        kept = {id(m) for m in keep}
        self._free.extend({id(m): m for _, a, b in spans for m in (a, b) if id(m) not in kept}.values())


def make_clock(device: torch.device) -> HostClock:
    """The clock for a run on ``device``: CUDA events on a GPU, the host's clock elsewhere."""
    return DeviceClock(device) if device.type == "cuda" else HostClock()


class Timeline:
    """The run as a sequence of phases: ``switch(phase)`` ends the running phase and starts ``phase`` at one
    mark. ``settle()`` reads the spans made since the last settle into ``totals`` (seconds by phase)."""

    #: Spans kept unread before those the device has finished are read without waiting: an epoch of any length
    #: then holds a bounded number of marks (on a GPU, CUDA events).
    cap = 512

    def __init__(self, clock: HostClock):
        self.clock = clock
        self.phase: Optional[str] = None
        self._start: Any = None
        self._spans: List[Tuple[str, Any, Any]] = []
        self.totals: Dict[str, float] = defaultdict(float)

    def switch(self, phase: Optional[str]) -> Optional[str]:
        """Start ``phase`` now (None: time nothing from here); -> the phase that was running."""
        now = self.clock.mark()
        previous = self.phase
        if previous is not None:
            self._spans.append((previous, self._start, now))
        self.phase, self._start = phase, now
        if len(self._spans) > self.cap:  # (after the running phase's start is ``now``: that mark stays in use)
            self._settle_done()
        return previous

    def split(self, at: Any, phase: str) -> None:
        """The running phase ended at the earlier mark ``at``; ``phase`` ran from there until now."""
        if self.phase is not None:
            self._spans.append((self.phase, self._start, at))
        self.phase, self._start = phase, at

    def settle(self) -> Dict[str, float]:
        """Read the spans made so far (on a device clock this waits for the device once); -> ``totals``."""
        spans, self._spans = self._spans, []
        if spans:
            self.clock.wait(spans[-1][2])
            self._read(spans)
        return self.totals

    def _settle_done(self) -> None:
        """Read the oldest spans whose end the clock has reached, without waiting."""
        n = 0
        while n < len(self._spans) and self.clock.done(self._spans[n][2]):
            n += 1
        if n:
            spans, self._spans = self._spans[:n], self._spans[n:]
            self._read(spans)

    def _read(self, spans) -> None:
        for phase, start, end in spans:
            self.totals[phase] += self.clock.seconds(start, end)
        # the marks the spans not yet read and the running phase still use are kept
        self.clock.release(spans, [self._start, *(m for _, a, b in self._spans for m in (a, b))])
