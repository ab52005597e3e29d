"""Lengths of training time written as ``'2ep'`` (epochs), ``'500ba'`` (optimizer steps) or ``'0.25dur'`` (run fraction)."""
from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from enum import Enum
from typing import Optional, Union

__all__ = ["TimeUnit", "Time", "Interval", "AtSteps", "unknown_length"]

_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*(ep|ba|dur)\s*$", re.IGNORECASE)
_FORMS = "use an int or a string like '2ep', '500ba' or '0.25dur'"


class TimeUnit(Enum):
    """Unit of a ``Time``: epochs, optimizer steps (batches), or a fraction of the whole run."""

    EPOCH = "ep"
    BATCH = "ba"
    DURATION = "dur"


def _check_value(value: Union[int, float], unit: TimeUnit) -> Union[int, float]:
    """Return ``value`` normalised for ``unit`` (int for ep/ba, float for dur) or raise ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"time value must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"time value must be finite, got {value!r}")
    if unit is TimeUnit.DURATION:
        if not 0.0 < value <= 1.0:
            raise ValueError(f"dur values must be in (0, 1], got {value!r}")
        return float(value)
    if value != int(value) or value < 1:
        raise ValueError(f"{unit.value} values must be positive integers, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class Time:
    """An amount of training time: ``value`` epochs (ep), optimizer steps (ba) or fraction of the run (dur)."""

    value: Union[int, float]
    unit: TimeUnit

    def __post_init__(self) -> None:
        unit = TimeUnit(self.unit)
        object.__setattr__(self, "unit", unit)
        object.__setattr__(self, "value", _check_value(self.value, unit))

    @classmethod
    def from_input(cls, x: Union[int, str, Time], default_unit: TimeUnit = TimeUnit.EPOCH) -> Time:
        """Build a ``Time`` from an int (counted in ``default_unit``), a ``Time``, or a string like ``'2ep'``."""
        if isinstance(x, Time):
            return x
        if isinstance(x, str):
            match = _PATTERN.match(x)
            if match is None:
                raise ValueError(f"invalid time {x!r}: {_FORMS}")
            number, unit = float(match.group(1)), TimeUnit(match.group(2).lower())
        elif isinstance(x, (int, float)) and not isinstance(x, bool):
            number, unit = x, TimeUnit(default_unit)
        else:
            raise ValueError(f"invalid time {x!r} of type {type(x).__name__}: {_FORMS}")
        try:
            return cls(number, unit)
        except ValueError as err:
            raise ValueError(f"invalid time {x!r}: {err}") from None

    def to_steps(self, steps_per_epoch: int, total_steps: int) -> int:
        """Number of optimizer steps: ep -> value * steps_per_epoch, ba -> value, dur -> round(value * total_steps)."""
        if self.unit is TimeUnit.EPOCH:
            return int(self.value) * int(steps_per_epoch)
        if self.unit is TimeUnit.BATCH:
            return int(self.value)
        return int(round(self.value * total_steps))

    def __str__(self) -> str:
        return f"{self.value}{self.unit.value}"


def unknown_length(time: Time) -> str:
    """Why ``time`` cannot be counted in a run whose train loader has no ``len()``, and what to give instead."""
    if time.unit is TimeUnit.DURATION:
        return (f"'{time}' is a fraction of the run, but the run's length in optimizer steps is unknown: the "
                f"train_dataloader has no len() and the run is counted in epochs. Give it in optimizer steps ('500ba') "
                f"or epochs ('1ep'), give the run's length in steps (fit(max_steps=500) or max_duration='500ba'), "
                f"or give the loader a __len__")
    return (f"'{time}' is counted in optimizer steps per epoch, which are unknown: the train_dataloader has no "
            f"len(). Give it in optimizer steps ('500ba'), or give the loader a __len__")


def _checked_shape(steps_per_epoch: Optional[int], total_steps: Optional[int]):
    """The run's shape as positive ints; None stays None (unknown: a train loader without ``len``)."""
    checked = []
    for name, value in (("steps_per_epoch", steps_per_epoch), ("total_steps", total_steps)):
        if value is None:
            checked.append(None)
            continue
        try:
            number = operator.index(value)
        except TypeError:
            number = 0
        if isinstance(value, bool) or number < 1:
            raise ValueError(f"Interval.bind: {name} must be a positive int, got {value!r}")
        checked.append(number)
    return checked


class Interval:
    """A recurring event every ``spec`` (e.g. ``'2ep'``, ``'100ba'``, ``'0.1dur'``); call ``bind`` before asking."""

    def __init__(self, spec: Union[int, str, Time], default_unit: TimeUnit = TimeUnit.EPOCH):
        self.time = Time.from_input(spec, default_unit=default_unit)
        self.steps_per_epoch: Optional[int] = None
        self.total_steps: Optional[int] = None
        self.bound = False  # bind was called (a value it left None is unknown in this run)

    @property
    def unit(self) -> TimeUnit:
        return self.time.unit

    def bind(self, steps_per_epoch: Optional[int], total_steps: Optional[int]) -> Interval:
        """Record the run's optimizer steps per epoch and total optimizer steps; returns self. None: unknown (a
        train loader without ``len``); a dur interval then cannot be counted and is refused here."""
        self.steps_per_epoch, self.total_steps = _checked_shape(steps_per_epoch, total_steps)
        self.bound = True
        if self.unit is TimeUnit.DURATION and self.total_steps is None:
            raise ValueError(unknown_length(self.time))
        return self

    def _period_in_steps(self) -> int:
        if self.unit is TimeUnit.BATCH:
            return int(self.time.value)
        if self.total_steps is None:
            raise RuntimeError(f"Interval {self.time}: call bind(steps_per_epoch, total_steps) before using a dur interval")
        return max(1, round(self.time.value * self.total_steps))

    def is_step_boundary(self, step: int) -> bool:
        """True when ``step`` (optimizer steps done so far, >= 1) ends a ba/dur interval; always False for ep."""
        if self.unit is TimeUnit.EPOCH or step < 1:
            return False
        return step % self._period_in_steps() == 0

    def is_epoch_boundary(self, epoch: int) -> bool:
        """True when ``epoch`` (epochs completed so far, >= 1) is a multiple of an ep interval; False for ba/dur."""
        if self.unit is not TimeUnit.EPOCH or epoch < 1:
            return False
        return epoch % int(self.time.value) == 0

    def to_steps(self) -> int:
        """The interval length in optimizer steps, using the values given to ``bind``."""
        if not self.bound:
            raise RuntimeError(f"Interval {self.time}: call bind(steps_per_epoch, total_steps) before to_steps()")
        if (self.unit is TimeUnit.EPOCH and self.steps_per_epoch is None) or \
                (self.unit is TimeUnit.DURATION and self.total_steps is None):
            raise ValueError(unknown_length(self.time))
        return self.time.to_steps(self.steps_per_epoch, self.total_steps)

    def __str__(self) -> str:
        return str(self.time)

    def __repr__(self) -> str:
        return f"Interval({str(self.time)!r})"


class AtSteps:
    """Events at listed moments instead of every period: ``[200, 500, 1000]`` (optimizer steps) or time strings
    (``['0.5dur', '2ep', 900]``), each resolved to one optimizer step by ``bind``. It answers like an ``Interval``
    in steps (``unit`` is ``ba``), so a hook can take either."""

    unit = TimeUnit.BATCH

    def __init__(self, specs):
        if isinstance(specs, (str, bytes)) or not hasattr(specs, "__iter__"):
            raise ValueError(f"a list of steps must be a list or tuple, got {specs!r}")
        self.times = [Time.from_input(s, default_unit=TimeUnit.BATCH) for s in specs]
        if not self.times:
            raise ValueError("the list of steps is empty: give at least one step, e.g. [200, 500, 1000]")
        self.steps = frozenset(t.to_steps(0, 0) for t in self.times if t.unit is TimeUnit.BATCH)
        self.steps_per_epoch: Optional[int] = None
        self.total_steps: Optional[int] = None

    def bind(self, steps_per_epoch: Optional[int], total_steps: Optional[int]) -> AtSteps:
        """Resolve ``ep`` and ``dur`` entries against the run's shape; returns self (None: unknown, and an entry
        that needs it is refused)."""
        self.steps_per_epoch, self.total_steps = _checked_shape(steps_per_epoch, total_steps)
        for t in self.times:
            if (t.unit is TimeUnit.EPOCH and self.steps_per_epoch is None) or \
                    (t.unit is TimeUnit.DURATION and self.total_steps is None):
                raise ValueError(unknown_length(t))
        self.steps = frozenset(max(1, t.to_steps(self.steps_per_epoch, self.total_steps)) for t in self.times)
        return self

    def is_step_boundary(self, step: int) -> bool:
        """True when ``step`` (optimizer steps done so far) is one of the listed steps."""
        return step in self.steps

    def is_epoch_boundary(self, epoch: int) -> bool:
        """Always False: every entry is a step (an ``ep`` entry is the step that ends that epoch)."""
        return False

    def __str__(self) -> str:
        return "[" + ", ".join(str(t) for t in self.times) + "]"

    def __repr__(self) -> str:
        return f"AtSteps({str(self)})"
