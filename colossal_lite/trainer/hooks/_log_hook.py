"""Hooks that report: metric lines per epoch, TensorBoard scalars, timings, memory.

Values that need a collective (epoch metrics) are computed on every rank, whichever rank writes.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Iterable, Optional, Union

from ...context.parallel_mode import ParallelMode
from ...core.dist import is_rank_0, log_rank_0  # log_rank_0 stays importable from here, where it used to live
from ...core.global_context import global_context as gpc
from ...logging import get_dist_logger
from ...utils.memory import report_memory_usage
from ...utils.timer import MultiTimer
from .._series import StepSeries
from ..progress import format_number
from ..time import Time
from ..trackers import TensorBoardTracker
from ._base_hook import BaseHook
from ._utils import bind_interval, due_at_epoch_end, make_interval

__all__ = ["LogByEpochHook", "LogMetricByEpochHook", "TensorboardHook", "LogTimingByEpochHook", "LogMemoryByEpochHook"]


def metrics_line(metrics: dict) -> str:
    """``'Loss = 0.51 | LR = 0.1'`` from a phase's metrics; reads epoch values (a collective: every rank calls it)."""
    parts = []
    for name, metric in metrics.items():
        if not getattr(metric, "in_log_line", True):  # (a speed report's phase seconds: read with the report)
            metric.get_accumulated_value()  # (still read on every rank: a collective)
            continue
        if hasattr(metric, "get_accumulated_info"):
            text = metric.get_accumulated_info()
        else:
            text = format_number(metric.get_accumulated_value())
        parts.append(f"{name} = {text}")
    return " | ".join(parts)


def _epoch_label(trainer, phase: str) -> str:
    if phase == "Test" and not trainer.state.fitting:
        return "[Evaluation]"
    return f"[Epoch {trainer.cur_epoch} / {phase}]"


class LogByEpochHook(BaseHook):
    """Base of hooks that act at the end of every ``interval`` (int epochs, or ``'2ep'``/``'100ba'``/``'0.5dur'``)."""

    def __init__(self, logger=None, interval: Union[int, str, Time] = 1, priority: int = 1):
        super().__init__(priority)
        self.logger = logger if logger is not None else get_dist_logger()
        self._interval = make_interval(interval, type(self).__name__)

    def after_hook_is_attached(self, trainer):
        bind_interval(self._interval, trainer, type(self).__name__)

    def _is_epoch_to_log(self, trainer) -> bool:
        return due_at_epoch_end(self._interval, trainer)


class LogMetricByEpochHook(LogByEpochHook):
    """Logs ``[Epoch e / Train]: Loss = ... | LR = ...`` every ``interval``, and ``[Epoch e / Test]: ...`` after each evaluation.

    ``e`` is ``trainer.cur_epoch`` (0-based). Evaluation outside ``fit`` is labelled ``[Evaluation]``.
    """

    def __init__(self, logger=None, interval: Union[int, str, Time] = 1, priority: int = 10):
        super().__init__(logger, interval, priority)

    def after_train_epoch(self, trainer):
        if self._is_epoch_to_log(trainer):
            line = metrics_line(trainer.states["metrics"]["train"])
            if line:
                log_rank_0(self.logger, f"{_epoch_label(trainer, 'Train')}: {line}")

    def after_test_epoch(self, trainer):
        line = metrics_line(trainer.states["metrics"]["test"])
        if line:
            log_rank_0(self.logger, f"{_epoch_label(trainer, 'Test')}: {line}")


class TensorboardHook(BaseHook):
    """Writes metrics as TensorBoard scalars to ``log_dir/{mode}_rank_{rank}`` (e.g. ``global_rank_0``).

    Training metrics that are not epoch-only (train ``Loss``, per-step ``LR``) get one point per optimizer
    step, tag ``'{name}/train'``, x = ``trainer.cur_step``; they are copied into a buffer on the device and
    written in batches (at most ``flush_every`` steps apart and at each epoch's end), so no step waits for the
    device.
    Epoch-only metrics and all test metrics get one point per epoch / evaluation. ``ranks``: the ranks
    (inside ``parallel_mode``) that write; None = all.
    """

    reads_train_output = False  # (BaseHook.reads_train_output)

    flush_every = 256  # buffered points before a write

    def __init__(self, log_dir: str, ranks: Optional[Iterable[int]] = None,
                 parallel_mode: ParallelMode = ParallelMode.GLOBAL, priority: int = 10):
        super().__init__(priority)
        if not isinstance(parallel_mode, ParallelMode):
            raise TypeError(f"TensorboardHook(parallel_mode=...) must be a ParallelMode, got {parallel_mode!r}")
        self._rank = gpc.get_local_rank(parallel_mode)
        self._tracker = TensorBoardTracker(filename_suffix=f"_rank_{self._rank}", who="TensorboardHook")
        self._is_valid_rank_to_log = ranks is None or self._rank in set(ranks)
        self.log_dir = os.path.join(str(log_dir), f"{parallel_mode.value}_rank_{self._rank}")
        self._series: Dict[str, StepSeries] = {}  # per-step points of the train metrics, by name

    @property
    def writer(self):
        """The ``SummaryWriter`` of this rank (None before the run starts, on a rank that does not write)."""
        return self._tracker.writer

    def _open(self, trainer) -> None:
        """Open the event file once the run stands where it starts: a run resumed from a checkpoint hides the points
        a crashed run wrote after it (``purge_step``), as ``TensorBoardTracker`` does, so each step has one point."""
        if self._is_valid_rank_to_log and self.writer is None:
            step = trainer.state.step
            self._tracker.open(Path(self.log_dir), purge_step=step + 1 if step else None)

    def before_train(self, trainer):
        self._open(trainer)  # (after a resume's restore)

    def _flush_pending(self) -> None:
        for name, series in self._series.items():
            for step, number in series.drain():
                self._tracker.log_metrics({f"{name}/train": number}, step)

    def after_train_iter(self, trainer, *args):
        if not (self._is_valid_rank_to_log and trainer.state.stepped) or trainer.state.test_mode:
            return  # (test mode's step is put back: its points would stand beside the real run's)
        step = trainer.state.step
        full = False
        for name, metric in trainer.states["metrics"]["train"].items():
            if not metric.epoch_only:
                value = metric.last_step_value()
                if value is not None:
                    series = self._series.get(name)
                    if series is None:
                        series = self._series[name] = StepSeries(self.flush_every, name)
                    full = series.add(value, step) or full
        if full:
            self._flush_pending()

    def _write_epoch_values(self, trainer, phase: str, only_epoch_only: bool) -> None:
        if trainer.state.test_mode:  # (every rank alike: the values' read below is a collective)
            return
        values = [(name, metric.get_accumulated_value())  # on every rank: a collective
                  for name, metric in trainer.states["metrics"][phase].items()
                  if metric.epoch_only or not only_epoch_only]
        if self._is_valid_rank_to_log:
            self._open(trainer)  # (trainer.evaluate alone has no before_train)
            self._flush_pending()
            self._tracker.log_metrics({f"{name}/{phase}": value for name, value in values}, trainer.state.step)
            self._tracker.flush()

    def after_train_epoch(self, trainer):
        self._write_epoch_values(trainer, "train", only_epoch_only=True)

    def after_test_epoch(self, trainer):
        self._write_epoch_values(trainer, "test", only_epoch_only=False)

    def after_train(self, trainer):
        if self.writer is not None:
            self._flush_pending()
            self._tracker.flush()

    def close(self) -> None:
        """Write what is buffered and close the event file."""
        if self.writer is not None:
            self._flush_pending()
            self._tracker.finish()


class LogTimingByEpochHook(LogByEpochHook):
    """Logs the trainer's timers: ``[Epoch e / Train]: Train-epoch: last = 1.2 s | Train-step: last = ..., mean = ... s``.

    Uses the Trainer's timer when it has one, else ``timer`` (a ``MultiTimer``; one is made if None)
    becomes the Trainer's timer for the run. The first ``ignore_num_train_steps`` training iterations
    are left out of the step mean (warm-up). Timing waits for the device at each timer start/stop.
    """

    reads_train_output = False  # (BaseHook.reads_train_output)

    def __init__(self, timer: Optional[MultiTimer], logger=None, interval: Union[int, str, Time] = 1, priority: int = 10,
                 log_eval: bool = True, ignore_num_train_steps: int = 0):
        super().__init__(logger, interval, priority)
        self._timer = timer
        self._log_eval = bool(log_eval)
        self._ignore = int(ignore_num_train_steps)
        self._steps_seen = 0
        self._step_sum = 0.0
        self._step_count = 0

    def after_hook_is_attached(self, trainer):
        super().after_hook_is_attached(trainer)
        self._timer = trainer.use_timer(self._timer)

    def after_train_iter(self, trainer, *args):
        if "Train-step" not in self._timer:
            return
        self._steps_seen += 1
        if self._steps_seen > self._ignore:
            self._step_sum += self._timer.get_timer("Train-step").get_elapsed_time()
            self._step_count += 1

    def _describe(self, prefix: str) -> str:
        parts = []
        for name, timer in self._timer:
            if not name.startswith(prefix):
                continue
            text = f"{name}: last = {timer.get_elapsed_time():.4g} s"
            if name == "Train-step":
                if self._step_count:
                    text += f", mean = {self._step_sum / self._step_count:.4g} s"
            elif timer.has_history:
                text += f", mean = {timer.get_history_mean():.4g} s"
            parts.append(text)
        return " | ".join(parts)

    def after_train_epoch(self, trainer):
        if self._is_epoch_to_log(trainer):
            msg = self._describe("Train")
            st = trainer.state  # (a loader without len: the steps this epoch took)
            spe = st.steps_per_epoch if st.steps_per_epoch is not None else st.step - st.epoch_start_step
            log_rank_0(self.logger, f"{_epoch_label(trainer, 'Train')}: {msg} | #steps/epoch = {spe}")

    def after_test_epoch(self, trainer):
        if self._log_eval:
            log_rank_0(self.logger, f"{_epoch_label(trainer, 'Test')}: {self._describe('Test')}")


class LogMemoryByEpochHook(LogByEpochHook):
    """Logs memory use (GPU, and process CPU memory with ``report_cpu`` or without CUDA) on rank 0:
    before training, after every ``interval`` of training, and after each evaluation (``log_eval``)."""

    def __init__(self, logger=None, interval: Union[int, str, Time] = 1, priority: int = 10, log_eval: bool = True,
                 report_cpu: bool = False):
        super().__init__(logger, interval, priority)
        self._log_eval = bool(log_eval)
        self._report_cpu = bool(report_cpu)

    def _report(self, message: str) -> None:
        if is_rank_0():
            report_memory_usage(message, self.logger, report_cpu=self._report_cpu)

    def before_train(self, trainer):
        self._report("Before-train")

    def after_train_epoch(self, trainer):
        if self._is_epoch_to_log(trainer):
            self._report(_epoch_label(trainer, "Train"))

    def after_test(self, trainer):
        if self._log_eval:
            self._report(_epoch_label(trainer, "Test"))
