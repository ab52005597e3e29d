"""Progress display for one epoch: a rich bar on a terminal, plain lines otherwise.

The loop that drives a display tells it the iterations done only when ``due`` is reached
(``update(n)``), so most iterations cost a comparison, not a call: the display sets ``due`` from
the speed so far, to read the clock about as often as it may need to redraw (never after more
iterations than it has seen, so an early or changing speed is read again soon). ``advance()``
counts one iteration and does the same check, for loops that prefer it. The step metrics (device
tensors written by ``LogMetricByStepHook``) are turned into numbers only when the display refreshes:
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

    def advance(self) -> None:
        pass

    def update(self, n: int) -> None:
        """``n`` iterations are done (called when ``n`` reaches ``due``)."""

    def pause(self) -> None:
        """Stop drawing (an evaluation inside the epoch shows its own display)."""

    def resume(self) -> None:
        pass

    def close(self, n: Optional[int] = None) -> None:
        """The end of the display, after ``n`` iterations (the last count given, if None)."""


NO_PROGRESS = NoProgress()


class _Counter(NoProgress):
    """Counts iterations; a subclass defines ``_check(now)`` (redraw or print if it is time) and
    ``_next_check(now)`` (iterations until ``update`` should be called again)."""

    def __init__(self, description: str, total: Optional[int], states: Mapping[str, Any]):
        self.description = description
        self.total = total
        self.states = states
        self.n = 0
        self.start = time.monotonic()
        self.due = 1

    def advance(self) -> None:
        self.n += 1
        if self.n >= self.due:
            self.update(self.n)

    def update(self, n: int) -> None:
        self.n = n
        now = time.monotonic()
        self._check(now)
        self.due = n + self._next_check(now)

    def _iterations_in(self, seconds: float, now: float) -> int:
        """About how many iterations ``seconds`` hold at the speed so far: at least 1, at most the iterations
        seen (the speed of the first few is no guide; doubling the count re-reads it soon)."""
        speed = self.n / max(now - self.start, 1e-9)
        return max(1, min(self.n, int(speed * seconds)))

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

    def _check(self, now: float) -> None:
        if (self._next_n is not None and self.n >= self._next_n) or now - self._last_time >= self.every_s:
            self._emit(now)

    def _next_check(self, now: float) -> int:
        # the next line's count, and the clock about four times per every_s
        stride = self._iterations_in(self.every_s / 4, now)
        return stride if self._next_n is None else min(stride, self._next_n - self.n)

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

    def _check(self, now: float) -> None:
        if now - self._last_time >= self.refresh_s:
            self._refresh(now)

    def _next_check(self, now: float) -> int:
        return self._iterations_in(self.refresh_s / 2, now)

    def _refresh(self, now: float) -> None:
        speed, eta = self.speed_and_eta(now)
        rate = f"{speed:.2f} it/s" + (f" ETA {_clock(eta)}" if self.total else "")
        self._progress.update(self._task, completed=self.n, rate=rate, metrics=self.metrics_text())
        self._progress.refresh()
        self._last_time = now

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
