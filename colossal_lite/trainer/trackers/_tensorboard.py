"""``TensorBoardTracker``: the run's records as TensorBoard scalars."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional, Union

from ._base import RunInfo, Tracker, require_dir

__all__ = ["TensorBoardTracker", "summary_writer_class"]


def summary_writer_class(who: str = "TensorBoardTracker"):
    """``torch.utils.tensorboard.SummaryWriter``, or an ImportError that says what to install."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise ImportError(f"{who} needs the tensorboard package, which is not installed: "
                          f"pip install tensorboard (or pip install 'colossal_lite[tensorboard]')") from err
    return SummaryWriter


class TensorBoardTracker(Tracker):
    """Writes every record as a TensorBoard scalar (tag = the record's name, x = the optimizer step) to
    ``log_dir/tensorboard`` (``log_dir`` None: the run's folder). A resumed run purges the points a crashed run
    wrote after its checkpoint, so each step has one point.

    ``TensorboardHook`` (the legacy hook, one folder per rank) writes through the same class.
    """

    def __init__(self, log_dir: Union[str, Path, None] = None, subdir: str = "tensorboard", filename_suffix: str = "",
                 who: str = "TensorBoardTracker"):
        self._writer_cls = summary_writer_class(who)  # fails where the tracker is made when tensorboard is missing
        self.log_dir: Optional[Path] = None if log_dir is None else Path(log_dir)
        self.subdir = subdir
        self.filename_suffix = filename_suffix
        self.writer = None

    def start(self, run: RunInfo) -> None:
        folder = require_dir(self, self.log_dir, run, "log_dir") / self.subdir
        self.open(folder, purge_step=run.step + 1 if run.step else None)

    def open(self, folder: Path, purge_step: Optional[int] = None) -> None:
        """Write to ``folder`` from now on (``purge_step``: earlier files' points from that step on are hidden)."""
        folder.mkdir(parents=True, exist_ok=True)
        self.writer = self._writer_cls(log_dir=str(folder), purge_step=purge_step,
                                       filename_suffix=self.filename_suffix)

    def log_metrics(self, metrics: Dict[str, float], step: int, epoch: int = 0, time: Optional[float] = None) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step, walltime=time)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def finish(self, status: str = "FINISHED") -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
