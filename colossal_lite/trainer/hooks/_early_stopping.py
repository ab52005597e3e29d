"""``EarlyStoppingHook``: stop training when a monitored metric stops improving."""
from __future__ import annotations

import math
from typing import Any, Dict, Optional

from ._base_hook import BaseHook
from ._log_hook import log_rank_0
from ._utils import resolve_metric

__all__ = ["EarlyStoppingHook"]


class EarlyStoppingHook(BaseHook):
    """Stops ``fit`` once ``patience`` checks in a row brought no improvement larger than ``min_delta``.

    ``monitor``: ``'test/Loss'``, ``'train/Loss'``, or a bare name (``'Loss'``: the test metric when
    ``fit`` evaluates, else the train one). It is checked each time that phase's epoch ends. The value is
    the epoch value reduced over all ranks, so every rank takes the same decision and stops at the same
    step. ``mode``: ``'min'`` (lower is better) or ``'max'``. A non-finite value never counts as better.
    """

    def __init__(self, monitor: str, mode: str = "min", patience: int = 3, min_delta: float = 0.0,
                 priority: int = 10, logger=None):
        super().__init__(priority)
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStoppingHook(mode={mode!r}): use 'min' (lower is better, e.g. a loss) "
                             f"or 'max' (higher is better, e.g. an accuracy)")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise ValueError(f"EarlyStoppingHook(patience={patience!r}): the number of checks without improvement "
                             f"to tolerate must be an int >= 0")
        if not min_delta >= 0:
            raise ValueError(f"EarlyStoppingHook(min_delta={min_delta!r}) must be >= 0")
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(f"EarlyStoppingHook(monitor={monitor!r}) must name a metric, e.g. 'test/Loss'")
        self.monitor = monitor
        self.mode = mode
        self.patience = patience
        self.min_delta = float(min_delta)
        self.logger = logger
        self.best: Optional[float] = None
        self.best_epoch: Optional[int] = None
        self.wait = 0
        self._phase: Optional[str] = None
        self._name: Optional[str] = None

    @property
    def watched_metrics(self):
        return (self.monitor,)

    def after_hook_is_attached(self, trainer):
        self._phase, self._name = None, None  # found by name at the first check (the trainer checked it exists)

    def before_train(self, trainer):
        """A run whose patience was already spent (resumed from its last checkpoint, or fit again) trains no
        further: its stop is kept in this hook's state, not in the progress. A larger ``patience`` goes on."""
        if self.wait and self.wait >= self.patience:
            self._stop(trainer, f"EarlyStoppingHook: {self.monitor} had not improved for {self.wait} checks when the "
                                f"run stopped (best {self._best_text()}); give a larger patience to train further")

    def _stop(self, trainer, reason: str) -> None:
        st = trainer.state
        st.stop_training, st.stop_reason = True, reason
        log_rank_0(self.logger, reason)

    def _best_text(self) -> str:
        return "none" if self.best is None else f"{self.best:.6g} at epoch {self.best_epoch}"

    def _target(self, trainer):
        if self._phase is None:
            self._phase, self._name = resolve_metric(trainer, self.monitor)
        return self._phase, self._name

    def _improved(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def _check(self, trainer) -> None:
        phase, name = self._target(trainer)
        value = trainer.states["metrics"][phase][name].get_accumulated_value()
        if self._improved(value):
            self.best, self.best_epoch, self.wait = value, trainer.cur_epoch, 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            self._stop(trainer, f"EarlyStoppingHook: {self._phase}/{self._name} did not improve by more than "
                                f"{self.min_delta:g} for {self.wait} checks (last {value:.6g}, best {self._best_text()})")

    def after_train_epoch(self, trainer):
        if trainer.state.fitting and self._target(trainer)[0] == "train":
            self._check(trainer)

    def after_test_epoch(self, trainer):
        st = trainer.state
        if st.fitting and not st.closing_evaluation and self._target(trainer)[0] == "test":
            self._check(trainer)

    def state_dict(self) -> Dict[str, Any]:
        return {"best": self.best, "best_epoch": self.best_epoch, "wait": self.wait}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.best = state.get("best")
        self.best_epoch = state.get("best_epoch")
        self.wait = int(state.get("wait", 0))
