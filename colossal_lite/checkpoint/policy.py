"""Which checkpoints a run keeps and points at: the ``last``/``best`` pointers, the best metric, retention.

Storage (``writer.py``, ``layout.py``, ``pointers.py``) writes and reads folders; this module decides,
once a folder is complete, which pointers move to it and which older folders go.
"""
from __future__ import annotations

import math
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .io import DEL_PREFIX, CheckpointWriteError, _describe_os_error
from .layout import POINTERS, complete_checkpoints, is_complete, read_meta
from .pointers import read_pointer, write_pointer


def pointed_at(checkpoint_dir: Path, which: str) -> Optional[Path]:
    """The complete checkpoint the ``last`` or ``best`` pointer names, or ``None``."""
    target = read_pointer(checkpoint_dir / which)
    if target is None:
        return None
    path = checkpoint_dir / target
    return path if is_complete(path) is not None else None


class BestMetric:
    """The metric that picks the ``best`` checkpoint, its direction and the best value so far.

    ``save_best`` is ``None`` or ``(metric_name, 'min' | 'max')``. The best value is read back from the
    metadata of the checkpoint ``best`` names, so it survives a restart.
    """

    def __init__(self, save_best: Optional[Tuple[str, str]]):
        if save_best is not None:
            if not (isinstance(save_best, (tuple, list)) and len(save_best) == 2 and isinstance(save_best[0], str)
                    and save_best[1] in ("min", "max")):
                raise ValueError(f"save_best must be None or (metric_name, 'min' | 'max'), e.g. ('loss', 'min') or "
                                 f"('accuracy', 'max'); got {save_best!r}")
            save_best = (save_best[0], save_best[1])
        self.spec: Optional[Tuple[str, str]] = save_best
        self.value: Optional[float] = None

    def read_back(self, checkpoint_dir: Path) -> None:
        """Take the best value from the metadata of the checkpoint ``best`` names in ``checkpoint_dir``."""
        self.value = None
        if self.spec is None:
            return
        path = pointed_at(checkpoint_dir, "best")
        if path is None:
            return
        value = read_meta(path).get("metrics", {}).get(self.spec[0])
        self.value = float(value) if isinstance(value, (int, float)) else None

    def improves(self, metrics: Dict[str, Any]) -> bool:
        """True when ``metrics`` beat the best value so far (warns when the watched metric is missing)."""
        if self.spec is None:
            return False
        name, mode = self.spec
        value = metrics.get(name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
            if metrics and name not in metrics:
                warnings.warn(f"save_best watches metric {name!r} but this checkpoint's metrics have only "
                              f"{sorted(metrics)}; 'best' was not moved", stacklevel=5)
            return False
        if self.value is None:
            return True
        return value < self.value if mode == "min" else value > self.value


def check_keep_last_n(keep_last_n: Optional[int]) -> Optional[int]:
    if keep_last_n is not None and (isinstance(keep_last_n, bool) or not isinstance(keep_last_n, int)
                                    or keep_last_n < 1):
        raise ValueError(f"keep_last_n must be None (keep all) or an int >= 1, got {keep_last_n!r}")
    return keep_last_n


def move_pointers(checkpoint_dir: Path, target: Path, metrics: Dict[str, Any], save_last: bool,
                  best: BestMetric) -> None:
    """Point ``last`` at the new complete checkpoint ``target``, and ``best`` when its metrics improve."""
    try:
        if save_last:
            write_pointer(checkpoint_dir / "last", target.name)
        if best.spec is not None and best.improves(metrics):
            write_pointer(checkpoint_dir / "best", target.name)
            best.value = float(metrics[best.spec[0]])
    except OSError as e:
        raise CheckpointWriteError(f"checkpoint {target} was written but a pointer could not be moved: "
                                   f"{_describe_os_error(e)}") from e


def apply_retention(checkpoint_dir: Path, keep_last_n: Optional[int]) -> List[Path]:
    """Delete all but the ``keep_last_n`` newest checkpoints and those a pointer names; the deleted folders."""
    if keep_last_n is None:
        return []
    found = [p for p, _ in complete_checkpoints(checkpoint_dir)]
    keep = set(found[-keep_last_n:])
    for which in POINTERS:
        target = read_pointer(checkpoint_dir / which)
        if target is not None:
            keep.add(checkpoint_dir / target)
    deleted = []
    for path in found:
        if path in keep:
            continue
        doomed = checkpoint_dir / f"{DEL_PREFIX}{path.name}-{os.getpid()}"
        try:
            os.rename(path, doomed)  # atomic: a half-deleted folder never looks like a checkpoint
            shutil.rmtree(doomed)
        except OSError as e:
            warnings.warn(f"could not delete old checkpoint {path}: {_describe_os_error(e)}", stacklevel=4)
            continue
        deleted.append(path)
    return deleted
