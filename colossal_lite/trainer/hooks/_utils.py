"""Helpers shared by the built-in hooks: intervals, metric names, the engine's device.

Rank tests and collectives live in ``colossal_lite.core.dist``."""
from __future__ import annotations

import difflib
from typing import Any, Dict, Iterable, List, Tuple, Union

import torch

from ..time import Interval, Time, TimeUnit


def make_interval(spec: Union[int, str, Time], owner: str) -> Interval:
    try:
        return Interval(spec)
    except ValueError as err:
        raise ValueError(f"{owner}(interval={spec!r}): {err}") from None


def bind_interval(interval: Interval, trainer, owner: str) -> None:
    """Tell ``interval`` the run's shape when ``fit`` is running (``evaluate`` alone has none). A train loader
    without ``len`` leaves steps per epoch (and, for a run counted in epochs, its total) unknown: an interval
    that needs them is refused, the error naming ``owner``."""
    st = trainer.state
    if st.fitting or (st.steps_per_epoch and st.total_steps):
        try:
            interval.bind(st.steps_per_epoch, st.total_steps)
        except ValueError as err:
            raise ValueError(f"{owner}(interval={str(interval)!r}): {err}") from None


def due_at_epoch_end(interval: Interval, trainer) -> bool:
    """Whether an epoch-end action with this interval runs now.

    ep intervals: when the epochs completed (``cur_epoch + 1``) are a multiple of the interval;
    ba/dur intervals: when a multiple of the interval's steps fell inside this epoch.
    Always True outside ``fit`` (no run shape to count against).
    """
    st = trainer.state
    if interval.unit is TimeUnit.EPOCH:
        return interval.is_epoch_boundary(st.epoch + 1)
    if not getattr(interval, "bound", interval.total_steps is not None):
        return True
    period = max(1, interval.to_steps())
    return st.step // period > st.epoch_start_step // period


def device_of(trainer) -> torch.device:
    return trainer.engine.device


def resolve_metric(trainer, spec: str) -> Tuple[str, str]:
    """``(phase, name)`` of the metric ``spec`` names in ``trainer.states['metrics']``.

    ``'train/Loss'`` and ``'test/Accuracy'`` choose the phase; a bare name is the test metric when ``fit``
    evaluates and has it, else the train one. A name no hook provides raises ``ValueError`` listing the
    metrics that exist (and the nearest one), as does a test metric in a run without a test loader.
    """
    metrics = trainer.states.get("metrics") or {}
    train, test = metrics.get("train", {}), metrics.get("test", {})
    will_test = bool(trainer.state.will_test)
    phase, sep, name = spec.partition("/")
    if not sep:
        phase, name = ("test" if will_test and spec in test else "train"), spec
    elif phase not in ("train", "test"):
        raise ValueError(f"metric {spec!r}: the part before '/' must be 'train' or 'test'")
    if not sep and name not in train and name in test and not will_test:
        raise ValueError(f"metric {spec!r} is a test metric here, but fit got no test_dataloader: give fit a "
                         f"test_dataloader, or, for the train figure, a hook that computes it in training (e.g. "
                         f"AccuracyHook(..., track_train=True)) and name it 'train/{name}'")
    if name not in metrics.get(phase, {}):
        kind = f"{phase} metric" if sep else "metric"
        raise ValueError(f"no {kind} {name!r}{_nearest(name, set(train) | set(test))}. The hooks of this run give "
                         f"train metrics {sorted(train)} and test metrics {sorted(test)}; add the hook that computes "
                         f"it (LossHook gives 'Loss', AccuracyHook 'Accuracy', LRSchedulerHook 'LR')")
    if phase == "test" and not will_test:
        raise ValueError(f"metric {spec!r} is a test metric, but fit got no test_dataloader")
    return phase, name


def _nearest(name: str, names) -> str:
    """`` (did you mean 'X'?)`` for the existing name closest to ``name`` (case aside first), else ''."""
    by_case = {n.lower(): n for n in names}
    near = [by_case[name.lower()]] if name.lower() in by_case else \
        difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.5)
    return f" (did you mean {near[0]!r}? names are case-sensitive)" if near else ""


def keyed_by_class(items: Iterable[Any]) -> List[Tuple[str, Any]]:
    """``(key, item)`` for each item: its class name and its order among the items of that class
    (``'EarlyStoppingHook.0'``, ``'MLflowTracker.1'``); the key names the item's state in a checkpoint."""
    seen: Dict[str, int] = {}
    keyed = []
    for item in items:
        name = type(item).__name__
        keyed.append((f"{name}.{seen.get(name, 0)}", item))
        seen[name] = seen.get(name, 0) + 1
    return keyed
