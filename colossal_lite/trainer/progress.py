"""Progress display for one epoch: a rich bar on a terminal, plain lines otherwise.

Both count batches: the loader's batches, which are micro-batches when gradient accumulation is on
(the display of an evaluation counts the same way), and say so in their text (``12/45 batches``).

The loop that drives a display calls it (``update(n)``) only when the iterations done reach ``due``
or the clock reaches ``due_time``, so most iterations cost two comparisons and a clock read, not a
Python call. ``advance()`` counts one iteration and does the same check, for loops that prefer it.
The step metrics (device tensors written by ``LogMetricByStepHook``) are turned into numbers only
when the display refreshes: a few times a second for the bar; at most every ``min_gap_s`` seconds
(and at the epoch's end) for plain lines. rich is imported only when the bar is shown.

A training epoch's display is also given the run's ``State``: when the run goes on past this epoch, the
epoch's ETA is followed by the whole run's, ``ETA 0:00:12 (run 0:03:40)``: the optimizer steps left in the
run, in batches, at this epoch's rate (evaluations not counted).
"""
from __future__ import annotations

import math
import sys
import time
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple

__all__ = ["format_number", "format_step_metrics", "make_progress", "NoProgress", "PlainProgress", "RichProgress"]

UNIT = "batches"  # what the displays count: loader batches (micro-batches with gradient accumulation)
RATE_UNIT = "batch/s"


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

    def __init__(self, description: str, total: Optional[int], states: Mapping[str, Any], run=None):
        self.description = description
        self.total = total
        self.states = states
        self.run = run  # the run's State (total_steps, steps_per_epoch, step), or None: no run ETA
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

    def run_eta(self, speed: float) -> Optional[float]:
        """Seconds left in the whole run at ``speed`` batches/s, or None when the run ends with this epoch
        (its ETA is the epoch's) or its length is unknown."""
        st = self.run
        if st is None or not (st.total_steps and st.steps_per_epoch and st.iters_per_epoch) or speed <= 0:
            return None
        if st.total_steps <= (st.epoch + 1) * st.steps_per_epoch:
            return None
        return max(st.total_steps - st.step, 0) * st.iters_per_epoch / st.steps_per_epoch / speed

    def eta_text(self, speed: float, eta: float) -> str:
        """``'ETA 0:00:12'``, or ``'ETA 0:00:12 (run 0:03:40)'`` when the run goes on past this epoch."""
        run_eta = self.run_eta(speed)
        return f"ETA {_clock(eta)}" + ("" if run_eta is None else f" (run {_clock(run_eta)})")

    def values(self) -> Dict[str, Any]:
        """The step metrics as numbers (reads device tensors: call at refresh only)."""
        return {name: to_number(v) for name, v in (self.states.get("step_metrics") or {}).items()}

    def metrics_text(self) -> str:
        return format_step_metrics(self.states.get("step_metrics"))


def speed_text(speed: float) -> str:
    """``'812 batch/s'``, ``'41.3 batch/s'``, ``'0.52 batch/s'``: about three significant digits."""
    decimals = 0 if speed >= 100 else 1 if speed >= 10 else 2
    return f"{speed:.{decimals}f} {RATE_UNIT}"


class PlainProgress(_Counter):
    """Lines for a log file, at a bounded rate: one at each tenth of the epoch (``every_fraction``) that
    comes at least ``min_gap_s`` after the previous line, one whenever ``every_s`` passes without a line,
    and always the epoch's last one. A short epoch prints its last line only; a long one a line per tenth,
    or per ``every_s`` when a tenth takes longer. A loader without a length has no tenths: its lines come by
    time alone (the loop reads the clock at every iteration anyway, so no count is needed to wake it)."""

    every_fraction = 0.1  # of the epoch's iterations
    min_gap_s = 10.0  # seconds: fewest between two lines inside an epoch
    every_s = 30.0  # seconds: most between two lines

    def __init__(self, description: str, total: Optional[int], states: Mapping[str, Any], stream=None, run=None):
        super().__init__(description, total, states, run)
        self.stream = stream
        self._every_n = max(1, int(math.ceil(total * self.every_fraction))) if total else None
        self._next_n = self._every_n
        self._last_time = self.start
        self._last_n = 0
        self._set_due()

    def _set_due(self) -> None:
        """The next check: at the next tenth of the epoch, or ``every_s`` after the last line."""
        self.due = self._next_n if self._next_n is not None else math.inf
        self.due_time = self._last_time + self.every_s

    def _check(self, now: float) -> None:
        if now >= self.due_time or (self.n >= self.due and now - self._last_time >= self.min_gap_s):
            self._emit(now)
            return
        self._pass_marks()  # a tenth reached too soon after the last line: wait for the next tenth
        self._set_due()

    def _pass_marks(self) -> None:
        if self._every_n is not None:
            while self._next_n <= self.n:
                self._next_n += self._every_n

    def _emit(self, now: float) -> None:
        speed, eta = self.speed_and_eta(now)
        if self.total:
            where = f"{self.n}/{self.total} {UNIT} ({100.0 * self.n / self.total:.0f}%)"
        else:
            where = f"{self.n} {UNIT}"
        line = f"{self.description} {where}, {speed_text(speed)}"
        if self.total:
            line += f", {self.eta_text(speed, eta)}"
        metrics = self.metrics_text()
        if metrics:
            line += f" | {metrics}"
        print(line, file=self.stream or sys.stdout, flush=True)
        self._last_time, self._last_n = now, self.n
        self._pass_marks()
        self._set_due()

    def close(self, n: Optional[int] = None) -> None:
        if n is not None:
            self.n = n
        if self.n != self._last_n:
            self._emit(time.monotonic())


SHORT_NAMES = {"accuracy": "acc", "throughput": "tput",  # the built-in step metrics' long names
               "samples_per_s": "samples/s", "samples_per_s_per_rank": "samples/s/rank",
               "tokens_per_s": "tokens/s", "tokens_per_s_per_rank": "tokens/s/rank"}


def compact_number(value: Any) -> str:
    """Three significant digits, or a whole number from 1000 on: ``0.937``, ``43497``."""
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    return str(value)


def info_candidates(rate: str, eta: str, values: Mapping[str, Any]) -> Iterator[str]:
    """The bar's right-hand text, from the fullest to the shortest: the metrics written in full, then
    compact, then without the rate, then dropping metrics from the last one (``LogMetricByStepHook``
    lists the loss first; the run's ETA goes before the last of them), then the ETA alone (the rate alone
    without a total), then nothing."""
    full = [f"{name}={format_number(v)}" for name, v in values.items()]
    short = [f"{SHORT_NAMES.get(name, name)}={compact_number(v)}" for name, v in values.items()]
    head = [rate, eta] if eta else [rate]
    yield " ".join(head + full)
    yield " ".join(head + short)
    keep = [eta] if eta else [rate]
    for k in range(len(short), 0, -1):
        yield " ".join(keep + short[:k])
    epoch_eta = eta.split(" (run ", 1)[0]
    if epoch_eta != eta:  # the run's ETA is dropped before the first metric (the loss) is
        yield " ".join([epoch_eta] + short[:1])
        keep = [epoch_eta]
    yield " ".join(keep)
    yield ""


def fit_line(width: int, description: str, count: str, candidates: Iterator[str], bar_min: int = 10,
             bar_max: int = 40) -> Tuple[str, int, str]:
    """(description, bar width, info) for a line of ``width`` cells with 4 columns and a space between
    each. The count is always kept; the bar gets at least ``bar_min`` cells (more as the width allows),
    the info text the fullest candidate that fits beside them; a description that still does not fit is
    cut with an ellipsis. Whatever is left goes to the bar, up to ``bar_max``."""
    bar_wanted = max(bar_min, min(bar_max, width // 6))
    fixed = len(description) + len(count) + 3
    info = ""
    for info in candidates:
        if fixed + bar_wanted + len(info) <= width:
            break
    room = width - len(count) - 3 - bar_min - len(info)
    if len(description) > room:
        description = description[: max(room - 1, 0)] + "…" if room > 0 else ""
    bar = min(bar_max, max(bar_min, width - len(description) - len(count) - 3 - len(info)))
    return description, bar, info


class RichProgress(_Counter):
    """A rich bar (description, bar, count, rate, ETA, step metrics) redrawn every ``refresh_s`` seconds,
    laid out to fit the console's width at each redraw (see ``fit_line``)."""

    refresh_s = 0.25  # seconds between redraws
    bar_min = 10  # cells: narrower, a bar no longer shows progress at a glance
    bar_max = 40  # cells: rich's own default

    def __init__(self, description: str, total: Optional[int], states: Mapping[str, Any], console=None,
                 run=None):
        super().__init__(description, total, states, run)
        from rich.progress import BarColumn, Progress, TextColumn
        from rich.table import Column

        self._bar = BarColumn(bar_width=self.bar_max)

        def text(field: str) -> TextColumn:
            return TextColumn("{task.%s}" % field, markup=False, table_column=Column(no_wrap=True))

        self._progress = Progress(text("description"), self._bar, text("fields[count]"), text("fields[info]"),
                                  auto_refresh=False, console=console)
        self._task = self._progress.add_task(description, total=total, count="", info="")
        self._layout(self.start, {})  # the first frame fits too (no metrics are read before the first step)
        self._progress.start()
        self._last_time = self.start
        self.due_time = self.start + self.refresh_s  # (``due`` stays inf: the bar redraws by time alone)

    def _check(self, now: float) -> None:
        if now >= self.due_time:
            self._refresh(now)

    def count_text(self) -> str:
        if self.total is None:
            return f"{self.n} {UNIT}"
        return f"{self.n:>{len(str(self.total))}}/{self.total} {UNIT}"

    def _layout(self, now: float, values: Mapping[str, Any]) -> None:
        """Set the columns' text and the bar's width for the console's width now (it can change)."""
        speed, eta = self.speed_and_eta(now)
        count = self.count_text()
        candidates = info_candidates(speed_text(speed), self.eta_text(speed, eta) if self.total else "", values)
        description, bar, info = fit_line(self._progress.console.width, self.description, count, candidates,
                                          self.bar_min, self.bar_max)
        self._bar.bar_width = bar
        self._progress.update(self._task, completed=self.n, description=description, count=count, info=info)

    def _refresh(self, now: float) -> None:
        self._layout(now, self.values())
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


def make_progress(enabled: bool, description: str, total: Optional[int], states: Mapping[str, Any], run=None):
    """The display for one epoch: ``NoProgress`` when not ``enabled``, else a bar or plain lines by stdout's kind.
    ``run`` (the run's ``State``, for a training epoch) adds the whole run's ETA."""
    if not enabled:
        return NO_PROGRESS
    display = RichProgress(description, total, states) if stdout_is_terminal() else \
        PlainProgress(description, total, states)
    display.run = run  # no ETA is shown before the first update, so the first frame needs no run
    return display
