"""``History``: the metric values of a run, as plain Python numbers, in the order they were recorded.

``Trainer.fit`` records into ``trainer.history`` and returns it. A record is a dict
``{"step", "epoch", "name", "value", "time"}`` (``time``: wall clock, seconds since the epoch), the same form as
a line of the metrics file. Names:

- ``train/<Metric>_step``: a train metric's value at an optimizer step (its last micro-batch's value, averaged
  over the ranks), for the metrics that have per-step values (the loss, the accuracy; not epoch-only ones);
- ``lr``: the learning rate of the optimizer's first parameter group, at every optimizer step;
- ``train/<Metric>``: a train metric's value over an epoch, recorded at the epoch's last step;
- ``test/<Metric>``: a test metric's value over one evaluation, recorded at the step it ran after.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

__all__ = ["History", "is_step_name"]

FIELDS = ("step", "epoch", "name", "value", "time")


def is_step_name(name: str) -> bool:
    """The record name of a per-step value (``train/Loss_step``, ``lr``) rather than an epoch's or an evaluation's."""
    return name == "lr" or name.endswith("_step")


class History:
    """The run's records (``records``), with views by metric (``history['test/Accuracy']``), by optimizer step
    (``steps``) and by epoch (``epochs``). The same on every rank; saved in every trainer checkpoint, so a
    resumed run's history is the uninterrupted run's (wall times aside)."""

    def __init__(self, records: Optional[Iterable[Dict[str, Any]]] = None):
        self.records: List[Dict[str, Any]] = [dict(r) for r in records or ()]

    def add(self, records: Iterable[Dict[str, Any]]) -> None:
        self.records.extend(records)

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        return iter(self.records)

    @property
    def names(self) -> List[str]:
        """The record names, in the order they first appear."""
        return list(dict.fromkeys(r["name"] for r in self.records))

    def __getitem__(self, name: str) -> List[float]:
        """The values recorded under ``name``, in order (``history['test/Accuracy']``: one per evaluation)."""
        values = [r["value"] for r in self.records if r["name"] == name]
        if not values and name not in self.names:
            raise KeyError(f"History has no metric {name!r}; it has {self.names}")
        return values

    def __contains__(self, name: str) -> bool:
        return any(r["name"] == name for r in self.records)

    def series(self, name: str) -> List[Tuple[int, float]]:
        """``(step, value)`` of each record of ``name``, in order."""
        self[name]  # (the error naming the metrics there are)
        return [(r["step"], r["value"]) for r in self.records if r["name"] == name]

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
        rows = self._rows(lambda r: not is_step_name(r["name"]), "epoch")
        last_lr = {r["epoch"]: r["value"] for r in self.records if r["name"] == "lr"}
        for row in rows:
            if row["epoch"] in last_lr:
                row["lr"] = last_lr[row["epoch"]]
        return rows

    def _rows(self, keep, key: str) -> List[Dict[str, Any]]:
        rows: Dict[int, Dict[str, Any]] = {}
        for r in self.records:
            if keep(r):
                row = rows.setdefault(r[key], {"step": r["step"], "epoch": r["epoch"]})
                row["step"] = max(row["step"], r["step"])
                row[r["name"]] = r["value"]
        return list(rows.values())

    def truncate(self, after_step: int) -> None:
        """Forget the records of steps after ``after_step`` (a run that goes on from an earlier position)."""
        self.records = [r for r in self.records if r["step"] <= after_step]

    def without_time(self) -> List[Tuple[int, int, str, float]]:
        """``(step, epoch, name, value)`` of every record: what two runs of the same training share."""
        return [(r["step"], r["epoch"], r["name"], r["value"]) for r in self.records]

    # -- checkpoint ----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The records as columns of plain Python values (names stored once)."""
        names = self.names
        index = {name: i for i, name in enumerate(names)}
        return {"names": names, "name": [index[r["name"]] for r in self.records],
                **{field: [r[field] for r in self.records] for field in FIELDS if field != "name"}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        names = state["names"]
        columns = [state[field] if field != "name" else [names[i] for i in state["name"]] for field in FIELDS]
        self.records = [dict(zip(FIELDS, row)) for row in zip(*columns)]

    def __repr__(self) -> str:
        steps = self.records[-1]["step"] if self.records else 0
        return f"History({len(self.records)} records to step {steps}, names={self.names})"
