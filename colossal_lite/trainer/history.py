"""``History``: the metric values of a run, as plain Python numbers, in the order they were recorded.

``Trainer.fit`` records into ``trainer.history`` and returns it. A record is a dict
``{"step", "epoch", "name", "value", "time"}`` (``time``: wall clock, seconds since the epoch), the same form as
a line of the metrics file. Names:

- ``train/<Metric>_step``: a train metric's value at an optimizer step (its last micro-batch's value, averaged
  over the ranks), for the metrics that have per-step values (the loss, the accuracy; not epoch-only ones);
- ``lr``: the learning rate of the optimizer's first parameter group, at every optimizer step;
- ``train/<Metric>``: a train metric's value over an epoch, recorded at the epoch's last step;
- ``test/<Metric>``: a test metric's value over one evaluation, recorded at the step it ran after;
- measured wall times and what is computed from them (``MEASURED_NAMES``): ``checkpoint/blocking_s`` and
  ``checkpoint/total_s`` of each save, ``SpeedReportHook``'s ``train/time/<phase>``, throughput and MFU.
"""
from __future__ import annotations

from array import array
from fnmatch import fnmatchcase
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from ..utils.metrics_file import CSV_COLUMNS

__all__ = ["History", "MEASURED_NAMES", "is_measured", "is_step_name"]

FIELDS = CSV_COLUMNS  # a record's keys are the metrics file's columns


def is_step_name(name: str) -> bool:
    """The record name of a per-step value (``train/Loss_step``, ``lr``) rather than an epoch's or an evaluation's."""
    return name == "lr" or name.endswith("_step")


#: The record names of values measured with a clock, and of what is computed from them (``fnmatch`` patterns,
#: a per-step ``_step`` twin included): a save's seconds (the checkpoint hooks), ``ThroughputHook``'s samples per
#: second, ``SpeedReportHook``'s phase times, throughput, MFU and the device peak it divides by (measured by a
#: matrix product on a CPU), and the counts and seconds of the steps those figures cover (a resumed run starts
#: them afresh, after a warm-up step of its own).
#: They differ between two runs of the same training, and between ranks. A hook that records such a value adds
#: its name here.
MEASURED_NAMES = ("checkpoint/*", "*/time/*", "train/time_after_epochs/*", "*/Throughput", "train/samples_per_s*",
                  "train/tokens_per_s*", "train/mfu", "train/speed/peak_tflops", "train/speed/steps",
                  "train/speed/timed_steps", "train/speed/micro_batches", "train/speed/seconds")


def is_measured(name: str) -> bool:
    """The record name of a value measured with a clock (``MEASURED_NAMES``)."""
    return any(fnmatchcase(name, pattern) for pattern in MEASURED_NAMES)


class History:
    """The run's records (``records``), with views by metric (``history['test/Accuracy']``), by optimizer step
    (``steps``) and by epoch (``epochs``). The same on every rank; saved in every trainer checkpoint, so a
    resumed run's history is the uninterrupted run's (wall times aside).

    Kept as columns of machine numbers (about 36 bytes a record, a tenth of a dict per record), since a long run
    records a few values at every optimizer step; ``records`` builds the dicts when asked.
    """

    def __init__(self, records: Optional[Iterable[Dict[str, Any]]] = None):
        self._clear()
        self.add(records or ())

    def _clear(self) -> None:
        self._names: List[str] = []
        self._index: Dict[str, int] = {}
        self._columns = {column: array(code) for column, code in zip(FIELDS, "qqidd")}

    def add(self, records: Iterable[Dict[str, Any]]) -> None:
        """Append records (dicts with ``step``, ``epoch``, ``name``, ``value``, ``time``)."""
        self.add_points([(r["step"], r["epoch"], r["time"], {r["name"]: r["value"]}) for r in records])

    def add_values(self, step: int, epoch: int, time: float, values: Dict[str, float]) -> None:
        """One record per ``{name: value}``, all at ``step`` of ``epoch``, recorded at wall time ``time``."""
        self.add_points([(step, epoch, time, values)])

    def add_points(self, points: Iterable[Tuple[int, int, float, Dict[str, float]]]) -> None:
        """The records of several steps, ``(step, epoch, time, {name: value})`` each, appended column by
        column (a flush of the per-step values adds hundreds at once)."""
        index = self._index
        rows = [(step, epoch, index[name] if name in index else self._new_name(name), value, time)
                for step, epoch, time, values in points for name, value in values.items()]
        if rows:
            for column, column_values in zip(FIELDS, zip(*rows)):
                self._columns[column].extend(column_values)

    def _new_name(self, name: str) -> int:
        index = self._index[name] = len(self._names)
        self._names.append(name)
        return index

    def __len__(self) -> int:
        return len(self._columns["step"])

    @property
    def records(self) -> List[Dict[str, Any]]:
        """Every record as a dict ``{step, epoch, name, value, time}``, in the order recorded."""
        names, c = self._names, self._columns
        return [{"step": s, "epoch": e, "name": names[n], "value": v, "time": t}
                for s, e, n, v, t in zip(c["step"], c["epoch"], c["name"], c["value"], c["time"])]

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        return iter(self.records)

    @property
    def names(self) -> List[str]:
        """The record names, in the order they first appear."""
        return list(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self._index

    def series(self, name: str) -> List[Tuple[int, float]]:
        """``(step, value)`` of each record of ``name``, in order."""
        if name not in self._index:
            raise KeyError(f"History has no metric {name!r}; it has {self._names}")
        i, c = self._index[name], self._columns
        return [(s, v) for s, n, v in zip(c["step"], c["name"], c["value"]) if n == i]

    def __getitem__(self, name: str) -> List[float]:
        """The values recorded under ``name``, in order (``history['test/Accuracy']``: one per evaluation)."""
        return [v for _, v in self.series(name)]

    def last(self, name: str) -> float:
        """The latest value of ``name``."""
        return self[name][-1]

    @property
    def steps(self) -> List[Dict[str, Any]]:
        """One row per optimizer step: ``{'step', 'epoch', 'lr', 'train/Loss_step', ...}``."""
        return self._rows(lambda r: is_step_name(r["name"]), "step")

    @property
    def epochs(self) -> List[Dict[str, Any]]:
        """One row per epoch: ``{'epoch', 'step', 'train/Loss', 'test/Loss', ..., 'lr'}`` (the epoch's last
        evaluation's test values; ``lr`` at its last step)."""
        records = self.records
        rows = self._rows(lambda r: not is_step_name(r["name"]), "epoch", records)
        last_lr = {r["epoch"]: r["value"] for r in records if r["name"] == "lr"}
        for row in rows:
            if row["epoch"] in last_lr:
                row["lr"] = last_lr[row["epoch"]]
        return rows

    def _rows(self, keep, key: str, records=None) -> List[Dict[str, Any]]:
        rows: Dict[int, Dict[str, Any]] = {}
        for r in self.records if records is None else records:
            if keep(r):
                row = rows.setdefault(r[key], {"step": r["step"], "epoch": r["epoch"]})
                row["step"] = max(row["step"], r["step"])
                row[r["name"]] = r["value"]
        return list(rows.values())

    def truncate(self, after_step: int) -> None:
        """Forget the records of steps after ``after_step`` (a run that goes on from an earlier position)."""
        if len(self) and max(self._columns["step"]) > after_step:
            kept = [r for r in self.records if r["step"] <= after_step]
            self._clear()
            self.add(kept)

    def forget(self, start: int, end: int) -> None:
        """Forget the records ``start`` to ``end - 1``, counted in the order recorded (``len(history)`` before and
        after they were recorded): what a fit recorded at the end of an epoch it cut short, which the next fit
        continues and records in full (``Trainer.fit``)."""
        if start < end:
            records = self.records
            self._clear()
            self.add(records[:start] + records[end:])

    def without_time(self) -> List[Tuple[int, int, str, float]]:
        """``(step, epoch, name, value)`` of every record: what two runs of the same training share."""
        return [(r["step"], r["epoch"], r["name"], r["value"]) for r in self.records]

    def without_measured(self) -> List[Tuple[int, int, str, float]]:
        """``without_time()`` less the values measured with a clock (``is_measured``): what a resumed run, or another
        rank, shares bit for bit with the uninterrupted run."""
        return [record for record in self.without_time() if not is_measured(record[2])]

    # -- checkpoint ----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The names, and each column as a tensor (copies)."""
        return {"names": list(self._names),
                **{field: torch.tensor(column, dtype=_DTYPES[field]) for field, column in self._columns.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._clear()
        self._names = list(state["names"])
        self._index = {name: i for i, name in enumerate(self._names)}
        for field, column in self._columns.items():
            column.extend(state[field].tolist())

    def __repr__(self) -> str:
        steps = self._columns["step"][-1] if len(self) else 0
        return f"History({len(self)} records to step {steps}, names={self._names})"


_DTYPES = {"step": torch.int64, "epoch": torch.int64, "name": torch.int32, "value": torch.float64,
           "time": torch.float64}
