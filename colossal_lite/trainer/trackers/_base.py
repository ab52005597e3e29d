"""``Tracker``: the one interface through which the run's metric values leave the process."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

from ..history import History

__all__ = ["Tracker", "RunInfo"]


@dataclass
class RunInfo:
    """What a tracker is told when a ``fit`` starts.

    ``log_dir``: the run's folder (``fit(log_dir=...)``, else the ``SaveCheckpointHook``'s folder; None when the
    run has none). ``params``: the config, flattened to dotted keys (``'fp16.mode'``). ``history``: the records of
    the run so far (a resumed run's earlier ones; empty for a fresh run; the trainer's own: read it, do not change it). ``step``: the optimizer step this fit
    starts after. ``resumed_from``: the checkpoint the run was restored from, or None.
    """

    log_dir: Optional[Path]
    params: Dict[str, Any] = field(default_factory=dict)
    history: History = field(default_factory=History)
    step: int = 0
    resumed_from: Optional[Path] = None


class Tracker:
    """Receives the run's metric values; subclass it and override ``log_metrics`` (the rest is optional).

    The Trainer calls a tracker on rank 0 only: ``start`` once per ``fit`` (after a resume), ``log_metrics``
    with the values recorded since the last call (at an epoch's end, after an evaluation, before a checkpoint,
    and at least every ``Recorder.flush_every`` optimizer steps), ``log_checkpoint`` with the checkpoint written
    when ``fit`` ends, and ``finish`` when ``fit`` returns or fails (``status``: ``'FINISHED'``, ``'FAILED'``
    or ``'KILLED'`` for a preempted run). ``state_dict``/``load_state_dict`` carry what a resumed run needs to
    continue where this one was (a tracker's run id), saved in every trainer checkpoint.
    """

    def start(self, run: RunInfo) -> None:
        """A ``fit`` starts (or goes on after a resume)."""

    def log_metrics(self, metrics: Dict[str, float], step: int, epoch: int, time: float) -> None:
        """Values recorded at optimizer step ``step`` of epoch ``epoch`` (``time``: wall clock, seconds)."""
        raise NotImplementedError(f"{type(self).__name__} must define log_metrics(metrics, step, epoch, time)")

    def log_checkpoint(self, path: Path) -> None:
        """The checkpoint ``fit`` wrote when it ended (a folder)."""

    def finish(self, status: str = "FINISHED") -> None:
        """The ``fit`` is over; write what is buffered and close."""

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def require_dir(tracker: Tracker, own: Optional[Path], run: RunInfo, argument: str) -> Path:
    """The folder a tracker writes to: its own, else the run's; an error naming both ways to give one."""
    folder = own if own is not None else run.log_dir
    if folder is None:
        raise ValueError(f"{type(tracker).__name__} has nowhere to write: give it {argument}=..., or give fit a "
                         f"log_dir=... (or a SaveCheckpointHook, whose folder is then the run's)")
    return Path(folder)
