"""``MetricsFile``: the run's records as ``metrics.jsonl`` (and ``metrics.csv``), one line per value."""
from __future__ import annotations

import csv
import io
import json
import math
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from ...checkpoint.io import CheckpointWriteError, atomic_write_text
from ...utils.metrics_file import METRICS_FILE_NAMES
from ..history import FIELDS
from ._base import RunInfo, Tracker, require_dir

__all__ = ["MetricsFile", "JSONL_NAME", "CSV_NAME"]

JSONL_NAME, CSV_NAME = METRICS_FILE_NAMES  # the names the reader (and so `colossal-lite plot`) looks for


def _jsonl(records: List[Dict[str, Any]]) -> str:
    return "".join(_json_line(r) for r in records)


def _json_line(r: Dict[str, Any]) -> str:
    """One record as a line of JSON. JSON has no NaN or infinity (Python's ``NaN`` and ``Infinity`` tokens are
    refused by strict readers, such as JavaScript's and jq): a NaN value, a figure the run has not got, is written
    ``null``, which the metrics reader takes back as NaN; an infinity ``1e999``, a number past a double's range,
    which Python and JavaScript read back as one."""
    value = r["value"]
    if isinstance(value, float) and not math.isfinite(value):
        text = "null" if math.isnan(value) else ("1e999" if value > 0 else "-1e999")
        return "{" + ", ".join(f"{json.dumps(k)}: {text if k == 'value' else json.dumps(r[k])}" for k in FIELDS) + "}\n"
    return json.dumps({k: r[k] for k in FIELDS}) + "\n"


def _csv(records: List[Dict[str, Any]], header: bool) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    if header:
        writer.writerow(FIELDS)
    writer.writerows([[r[k] for k in FIELDS] for r in records])
    return out.getvalue()


class MetricsFile(Tracker):
    """Writes every record to ``metrics.jsonl`` in ``log_dir`` (one JSON object per line: step, epoch, name,
    value, time), and with ``csv=True`` to ``metrics.csv`` too (header ``step,epoch,name,value,time``).

    ``log_dir``: the folder (None: the run's, i.e. ``fit(log_dir=...)`` or the checkpoint folder). ``fit`` adds
    one by default when the run has a folder. When a fit starts, the files are rewritten (atomically) with the
    records of the run so far, which a resumed run gets back from its checkpoint, so what a crashed run wrote
    after its last checkpoint is replaced by what the resumed run records: no step appears twice.
    """

    def __init__(self, log_dir: Union[str, Path, None] = None, csv: bool = False):
        self.log_dir: Optional[Path] = None if log_dir is None else Path(log_dir)
        self.csv = bool(csv)
        self.path: Optional[Path] = None  # metrics.jsonl, once started
        self._files: List[Any] = []

    def start(self, run: RunInfo) -> None:
        folder = require_dir(self, self.log_dir, run, "log_dir")
        self.path = folder / JSONL_NAME
        try:
            folder.mkdir(parents=True, exist_ok=True)
            earlier = run.history.records
            atomic_write_text(self.path, _jsonl(earlier))
            paths = [self.path]
            if self.csv:
                atomic_write_text(folder / CSV_NAME, _csv(earlier, header=True))
                paths.append(folder / CSV_NAME)
            self._files = [open(path, "a", encoding="utf-8") for path in paths]  # noqa: SIM115 - closed in finish
        except OSError as err:
            raise CheckpointWriteError(
                f"the run's metrics file {self.path} cannot be written ({type(err).__name__}: {err}). Fix: make "
                f"{folder} writable (permissions, free space), give fit(log_dir=...) another folder, or "
                f"fit(log_dir=False) for no metrics file") from err

    def log_metrics(self, metrics: Dict[str, float], step: int, epoch: int, time: float) -> None:
        if not self._files:
            return
        records = [{"step": step, "epoch": epoch, "name": name, "value": value, "time": time}
                   for name, value in metrics.items()]
        texts = [_jsonl(records)] + ([_csv(records, header=False)] if self.csv else [])
        try:
            for handle, text in zip(self._files, texts):
                handle.write(text)
                handle.flush()
        except OSError as err:
            self._stop_writing(step, err)

    def _stop_writing(self, step: int, err: OSError) -> None:
        """A write failed mid-run (disk full, quota, a lost mount): training and checkpoints go on without the
        file. The history keeps every value and is in each checkpoint, so the next fit that resumes rewrites the
        whole file."""
        for handle in self._files:
            try:
                handle.close()
            except OSError:
                pass
        self._files = []
        warnings.warn(f"MetricsFile: writing {self.path} failed at step {step} ({type(err).__name__}: {err}); the "
                      f"file stops there and training goes on. Every value is still in trainer.history and in the "
                      f"checkpoints; a run resumed from one rewrites the file in full", stacklevel=2)

    def finish(self, status: str = "FINISHED") -> None:
        files, self._files = self._files, []
        for handle in files:
            handle.close()

    def __repr__(self) -> str:
        return f"MetricsFile(log_dir={None if self.log_dir is None else str(self.log_dir)!r}, csv={self.csv})"
