"""Progress display for one epoch: a rich bar on a terminal, plain lines otherwise.

The loop that drives a display calls it (``update(n)``) only when the iterations done reach ``due``
or the clock reaches ``due_time``, so most iterations cost two comparisons and a clock read, not a
Python call. ``advance()`` counts one iteration and does the same check, for loops that prefer it.
The step metrics (device tensors written by ``LogMetricByStepHook``) are turned into numbers only
when the display refreshes:
a few times a second for the bar; every ``every_fraction`` of the epoch (or ``every_s`` seconds)
for plain lines. rich is imported only when the bar is shown.
"""
from __future__ import annotations

import math
import sys
import time
from typing import Any, Mapping, Optional

__all__ = ["format_number", "format_step_metrics", "make_progress", "NoProgress", "PlainProgress", "RichProgress"]


def to_number(value: Any) -> Any:
    """A one-element tensor as a Python number (this is the host-device sync); other values unchanged."""
    if hasattr(value, "item") and callable(value.item) and getattr(value, "numel", lambda: 0)() == 1:
        return value.item()
    return value


def format_number(value: Any, precision: int = 5) -> str:
    """Floats to ``precision`` significant digits; tensors are read first; other values as ``str``."""
    value = to_number(value)
    if isinstance(value, float):
        return f"{value:.{precision}g}"
    return str(value)


def format_step_metrics(step_metrics: Optional[Mapping[str, Any]]) -> str:
    """``'loss=2.3026 lr=0.1'`` from ``states['step_metrics']`` (reads device tensors: call at refresh only)."""
    if not step_metrics:
        return ""
    return " ".join(f"{name}={format_number(value)}" for name, value in step_metrics.items())


def _clock(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def stdout_is_terminal() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


class NoProgress:
    """The display when ``display_progress`` is off or this is not rank 0."""

    due = math.inf  # iterations done at which the display next wants ``update``: never
    due_time = math.inf  # time.monotonic() at which it next wants ``update``: never

    def advance(self) -> None:
        pass

    def update(self, n: int) -> None:
        """``n`` iterations are done (called when ``n`` reaches ``due`` or the clock ``due_time``)."""

    def pause(self) -> None:
        """Stop drawing (an evaluation inside the epoch shows its own display)."""

    def resume(self) -> None:
        pass

    def close(self, n: Optional[int] = None) -> None:
        """The end of the display, after ``n`` iterations (the last count given, if None)."""


NO_PROGRESS = NoProgress()


class _Counter(NoProgress):
    """Counts iterations; a subclass defines ``_check(now)``: redraw or print if it is time, and set
    ``due`` / ``due_time`` for the next call."""

    def __init__(self, description: str, total: Optional[int], states: Mapping[str, Any]):
        self.description = description
        self.total = total
        self.states = states
        self.n = 0
        self.start = time.monotonic()

    def advance(self) -> None:
        self.n += 1
        if self.n >= self.due or time.monotonic() >= self.due_time:
            self.update(self.n)

    def update(self, n: int) -> None:
        self.n = n
        self._check(time.monotonic())

    def speed_and_eta(self, now: float):
        elapsed = max(now - self.start, 1e-9)
        speed = self.n / elapsed  # iterations per second
        eta = (self.total - self.n) / speed if (self.total is not None and speed > 0) else float("nan")
        return speed, eta

    def metrics_text(self) -> str:
        return format_step_metrics(self.states.get("step_metrics"))


class PlainProgress(_Counter):
    """One line per ``every_fraction`` of the epoch, at least every ``every_s`` seconds, and one at the end."""

    every_fraction = 0.1  # of the epoch's iterations
    every_s = 30.0  # seconds

    def __init__(self, description: str, total: Optional[int], states: Mapping[str, Any], stream=None):
        super().__init__(description, total, states)
        self.stream = stream
        self._every_n = max(1, int(math.ceil(total * self.every_fraction))) if total else None
        self._next_n = self._every_n
        self._last_time = self.start
        self._last_n = 0
        self._set_due()

    def _set_due(self) -> None:
        """The next line: at the next tenth of the epoch, or ``every_s`` after the last line."""
        self.due = self._next_n if self._next_n is not None else math.inf
        self.due_time = self._last_time + self.every_s

    def _check(self, now: float) -> None:
        if self.n >= self.due or now >= self.due_time:
            self._emit(now)

    def _emit(self, now: float) -> None:
        speed, eta = self.speed_and_eta(now)
        where = f"{self.n}/{self.total} ({100.0 * self.n / self.total:.0f}%)" if self.total else f"{self.n} it"
        line = f"{self.description} {where}, {speed:.2f} it/s"
        if self.total:
            line += f", ETA {_clock(eta)}"
        metrics = self.metrics_text()
        if metrics:
            line += f" | {metrics}"
        print(line, file=self.stream or sys.stdout, flush=True)
        self._last_time, self._last_n = now, self.n
        if self._every_n is not None:
            while self._next_n <= self.n:
                self._next_n += self._every_n
        self._set_due()

    def close(self, n: Optional[int] = None) -> None:
        if n is not None:
            self.n = n
        if self.n != self._last_n:
            self._emit(time.monotonic())


class RichProgress(_Counter):
    """A rich bar (description, bar, step/total, it/s, ETA, step metrics) redrawn every ``refresh_s`` seconds."""

    refresh_s = 0.25  # seconds between redraws

    def __init__(self, description: str, total: Optional[int], states: Mapping[str, Any], console=None):
        super().__init__(description, total, states)
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[rate]}"), TextColumn("{task.fields[metrics]}"),
                                  auto_refresh=False, console=console)
        self._task = self._progress.add_task(description, total=total, rate="", metrics="")
        self._progress.start()
        self._last_time = self.start
        self.due_time = self.start + self.refresh_s  # (``due`` stays inf: the bar redraws by time alone)

    def _check(self, now: float) -> None:
        if now >= self.due_time:
            self._refresh(now)

    def _refresh(self, now: float) -> None:
        speed, eta = self.speed_and_eta(now)
        rate = f"{speed:.2f} it/s" + (f" ETA {_clock(eta)}" if self.total else "")
        self._progress.update(self._task, completed=self.n, rate=rate, metrics=self.metrics_text())
        self._progress.refresh()
        self._last_time = now
        self.due_time = now + self.refresh_s

    def pause(self) -> None:
        self._progress.stop()

    def resume(self) -> None:
        self._progress.start()

    def close(self, n: Optional[int] = None) -> None:
        if n is not None:
            self.n = n
        self._refresh(time.monotonic())
        self._progress.stop()


def make_progress(enabled: bool, description: str, total: Optional[int], states: Mapping[str, Any]):
    """The display for one epoch: ``NoProgress`` when not ``enabled``, else a bar or plain lines by stdout's kind."""
    if not enabled:
        return NO_PROGRESS
    if stdout_is_terminal():
        return RichProgress(description, total, states)
    return PlainProgress(description, total, states)
