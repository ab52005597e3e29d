"""``TrainMetricSums``: the train metrics' sums of the epoch so far, carried over a resume inside an epoch."""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

__all__ = ["TrainMetricSums"]


class TrainMetricSums:
    """This rank's ``partial_state()`` of each train metric that has one (a part of the trainer's registry,
    per rank). A run resumed inside an epoch resets its metrics when the epoch begins; ``continue_epoch``
    then gives them the saved sums, so the epoch's values are the uninterrupted run's."""

    def __init__(self, train_metrics: Callable[[], Dict[str, Any]]):
        self._train_metrics = train_metrics
        self._saved: Optional[Dict[str, Any]] = None

    def state_dict(self) -> Dict[str, Any]:
        states = {}
        for name, metric in self._train_metrics().items():
            state = metric.partial_state() if hasattr(metric, "partial_state") else None
            if state is not None:
                states[name] = state
        return states

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        self._saved = dict(state) if state else None

    def continue_epoch(self, skip: int) -> None:
        """The epoch begins ``skip`` batches in: its metrics (just reset) continue the saved sums."""
        saved, self._saved = self._saved, None
        if not saved or not skip:
            return
        for name, metric in self._train_metrics().items():
            if name in saved and hasattr(metric, "load_partial_state"):
                metric.load_partial_state(saved[name])

    def forget(self) -> None:
        self._saved = None
