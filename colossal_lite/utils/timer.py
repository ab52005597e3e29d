"""Wall-clock timers for training loops; every duration is in seconds."""
from __future__ import annotations

import time
from typing import Iterator

import torch

__all__ = ["Timer", "MultiTimer"]


class Timer:
    """A stopwatch measuring seconds with ``time.perf_counter``, optionally waiting for CUDA work first.

    ``sync_cuda=None`` synchronises only when CUDA is available and already initialised;
    ``True`` synchronises whenever CUDA is available; ``False`` never does.
    """

    def __init__(self, sync_cuda: bool | None = None):
        self._sync_cuda = sync_cuda
        self._start_time = 0.0
        self._elapsed = 0.0
        self._started = False
        self._history: list[float] = []

    def _synchronize(self) -> None:
        if self._sync_cuda is False or not torch.cuda.is_available():
            return
        if self._sync_cuda is None and not torch.cuda.is_initialized():
            return
        torch.cuda.synchronize()

    @property
    def has_history(self) -> bool:
        """Whether at least one duration was kept by ``stop(keep_in_history=True)``."""
        return len(self._history) > 0

    @property
    def current_time(self) -> float:
        """The ``perf_counter`` reading in seconds, taken after any CUDA synchronisation."""
        self._synchronize()
        return time.perf_counter()

    @property
    def is_running(self) -> bool:
        """Whether ``start()`` was called without a matching ``stop()``."""
        return self._started

    def start(self) -> None:
        """Start (or restart) timing from now."""
        self._start_time = self.current_time
        self._started = True

    def lap(self) -> float:
        """Seconds since ``start()``, leaving the timer running."""
        if not self._started:
            raise RuntimeError("Timer.lap() called before Timer.start()")
        return self.current_time - self._start_time

    def stop(self, keep_in_history: bool = False) -> float:
        """Stop the timer and return the seconds since ``start()``; optionally record them in the history."""
        if not self._started:
            raise RuntimeError("Timer.stop() called before Timer.start()")
        elapsed = self.current_time - self._start_time
        self._elapsed = elapsed
        self._started = False
        if keep_in_history:
            self._history.append(elapsed)
        return elapsed

    def get_history_mean(self) -> float:
        """Mean of the recorded durations in seconds (0.0 when the history is empty)."""
        return sum(self._history) / len(self._history) if self._history else 0.0

    def get_history_sum(self) -> float:
        """Sum of the recorded durations in seconds."""
        return sum(self._history)

    def get_elapsed_time(self) -> float:
        """Seconds measured by the last ``stop()`` (0.0 before any)."""
        return self._elapsed

    def reset(self) -> None:
        """Stop the timer and clear the last duration and the history."""
        self._started = False
        self._start_time = 0.0
        self._elapsed = 0.0
        self._history = []

    def __repr__(self) -> str:
        return f"Timer(running={self._started}, elapsed={self._elapsed:.6f}s, history={len(self._history)})"


class MultiTimer:
    """Named ``Timer`` objects created on first ``start``; when switched off, ``start``/``stop`` do nothing."""

    def __init__(self, on: bool = True, sync_cuda: bool | None = None):
        self._on = on
        self._sync_cuda = sync_cuda
        self._timers: dict[str, Timer] = {}

    def start(self, name: str) -> None:
        """Start the timer ``name``, creating it if needed."""
        if not self._on:
            return
        if name not in self._timers:
            self._timers[name] = Timer(sync_cuda=self._sync_cuda)
        self._timers[name].start()

    def stop(self, name: str, keep_in_history: bool = False) -> float | None:
        """Stop the timer ``name`` and return its seconds; ``None`` when this MultiTimer is off."""
        if not self._on:
            return None
        if name not in self._timers:
            raise KeyError(f"timer {name!r} was never started; known timers: {sorted(self._timers)}")
        return self._timers[name].stop(keep_in_history=keep_in_history)

    def get_timer(self, name: str) -> Timer:
        """The ``Timer`` called ``name``."""
        if name not in self._timers:
            raise KeyError(f"no timer named {name!r}; known timers: {sorted(self._timers)}")
        return self._timers[name]

    def reset(self, name: str | None = None) -> None:
        """Reset the timer ``name``, or every timer when ``name`` is None."""
        if name is None:
            for timer in self._timers.values():
                timer.reset()
        else:
            self.get_timer(name).reset()

    def is_on(self) -> bool:
        """Whether timing is enabled."""
        return self._on

    def set_status(self, mode: bool) -> None:
        """Enable (True) or disable (False) timing."""
        self._on = bool(mode)

    def __contains__(self, name: object) -> bool:
        return name in self._timers

    def __iter__(self) -> Iterator[tuple[str, Timer]]:
        return iter(list(self._timers.items()))

    def __len__(self) -> int:
        return len(self._timers)
