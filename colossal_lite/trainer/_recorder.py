"""``Recorder``: the part of ``fit`` that records metric values into the ``History`` and hands them to trackers.

It runs as the last handler of each event, so it reads what the metric hooks have just updated. Per-step
values are kept on the device (``StepSeries``) and read together at a flush: before an epoch's or an
evaluation's values are recorded, before a checkpoint, at the end of ``fit`` and every ``flush_every`` optimizer
steps. A flush averages the per-step values over the ranks (one all-reduce), so every rank records the same
numbers and every rank takes part in it at the same points.
"""
from __future__ import annotations

import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..checkpoint.io import CheckpointWriteError
from ..core.dist import broadcast_object, is_rank_0, world_size
from ._series import StepSeries, drain_series
from .history import History
from .hooks._base_hook import BaseHook
from .hooks._metric_hook import LearningRateMetric
from .progress import to_number
from .trackers import RunInfo, Tracker

__all__ = ["Recorder", "flat_params"]


def flat_params(config: Any, prefix: str = "") -> Dict[str, Any]:
    """A nested config as ``{'fp16.mode': 'bf16', ...}`` (leaves as they are; a non-dict config gives {})."""
    out: Dict[str, Any] = {}
    if not isinstance(config, dict):
        return out
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat_params(value, name + "."))
        else:
            out[name] = value
    return out


def _number(value: Any) -> Optional[float]:
    """An epoch value as a float; None for what is not one number."""
    value = to_number(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


class Recorder(BaseHook):
    """Records the values of a ``fit`` into ``history`` and gives them to ``trackers`` (on rank 0)."""

    flush_every = 256  # optimizer steps kept on the device at most between two flushes

    def __init__(self, history: History, trackers: Sequence[Tracker] = (), log_dir=None, params=None):
        super().__init__()
        self.history = history
        self.trackers = list(trackers)
        self.log_dir = log_dir
        self.params = dict(params or {})
        self._step_metrics: List[Tuple[Any, StepSeries]] = []
        self._lr = StepSeries(self.flush_every, "lr", average=False)
        self._times: List[Tuple[int, int, float]] = []  # (step, epoch, wall time) of each step kept
        self._optimizer = None
        self._lr_used: Any = None  # the learning rate of the last optimizer step
        self._device = None
        self._writes = is_rank_0()
        self.started = False

    # -- fit's lifetime ---------------------------------------------------------------------------
    def before_train(self, trainer) -> None:
        st = trainer.state
        self.history.truncate(st.step)  # a run that goes on from an earlier position forgets what came after it
        self._optimizer, self._device = trainer.engine.optimizer, trainer.engine.device
        self._step_metrics = [(metric, StepSeries(self.flush_every, f"train/{name}_step"))
                              for name, metric in trainer.states["metrics"]["train"].items()
                              if not metric.epoch_only and not isinstance(metric, LearningRateMetric)]
        run = RunInfo(log_dir=self.log_dir, params=self.params, history=self.history, step=st.step,
                      resumed_from=trainer.restored_from)
        self.started = True  # (from here on a failing fit finishes the trackers, those that started included)
        error = self._start_trackers(run) if self._writes else None
        if world_size() > 1:  # rank 0's outcome, and what its trackers hold now (a run id), on every rank
            failure, states = broadcast_object((None if error is None else (type(error).__name__, str(error)),
                                                [tracker.state_dict() for tracker in self.trackers]))
            if failure is not None and error is None:
                kind = CheckpointWriteError if failure[0] == CheckpointWriteError.__name__ else RuntimeError
                raise kind(f"a tracker could not start: {failure[0]}: {failure[1]} (reported by rank 0)")
            if not self._writes:
                for tracker, state in zip(self.trackers, states):
                    tracker.load_state_dict(state)
        if error is not None:
            raise error

    def _start_trackers(self, run: RunInfo) -> Optional[BaseException]:
        """Start each tracker (rank 0); the error of the first that fails (every rank then raises one)."""
        try:
            for tracker in self.trackers:
                tracker.start(run)
        except Exception as err:  # noqa: BLE001 - raised on every rank by the caller
            return err
        return None

    def after_train(self, trainer) -> None:
        self.flush()
        session = trainer.checkpoints
        preempted = session is not None and session.preempted is not None
        final = session.last_saved if session is not None else None
        if self._writes and final is not None and not preempted:
            for tracker in self.trackers:
                tracker.log_checkpoint(final)
        self.finish("KILLED" if preempted else "FINISHED")

    def finish(self, status: str) -> None:
        """End the trackers (once); an error in one is a warning, so a failing run's own error is the one raised."""
        if not self.started:
            return
        self.started = False
        if not self._writes:
            return
        for tracker in self.trackers:
            try:
                tracker.finish(status)
            except Exception as err:  # noqa: BLE001 - reported, and the other trackers still finish
                warnings.warn(f"{type(tracker).__name__}.finish({status!r}) failed: {err!r}", stacklevel=2)

    # -- values -----------------------------------------------------------------------------------
    def after_optimizer_step(self, trainer) -> None:
        self._lr_used = self._optimizer.param_groups[0]["lr"]  # (a scheduler steps after this: the next step's)

    def after_train_iter(self, trainer, output, label, loss) -> None:
        st = trainer.state
        if not st.stepped:
            return
        step, full = st.step, False
        for metric, series in self._step_metrics:
            value = metric.last_step_value()
            if value is not None:
                full = series.add(value, step) or full
        full = self._lr.add(self._lr_used, step) or full
        self._times.append((step, st.epoch, time.time()))
        if full:
            self.flush()

    def after_train_epoch(self, trainer) -> None:
        self._record_values(trainer, "train")

    def after_test_epoch(self, trainer) -> None:
        if trainer.state.fitting:
            self._record_values(trainer, "test")

    def _record_values(self, trainer, phase: str) -> None:
        """The phase's metric values over the epoch or evaluation (a collective: every rank reads them alike)."""
        self.flush()
        st, now = trainer.state, time.time()
        values = {f"{phase}/{name}": _number(metric.get_accumulated_value())
                  for name, metric in trainer.states["metrics"][phase].items()
                  if not isinstance(metric, LearningRateMetric)}
        self._publish([(st.step, st.epoch, now, {name: value for name, value in values.items() if value is not None})])

    def record(self, step: int, epoch: int, values: Dict[str, float]) -> None:
        """Values a hook measured itself (a checkpoint's save times) into the history and the trackers, now."""
        self._publish([(step, epoch, time.time(), values)])

    def flush(self) -> None:
        """Read the per-step values kept so far into the history and the trackers (every rank calls it)."""
        if not self._times:
            return
        series = [s for _, s in self._step_metrics] + [self._lr]
        by_step: Dict[int, Dict[str, float]] = {}
        for s, points in zip(series, drain_series(series, average=True, device=self._device)):
            for step, value in points:
                by_step.setdefault(step, {})[s.name] = value
        times, self._times = self._times, []
        self._publish([(step, epoch, at, by_step.get(step, {})) for step, epoch, at in times])

    def _publish(self, points: List[Tuple[int, int, float, Dict[str, float]]]) -> None:
        """``(step, epoch, time, {name: value})`` into the history, then to the trackers (rank 0)."""
        self.history.add_points(points)
        if not (self._writes and self.trackers):
            return
        for step, epoch, at, metrics in points:
            if metrics:
                for tracker in self.trackers:
                    tracker.log_metrics(metrics, step=step, epoch=epoch, time=at)

