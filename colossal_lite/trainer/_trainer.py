"""``Trainer``: the legacy fit / evaluate / predict loop as an event loop over one ``State``.

Each training iteration runs the engine's one training step (``engine.step.TrainStep``: load, forward,
criterion, backward, and at a window's end clip and optimizer step) with the hooks' handlers, so hooks
can replace the batch, the target or the loss between its lines; with no hook subscribed it computes
exactly what ``zero_grad(); execute_schedule(); step()`` computes.
"""
from __future__ import annotations

import copy
import itertools
import math
import os
import signal
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from ..checkpoint.rng import capture_rng_state, restore_rng_state
from ..core.dist import all_reduce_max_, all_reduce_min_, collective_device, is_rank_0, log_rank_0, rank, world_size
from ..core.global_context import global_context as gpc
from ..engine.accumulation import AccumulationDataLoader
from ..engine.batch import call_with, move_to_device
from ..engine.step import make_train_step
from ..logging import get_dist_logger
from ..utils.data import DataParallelSampler, batches_per_epoch, skip_batches
from ..utils.timer import MultiTimer
from ._checkpoint.epoch_start import NOT_STORED, EpochStart
from ._checkpoint.epoch_sums import TrainMetricSums
from ._checkpoint.registry import StateRegistry
from ._checkpoint.restore import batch_in_resized_epoch
from ._epoch import SizedEpoch, UnsizedEpoch
from ._padding import RealRows
from ._predict import is_loader, predict_loader
from ._recorder import Recorder, flat_params
from ._user_step import UserStep, UserStepRunner, bind_user_step, evaluation_step
from .checkpointing import CheckpointSession, checkpoint_round_trip
from .events import Event
from .history import History
from .hooks._base_hook import BaseHook
from .hooks._utils import keyed_by_class, resolve_metric
from .progress import NO_PROGRESS, make_progress
from .state import State
from .time import Interval, Time, TimeUnit
from .trackers import MetricsFile, Tracker

__all__ = ["Trainer", "TestModeResult", "TestModeFailed"]

_END = object()


class _NullTimer:
    """The timer of a run that times nothing."""

    def start(self, name):
        pass

    def stop(self, name, keep_in_history=False):
        return None

    def reset(self, name=None):
        pass

    def __contains__(self, name):
        return False


_NULL_TIMER = _NullTimer()


_EVENT_NAMES = tuple(event.value for event in Event)
_BASE_METHODS = {name: getattr(BaseHook, name) for name in _EVENT_NAMES}


def _class_defines(cls: type, name: str) -> bool:
    """``cls`` (or a base other than BaseHook) defines the event method ``name``."""
    return getattr(cls, name, None) is not _BASE_METHODS[name]


def _overrides(hook: BaseHook, name: str) -> bool:
    """The hook handles event ``name``: its class (or the instance) defines the method, and it does not list
    the event in ``skipped_events`` (a hook whose options leave a method idle is not called for it)."""
    if name in hook.skipped_events:
        return False
    return _class_defines(type(hook), name) or name in getattr(hook, "__dict__", {})


#: The events of a training iteration after its loss is computed: a hook handling one of them may read the step's
#: output there, unless it says it does not (``BaseHook.reads_train_output``).
_AFTER_LOSS_EVENTS = ("before_backward", "after_backward", "after_grad_norm", "before_optimizer_step",
                      "after_optimizer_step", "after_train_iter")


def _output_read_after_loss(hooks: Sequence[BaseHook]) -> bool:
    return any(hook.reads_train_output and any(_overrides(hook, name) for name in _AFTER_LOSS_EVENTS)
               for hook in hooks)


#: The points of a run an instrument can take over (``Trainer.instrument``): every event, and ``'before_load'``,
#: where a training batch starts to load (called with no argument, before its host-to-device copy).
INSTRUMENT_POINTS = _EVENT_NAMES + ("before_load",)


class _Handlers:
    """For each event, the tuple of bound hook methods that handle it (built once per fit): an event nobody
    handles costs an empty loop. ``plain`` keeps the hooks' own tuples (and ``'before_load'``'s, empty) while an
    instrument has put its own in their place; ``instrument_owners`` which instrument holds each such point."""

    def __init__(self, hooks: Sequence[BaseHook] = ()):
        self.plain = {name: tuple(getattr(hook, name) for hook in hooks if _overrides(hook, name))
                      for name in _EVENT_NAMES}
        for name, handlers in self.plain.items():
            setattr(self, name, handlers)
        self.plain["before_load"] = ()
        self.instrument_owners: Dict[str, Any] = {}


@dataclass
class _CutEpoch:
    """Where a fit cut an epoch short, taken before the epoch's end events (where the final checkpoint of such a
    fit is taken): for the next fit on the same trainer to continue that epoch as a run resumed from that
    checkpoint would."""

    position: Tuple[int, int, int]  # (epoch, batch_idx, step)
    batches: Optional[int]  # the epoch's batches per rank (None: a loader without len)
    sums: Dict[str, Any]  # this rank's train metrics' sums of the epoch so far (``TrainMetricSums.state_dict``)
    first_record: int  # len(history) at the cut: the records from here on are that fit's, of the cut epoch's end
    end_record: Optional[int] = None  # len(history) when that fit ended (None while it runs)


@dataclass
class TestModeResult:
    """What ``fit(..., test_mode=True)`` ran and found; ``str()`` is the one-line verdict, ``bool()`` is ``ok``."""

    __test__ = False  # not a pytest class

    ok: bool
    message: str
    train_batches: int
    eval_batches: int
    train_loss: Optional[float]  # None: a step of the user's own returned no loss
    eval_loss: Optional[float]
    optimizer_updated: bool
    checkpoint: Optional[str] = None  # what the checkpoint round trip found (None: not run)

    def __str__(self) -> str:
        return self.message

    def __bool__(self) -> bool:
        return self.ok


class TestModeFailed(RuntimeError):
    """``fit(..., test_mode=True)`` found a problem: the message is the verdict, ``result`` the whole
    ``TestModeResult``. Raised on every rank (every rank reaches the same verdict), so a smoke-test script
    exits with an error."""

    __test__ = False  # not a pytest class

    def __init__(self, result: TestModeResult):
        super().__init__(result.message)
        self.result = result


def _loader_len(loader) -> Optional[int]:
    try:
        return len(loader)
    except TypeError:
        return None


def _check_same_epoch_length(iters: Optional[int]) -> None:
    """Refuse, on every rank, a training loader whose epoch has a different number of batches on some rank.

    Each batch is a round of collectives (the gradients' all-reduce); a rank with a batch more would wait for
    a partner that never comes (NCCL hangs; gloo aborts on mismatched sizes). One all-reduce at fit's start
    finds it instead: every rank takes part, a loader without len as -1, so all ranks reach the same verdict.
    """
    if world_size() == 1:
        return
    mine = -1 if iters is None else int(iters)
    extremes = torch.tensor([mine, -mine], dtype=torch.int64, device=collective_device())
    most, fewest = (int(v) for v in all_reduce_max_(extremes).tolist())  # (one read: the max and the -min)
    fewest = -fewest
    if most == fewest:
        return

    def says(n: int) -> str:
        return "no len()" if n < 0 else f"{n} batches"

    spread = (f"some have no len() and some do (up to {says(most)})" if fewest < 0
              else f"from {says(fewest)} to {says(most)}")
    raise ValueError(
        f"fit(train_dataloader=...): the ranks' training loaders differ in length ({spread}; this rank, rank "
        f"{rank()}: {says(mine)}). Every rank must run the same number of batches per epoch: the gradients' "
        f"all-reduce of one rank's extra batch would wait for ranks that have finished (a hang, or a collective "
        f"mismatch). Shard the data with colossal_lite.utils.get_dataloader(dataset, ...) or a DataLoader over "
        f"torch's DistributedSampler, which give every rank the same count (they pad the shorter shares, or drop "
        f"the rest with drop_last=True), or give each rank's loader the same number of batches yourself.")


def _epoch_length(loader) -> Optional[int]:
    """Micro-batches in a whole epoch (a resumed loader's ``len`` is only what is left of its epoch)."""
    if _loader_len(loader) is None:
        return None
    return batches_per_epoch(loader)


def _why_empty(loader) -> str:
    """What made a loader with samples yield no batch, when that is ``drop_last`` (said after the error)."""
    inner = _epoch_loader(loader)
    if not getattr(inner, "drop_last", False):
        return ""
    try:
        samples = len(inner.sampler)
    except (AttributeError, TypeError):  # (no sampler, or one without len)
        return ""
    return (f": its {samples} samples (on this rank) are fewer than batch_size={inner.batch_size}, and drop_last=True "
            f"drops that partial batch. Fix: a smaller batch_size, or drop_last=False") if samples else ""


def _epoch_loader(loader):
    """What an epoch iterates: the loader ``initialize`` wrapped, not the wrapper. The epoch places each micro-batch
    in its window itself (``SizedEpoch``, ``UnsizedEpoch``) and the step announces it; the wrapper's announcements
    are for a loop of the user's. Without len the wrapper would also read ahead once more, and a checkpoint keeps
    only the batches the epoch holds."""
    return loader.loader if isinstance(loader, AccumulationDataLoader) else loader


def _iterate_from(loader, iters: Optional[int], skip: int, epoch_rng: Optional[Dict[str, Any]] = None,
                  read: Optional[int] = None) -> Iterator:
    """An iterator over ``loader`` whose first batch is batch ``skip`` of the epoch (``iters`` batches long; None:
    a loader without len), after ``read`` batches (default ``skip``; more where batches read ahead were kept).

    A loader restored with ``load_state_dict`` already starts there; a ``get_dataloader`` loader is moved
    by its sampler (nothing is loaded); other loaders are read and the first ``read`` batches dropped (exact
    when the loader yields the same batches each time it is iterated).

    Making the iterator draws from torch's generator (a plain ``DataLoader``'s base seed for its workers, a
    ``RandomSampler``'s order), and reading the skipped batches advances the workers' streams: the run being
    resumed did both at the epoch's start. So they are done from ``epoch_rng``, the random state recorded then
    (when the checkpoint has it), and the random state the resume restored is put back afterwards.
    """
    if skip == 0:
        return iter(loader)
    rng = capture_rng_state()
    try:
        if epoch_rng is not None:
            restore_rng_state(epoch_rng)
        return _iterator_at(loader, iters, skip, skip if read is None else read)
    finally:
        restore_rng_state(rng)


def _iterator_at(loader, iters: Optional[int], skip: int, read: int) -> Iterator:
    if iters is not None and _loader_len(loader) == iters - skip:
        return iter(loader)
    if isinstance(getattr(loader, "sampler", None), DataParallelSampler):
        skip_batches(loader, skip)
        return iter(loader)
    data_iter = iter(loader)
    for done in range(read):
        if next(data_iter, _END) is _END:
            raise RuntimeError(f"resuming inside an epoch at batch {skip}, but the train_dataloader ended after "
                               f"{done} batches: resume on the loader the checkpoint was taken with, which must yield "
                               f"the same batches each time it is iterated (or resume from an epoch's end)")
    return data_iter


def _checked_list(items, cls: type, what: str, kind: str, base: str) -> list:
    """``items`` (None: none) as a list of ``cls`` instances; the error names the one that is not, and ``base``
    (the public name of ``cls``) to subclass."""
    if items is None:
        return []
    if not isinstance(items, (list, tuple)):
        raise TypeError(f"{what} must be a list of {kind}s, got {type(items).__name__}")
    for i, item in enumerate(items):
        if not isinstance(item, cls):
            raise TypeError(f"{what}[{i}] is a {type(item).__name__}, not a {kind}: subclass {base}")
    return list(items)


def _checked_hooks(hooks) -> List[BaseHook]:
    """``hooks`` as a list, each a ``BaseHook`` with a numeric priority (the error names the one that is not)."""
    hooks = _checked_list(hooks, BaseHook, "hooks", "hook", "colossal_lite.trainer.hooks.BaseHook")
    for i, hook in enumerate(hooks):
        priority = getattr(hook, "priority", None)
        if isinstance(priority, bool) or not isinstance(priority, (int, float)):
            raise TypeError(f"hooks[{i}] ({type(hook).__name__}) has priority {priority!r}; it must be a number")
    return hooks


def _test_mode_result(finite: bool, checkpoint_note: Optional[str], n_train: int, n_eval: int, has_test: bool,
                      train_loss: Optional[float], eval_loss: Optional[float], updated: bool) -> "TestModeResult":
    """The verdict of test mode, with its one-line message."""
    checkpoint_ok = checkpoint_note is None or "FAILED" not in checkpoint_note
    parts = [f"{n_train} train batch" + ("es" if n_train != 1 else "")]
    if has_test:
        parts.append(f"{n_eval} eval batch" + ("es" if n_eval != 1 else ""))
    ran = " and ".join(parts) + " ran"
    losses = ("train loss not given (the step returned none)" if train_loss is None else f"train loss {train_loss:.4g}")
    losses += "" if eval_loss is None else f", eval loss {eval_loss:.4g}"
    step = "optimizer step applied" if updated else "optimizer step skipped (fp16 overflow)"
    if not has_test:
        step += ", no test_dataloader given"
    if checkpoint_note:
        step += f", {checkpoint_note}"
    ok = finite and checkpoint_ok
    verdict = "OK" if ok else ("FAILED (a loss or a parameter is NaN or inf)" if not finite
                               else "FAILED (the checkpoint round trip failed)")
    message = f"test mode: {ran} ({losses}; {step}), loss finite: {verdict}"
    return TestModeResult(ok=ok, message=message, train_batches=n_train, eval_batches=n_eval, train_loss=train_loss,
                          eval_loss=eval_loss, optimizer_updated=updated, checkpoint=checkpoint_note)


def _set_sampler_epoch(loader, epoch: int) -> None:
    """Call ``set_epoch(epoch)`` on the loader's sampler when it has one (distributed shuffles differ per epoch)."""
    for holder in (loader, getattr(loader, "batch_sampler", None)):
        sampler = getattr(holder, "sampler", None)
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)
            return


def _check_count(name: str, value, allow_zero: bool = True) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
        bound = ">= 0" if allow_zero else ">= 1"
        raise ValueError(f"fit({name}={value!r}): must be an int {bound}")
    return value


def _resolve_length(epochs, max_steps, max_duration, steps_per_epoch: Optional[int]):
    """-> (max_epochs, max_steps or None) from fit's arguments; max_epochs is None (no epoch limit) for a length in
    steps when ``steps_per_epoch`` is unknown (a train loader without len)."""
    if max_duration is not None:
        if epochs is not None or max_steps is not None:
            raise ValueError(f"fit: give max_duration or epochs/max_steps, not both (got max_duration={max_duration!r}, "
                             f"epochs={epochs!r}, max_steps={max_steps!r})")
        try:
            length = Time.from_input(max_duration, default_unit=TimeUnit.EPOCH)
        except ValueError as err:
            raise ValueError(f"fit(max_duration={max_duration!r}): {err}") from None
        if length.unit is TimeUnit.DURATION:
            raise ValueError(f"fit(max_duration={max_duration!r}): 'dur' is a fraction of the run, so it cannot set the "
                             f"run's length; use epochs ('10ep') or optimizer steps ('500ba')")
        if length.unit is TimeUnit.EPOCH:
            return int(length.value), None
        return _epochs_for(int(length.value), steps_per_epoch), int(length.value)
    if epochs is None and max_steps is None:
        raise ValueError("fit needs the run's length: epochs=..., max_steps=... or max_duration='10ep' / '500ba'")
    if max_steps is not None:
        _check_count("max_steps", max_steps)
    if epochs is None:
        return _epochs_for(max_steps, steps_per_epoch), max_steps
    return _check_count("epochs", epochs), max_steps


def _epochs_for(steps: int, steps_per_epoch: Optional[int]) -> Optional[int]:
    """Epochs that hold ``steps`` optimizer steps; None (no epoch limit) when an epoch's steps are unknown."""
    return None if steps_per_epoch is None else math.ceil(steps / steps_per_epoch)


def _run_steps(max_epochs: Optional[int], max_steps: Optional[int], steps_per_epoch: Optional[int]) -> Optional[int]:
    """Optimizer steps the whole run takes (>= 1); None when unknown (a loader without len, a length in epochs)."""
    if steps_per_epoch is None:
        return None if max_epochs is not None else max(1, max_steps)
    total = max_epochs * steps_per_epoch
    return max(1, total if max_steps is None else min(total, max_steps))


def _run_trackers(trackers, log_dir, hooks) -> Tuple[List[Tracker], Optional[Path]]:
    """fit's trackers and the run's folder: ``log_dir``, else the SaveCheckpointHook's folder (``log_dir=False``:
    none). A run with a folder gets a ``MetricsFile`` unless ``trackers`` has one."""
    trackers = _checked_list(trackers, Tracker, "fit(trackers=...)", "tracker",
                             "colossal_lite.trainer.trackers.Tracker")
    if log_dir is False:
        return trackers, None
    if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
        raise TypeError(f"fit(log_dir={log_dir!r}): give a folder path, None (the checkpoint folder) or False (none)")
    folder = Path(log_dir) if log_dir is not None else next(
        (folder for folder in (getattr(hook, "run_folder", None) for hook in hooks or ()) if folder is not None), None)
    if folder is not None and not any(isinstance(t, MetricsFile) for t in trackers):
        trackers = [MetricsFile()] + trackers
    return trackers, folder


class Trainer:
    """Runs ``fit`` / ``evaluate`` / ``predict`` on an ``Engine``, calling hooks at each event.

    ``timer``: a ``MultiTimer`` timing ``Train-epoch``, ``Train-step``, ``Test-epoch``, ``Test-step``
    (None: no timing, unless a hook such as ``LogTimingByEpochHook`` brings one). ``logger``: when given,
    the hooks in use and the step-limit stop are logged (legacy ``verbose``).

    ``preemption_signals``: the signals that make ``fit`` (with a ``SaveCheckpointHook``) finish the
    current optimizer step, write a checkpoint and exit with status 75 (``TrainingPreempted``).
    """

    preemption_signals = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, engine, timer: Optional[MultiTimer] = None, logger=None):
        self._engine = engine
        self._timer = timer
        self._run_timer: Any = timer if timer is not None else _NULL_TIMER
        self._logger = logger
        self._verbose = logger is not None
        self.state = State()
        self.hooks: List[BaseHook] = []
        self._h = _Handlers()
        self._step_from_epoch = False
        self._step = None  # the training step of the running fit or evaluate (built with the hooks' handlers)
        self._checkpoints: Optional[CheckpointSession] = None  # checkpoints of the running fit
        self.history = History()  # every fit's recorded metric values (docs/metrics.md)
        self._recorder: Optional[Recorder] = None  # records the running fit's values into the history
        self._metric_sums = TrainMetricSums(lambda: self.states["metrics"]["train"])
        self._epoch_start = EpochStart(self.state)  # the random state and read-ahead a resume inside an epoch needs
        self._cut: Optional[_CutEpoch] = None  # the epoch the last fit cut short, for the next fit to continue
        self.state_registry = self._registry()

    def _registry(self) -> StateRegistry:
        """The stateful parts a checkpoint holds: progress and history now, hooks and trackers when a run
        attaches them, the user's objects when registered (``register_for_checkpointing``)."""
        registry = StateRegistry()
        for name, keyed in (("progress", False), ("hooks", True), ("history", False), ("trackers", True),
                            ("objects", True)):
            registry.section(name, keyed)
        registry.section("hooks", keyed=True, rank=True)
        registry.section("metrics", keyed=False, rank=True)
        registry.section("epoch", keyed=False, rank=True)
        registry.add("progress", None, self.state, load=self._load_progress)
        registry.add("history", None, self.history)
        registry.add("metrics", None, self._metric_sums, rank=True)
        registry.add("epoch", None, self._epoch_start, rank=True)
        return registry

    def _load_progress(self, progress: Dict[str, Any]) -> None:
        self.state.load_state_dict(progress)
        self._count_run_steps_from_here()
        self._step_from_epoch = False
        self._cut = None  # the run stands where the restored state says, with its own history and sums
        self._epoch_start.forget()  # (a checkpoint's restore then loads its own)

    def _count_run_steps_from_here(self) -> None:
        """The run's optimizer steps, counted from where a restore put it: those taken so far and those left of this
        fit's epochs. A run resumed with another number of ranks or batch size took another number of steps per epoch
        before, so ``max_epochs * steps_per_epoch`` would miscount them (the ETA, a schedule's length check)."""
        st = self.state
        if not st.fitting or st.steps_per_epoch is None or st.max_epochs is None:
            return
        left = st.steps_per_epoch - st.batch_idx // self._engine.window.size \
            + (st.max_epochs - st.epoch - 1) * st.steps_per_epoch
        total = st.step + max(left, 0)
        st.total_steps = max(1, total if st.max_steps is None else min(total, st.max_steps))

    # -- legacy properties -----------------------------------------------------------------------
    @property
    def engine(self):
        return self._engine

    @property
    def states(self) -> Dict[str, Any]:
        """The legacy dict: ``states['metrics']['train'|'test'][name]``, ``states['step_metrics']``."""
        return self.state.states

    @property
    def cur_epoch(self) -> int:
        """Index of the current epoch (0-based); set it to resume from the start of that epoch."""
        return self.state.epoch

    @cur_epoch.setter
    def cur_epoch(self, epoch: int) -> None:
        self.state.epoch = _check_count("cur_epoch", epoch)
        self.state.batch_idx = 0
        self._step_from_epoch = True  # fit sets cur_step = cur_epoch * steps_per_epoch
        self._cut = None  # an epoch cut short is not continued: the next fit starts epoch ``epoch`` afresh
        self._epoch_start.forget()

    @property
    def cur_step(self) -> int:
        """Optimizer steps taken so far."""
        return self.state.step

    @property
    def max_epochs(self) -> Optional[int]:
        return self.state.max_epochs

    @property
    def max_steps(self) -> Optional[int]:
        return self.state.max_steps

    @property
    def steps_per_epoch(self) -> Optional[int]:
        """Optimizer steps per epoch: ceil(len(train_dataloader) / gradient accumulation)."""
        return self.state.steps_per_epoch

    @property
    def user_step(self) -> Optional[UserStep]:
        """The ``UserStep`` the running fit or evaluate was given (``step=``); None while the Trainer's own step runs."""
        return self._step.step if isinstance(self._step, UserStepRunner) else None

    def check_losses_finite(self) -> None:
        """Raise ``NonFiniteLossError`` where an engine the fit trains saw a NaN or inf loss under
        ``nonfinite_loss='raise'``: the Trainer's, and the other engines of a step of the user's own, each with its own
        setting (every rank alike)."""
        self._engine.check_loss_finite()
        step = self.user_step
        for engine in step.engines.values() if step is not None else ():
            if engine is not self._engine:
                engine.check_loss_finite()

    @property
    def timer(self):
        """The timer of the current run (None when nothing is timed)."""
        return None if self._run_timer is _NULL_TIMER else self._run_timer

    def use_timer(self, timer: Optional[MultiTimer] = None) -> MultiTimer:
        """The timer the loop uses this run; when the Trainer has none, ``timer`` (or a new one) is used."""
        if self._run_timer is _NULL_TIMER:
            self._run_timer = timer if timer is not None else MultiTimer()
        return self._run_timer

    # -- events ----------------------------------------------------------------------------------
    def fire(self, event: Union[Event, str], *args) -> None:
        """Call every attached hook that handles ``event`` with ``(trainer, *args)``, in priority order."""
        for fn in getattr(self._h, Event(event).value):
            fn(self, *args)

    def _call_hooks(self, func: str, output=None) -> None:  # legacy name
        self.fire(func, *(output or ()))

    def instrument(self, wrap: Optional[Callable[[str, Tuple[Callable, ...]], Sequence[Callable]]],
                   points: Optional[Sequence[str]] = None, owner: Any = None) -> None:
        """The seam for a tool that measures the running fit (``SpeedReportHook`` uses it): from now on the loop
        calls, at each of ``points`` (``INSTRUMENT_POINTS``; None: all), the functions ``wrap(point, handlers)``
        returns instead of the attached hooks' ``handlers`` (their bound methods in priority order);
        ``wrap=None`` gives those points their hooks' handlers back. The loop checks nothing per step: it calls
        whichever functions are in place, so a run without an instrument pays nothing, and an instrument may
        switch itself on for some steps only. Each attach (each ``fit``) starts from the hooks' handlers.

        A point belongs to one instrument at a time (``owner``; None: the object ``wrap`` is a method of), until it
        gives the point back: another instrument taking it is a ValueError, where it would silently replace the
        first one's functions (each builds from the hooks' handlers)."""
        if self._step is None:
            raise RuntimeError("Trainer.instrument is for a running fit or evaluate: call it from a hook's "
                               "after_hook_is_attached or a later event")
        unknown = [p for p in (points or ()) if p not in INSTRUMENT_POINTS]
        if unknown:
            raise ValueError(f"Trainer.instrument: no point named {', '.join(map(repr, unknown))}; the points are "
                             f"the events' names (colossal_lite.trainer.events.Event values) and 'before_load'")
        h, owners = self._h, self._h.instrument_owners
        points = INSTRUMENT_POINTS if points is None else points
        owner = getattr(wrap, "__self__", wrap) if owner is None else owner
        taken = {point: owners[point] for point in points if wrap is not None and owners.get(point, owner) is not owner}
        if taken:
            held = ", ".join(f"{point!r} ({type(other).__name__})" for point, other in taken.items())
            raise ValueError(f"Trainer.instrument: {type(owner).__name__} takes points another instrument holds: "
                             f"{held}. One instrument per point: keep one of them in the fit's hooks, or let the "
                             f"other give its points back first (trainer.instrument(None, points))")
        for point in points:
            handlers = h.plain[point] if wrap is None else tuple(wrap(point, h.plain[point]))
            setattr(self._step if point == "before_load" else h, point, handlers)
            if wrap is None:
                owners.pop(point, None)
            else:
                owners[point] = owner

    def _attach(self, hooks, purpose: str, recorder: Optional[Recorder] = None,
                user_step: Union[UserStep, Callable, None] = None) -> None:
        """Sort the run's hooks, build the event handlers and the training step that fires them (the
        ``recorder``, when given, handles each event last; ``user_step``: the ``step=`` of fit or evaluate, bound
        before the hooks are told they are attached, so they can see it)."""
        self.hooks = sorted(_checked_hooks(hooks), key=lambda h: h.priority)  # stable: ties keep the list's order
        self._recorder = recorder
        self._h = _Handlers(self.hooks + ([recorder] if recorder is not None else []))
        self._step = make_train_step(self._engine, self.state, self._h, self)
        self._step.keep_output = _output_read_after_loss(self.hooks)
        if user_step is not None:
            bind = bind_user_step if self.state.fitting else evaluation_step
            self._step = bind(user_step, self, self._h, self._step)
        self._register_parts(recorder)
        if self._verbose:
            for hook in self.hooks:
                log_rank_0(self._logger, f"Using {type(hook).__name__} for {purpose}, priority = {hook.priority}")
            if self.hooks:
                log_rank_0(self._logger, "Lower value means higher priority for calling hook function")
        self.fire(Event.AFTER_HOOK_IS_ATTACHED)
        if self.state.fitting:
            self._check_watched_metrics()
        self.state_registry.hand_on("hooks", drop_rest=True)  # states restored before these hooks were attached
        if recorder is not None:
            self.state_registry.hand_on("trackers", drop_rest=True)

    def _register_parts(self, recorder: Optional[Recorder]) -> None:
        """The run's hooks (and its trackers) in the registry, each keyed by its class and its order among
        those of its class (``'EarlyStoppingHook.0'``): the key names its state in a checkpoint."""
        registry = self.state_registry
        registry.clear("hooks")
        registry.clear("trackers")
        for key, hook in keyed_by_class(self.hooks):
            registry.add("hooks", key, hook)
            registry.add("hooks", key, hook, hook.rank_state_dict, hook.load_rank_state_dict, rank=True)
        if recorder is not None:
            for key, tracker in keyed_by_class(recorder.trackers):
                registry.add("trackers", key, tracker)
            registry.before_save("trackers", recorder.flush)  # the values kept on the device join the history

    def _check_watched_metrics(self) -> None:
        """Every metric a hook names exists, now that all hooks have registered theirs (any priority order)."""
        for hook in self.hooks:
            for spec in hook.watched_metrics:
                try:
                    resolve_metric(self, spec)
                except ValueError as err:
                    raise ValueError(f"{type(hook).__name__} watches metric {spec!r}: {err}") from None

    def _detach(self) -> None:
        if self._step is not None:  # (the hooks were attached: an attach that failed early has no handlers yet)
            self.fire(Event.AFTER_HOOK_IS_DETACHED)
        self._step = None
        self._recorder = None
        self.state_registry.clear("trackers")
        self._run_timer = self._timer if self._timer is not None else _NULL_TIMER
        self._metric_sums.forget()
        if self._cut is not None and self._cut.end_record is None:  # the fit that cut an epoch short ends here
            self._cut.end_record = len(self.history)
        st = self.state
        st.phase = None
        st.fitting = False
        st.clear_iteration()

    # -- fit ---------------------------------------------------------------------------------------
    def fit(self, train_dataloader: Iterable, epochs: Optional[int] = None, max_steps: Optional[int] = None,
            test_dataloader: Optional[Iterable] = None, test_interval: Union[int, str, Time] = 1,
            hooks: Optional[List[BaseHook]] = None, display_progress: bool = False, return_output_label: bool = True,
            max_duration: Union[int, str, Time, None] = None, test_mode: bool = False, resume_from=None,
            log_dir: Union[str, "os.PathLike[str]", None, bool] = None, trackers: Optional[List[Tracker]] = None,
            step: Union[UserStep, Callable, None] = None):
        """Train for ``epochs`` epochs in total (or ``max_steps`` optimizer steps, or ``max_duration``).

        Evaluates on ``test_dataloader`` every ``test_interval`` (int epochs, ``'2ep'``, ``'500ba'``,
        ``'0.25dur'``) and once more at the end of training if the last step was not evaluated.
        ``test_mode=True`` runs one optimizer step and one evaluation batch, logs the verdict and keeps it in
        ``trainer.test_mode_result``; a failed one raises ``TestModeFailed``.
        ``resume_from``: None, ``'auto'`` (``last`` when it exists, else a fresh start), ``'last'``, ``'best'``
        (in the ``SaveCheckpointHook``'s folder) or a checkpoint path: the run continues exactly from there.
        With a ``SaveCheckpointHook``, SIGTERM/SIGINT finish the current optimizer step, write a checkpoint
        and raise ``TrainingPreempted`` (a ``SystemExit`` with status 75).

        Returns ``trainer.history``: every metric value recorded, per optimizer step and per epoch
        (``docs/metrics.md``). ``log_dir``: the run's folder (None: the ``SaveCheckpointHook``'s folder; False:
        none), where a ``metrics.jsonl`` is written unless ``trackers`` has a ``MetricsFile``; ``trackers``: where
        else the values go (``TensorBoardTracker``, ``MLflowTracker``, your own ``Tracker``), on rank 0.
        ``step``: a training step of your own, ``fn(trainer, batch)`` or ``UserStep(fn, engines=..., evaluate=...)``,
        for programs with several engines or state carried between batches (docs/trainer.md, "Your own step").
        """
        run = self._begin_fit(train_dataloader, test_dataloader, epochs, max_steps, max_duration, test_interval,
                              display_progress, return_output_label)
        recorder = None if test_mode else Recorder(self.history, *_run_trackers(trackers, log_dir, hooks),
                                                   params=flat_params(gpc.config))
        checkpoints = None
        try:
            self._attach(hooks, "training", recorder, step)
            checkpoints = self._checkpoints = CheckpointSession(self, train_dataloader, saving=not test_mode)
            checkpoints.resume(resume_from)
            if run.interval.total_steps != self.state.total_steps:  # (a resume counted the run's steps anew)
                run.interval.bind(self.state.steps_per_epoch, self.state.total_steps)
            if test_mode:
                self._test_mode(run)
                return self.history
            if checkpoints.nothing_to_do():  # e.g. a finished script run again with resume_from='auto'
                return self.history
            checkpoints.watch_signals(self.preemption_signals)
            self._train(run, checkpoints)
            checkpoints.raise_if_preempted()
        finally:
            if recorder is not None:
                recorder.finish("FAILED")  # (nothing to do when the run ended: after_train finished the trackers)
            if checkpoints is not None:
                checkpoints.close()
            self._checkpoints = None
            self._detach()
        return self.history

    def _begin_fit(self, train_loader, test_loader, epochs, max_steps, max_duration, test_interval,
                   display_progress: bool, return_output_label: bool) -> "_Run":
        """Check fit's arguments and set the run's shape in ``state``; -> the run's loaders and options."""
        iters = _epoch_length(train_loader)  # None: a loader without len, whose epochs end when its iterator does
        _check_same_epoch_length(iters)  # (before any rank can raise alone below: all ranks reach this collective)
        if iters == 0:
            raise ValueError(f"fit(train_dataloader=...) is empty: len(train_dataloader) == 0{_why_empty(train_loader)}")
        st = self.state
        steps_per_epoch = None if iters is None else math.ceil(iters / self._engine.window.size)
        max_epochs, max_steps = _resolve_length(epochs, max_steps, max_duration, steps_per_epoch)
        total_steps = _run_steps(max_epochs, max_steps, steps_per_epoch)
        try:
            interval = Interval(test_interval).bind(steps_per_epoch, total_steps)
        except ValueError as err:
            raise ValueError(f"fit(test_interval={test_interval!r}): {err}") from None
        if self._step_from_epoch:
            if steps_per_epoch is None and st.epoch:
                raise ValueError(f"trainer.cur_epoch = {st.epoch}: the steps taken before epoch {st.epoch} are unknown "
                                 f"because the train_dataloader has no len(); resume from a checkpoint "
                                 f"(fit(resume_from=...)) or give the loader a __len__")
            st.step = st.epoch * (steps_per_epoch or 0)
            self._step_from_epoch = False
        st.reset_states()
        st.stop_training, st.stop_reason, st.last_eval_step = False, None, None
        st.max_epochs, st.max_steps, st.total_steps = max_epochs, max_steps, total_steps
        st.steps_per_epoch, st.iters_per_epoch = steps_per_epoch, iters
        st.fitting, st.will_test = True, test_loader is not None
        display = bool(display_progress) and is_rank_0()
        return _Run(train_loader, test_loader, interval, display, return_output_label)

    def _train(self, run: "_Run", checkpoints: CheckpointSession) -> None:
        """The epochs, from where the state stands to the end of the run or the first reason to stop."""
        st = self.state
        self._engine.train()
        self._continue_cut_epoch()  # (before BEFORE_TRAIN: the trackers start from the history it leaves)
        self.fire(Event.BEFORE_TRAIN)
        epochs = range(st.epoch, st.max_epochs) if st.max_epochs is not None else itertools.count(st.epoch)
        for epoch in epochs:  # (no epoch limit: a loader without len and a length in steps)
            if st.max_steps_reached:
                break
            if st.stop_training or not self._train_epoch(run, epoch, checkpoints):  # (asked before a batch ran)
                self._stops_after(epoch)
                break
            if checkpoints.preempted:
                break
            self._evaluate_after_epoch(run)
            if st.epoch_finished:  # a finished epoch; a cut-short one is continued by the next fit
                st.epoch += 1
                st.batch_idx = 0
            if checkpoints.at_epoch_boundary() or self._stops_after(epoch):  # (a safe point: interval saves)
                break
        self.check_losses_finite()
        checkpoints.finish()
        self.fire(Event.AFTER_TRAIN)

    def _note_cut_epoch(self) -> None:
        """The epoch stops short of its end (``max_steps``, a stop, a preemption), before its end events: note
        where, this rank's train sums so far and the history's length, as the checkpoint taken at this point
        holds them, for the next fit to continue the epoch (``_continue_cut_epoch``)."""
        if self._recorder is not None:
            self._recorder.flush()  # (the steps' values kept on the device join the history before the mark)
        st = self.state
        self._cut = _CutEpoch((st.epoch, st.batch_idx, st.step), st.iters_per_epoch, self._metric_sums.state_dict(),
                              len(self.history))
        self._epoch_start.note_cut()

    def _continue_cut_epoch(self) -> None:
        """When the run stands where the last fit cut an epoch short, this fit continues that epoch as a run
        resumed from the checkpoint taken at the cut does: the epoch's train metrics go on from their sums at the
        cut (given back when the epoch begins, after the hooks reset them), and what that fit recorded from the
        cut on (the epoch's values over its first batches, the evaluation after them) leaves the history, so the
        epoch is recorded once, over all its batches, as in an uninterrupted run. Values recorded between the two
        fits (``record_values``) stay."""
        cut, st = self._cut, self.state
        if cut is None or (st.epoch, st.batch_idx, st.step) != cut.position:
            self._cut = None
            return  # (the run was moved: ``state`` set by hand)
        if None not in (cut.batches, st.iters_per_epoch) and cut.batches != st.iters_per_epoch:
            st.batch_idx = self._batch_in_resized_epoch(cut.batches)  # (a refusal keeps the cut for the next fit)
        self._cut = None
        end = cut.end_record if cut.end_record is not None else len(self.history)
        self.history.forget(cut.first_record, end)
        self._metric_sums.load_state_dict(cut.sums)

    def _batch_in_resized_epoch(self, batches: int) -> int:
        """This fit's loader has another number of batches per epoch than the one whose epoch the last fit cut: the
        batch past the same samples, as a resume from the checkpoint at the cut finds it, or a refusal."""
        st = self.state
        position = batch_in_resized_epoch(st.batch_idx, batches, st.iters_per_epoch, self._engine.window.size)
        if position is None:
            raise ValueError(f"fit(train_dataloader=...): the last fit stopped inside epoch {st.epoch}, after "
                             f"{st.batch_idx} of its {batches} batches per rank, but this loader's epoch has "
                             f"{st.iters_per_epoch}, and no whole number of them covers the samples already trained. "
                             f"Fix: continue with a loader of that batch size and data, or finish the epoch with the "
                             f"one it began with")
        log_rank_0(self._logger, f"the last fit stopped after {st.batch_idx} of epoch {st.epoch}'s {batches} batches "
                                 f"per rank; this loader's epoch has {st.iters_per_epoch}: it goes on after batch "
                                 f"{position}, past the same samples")
        return position

    def _stops_after(self, epoch: int) -> bool:
        """The step limit was reached or a hook asked to stop (said on rank 0)."""
        st = self.state
        if st.max_steps_reached:
            if self._verbose:
                log_rank_0(self._logger, f"Max number of steps {st.max_steps} has been reached, "
                                         f"training is stopped automatically")
            return True
        if st.stop_training:
            log_rank_0(self._logger, f"Training stopped at epoch {epoch}, step {st.step}: "
                                     f"{st.stop_reason or 'state.stop_training was set by a hook'}")
            return True
        return False

    def _train_epoch(self, run: "_Run", epoch: int, checkpoints: Optional[CheckpointSession] = None) -> bool:
        """One epoch from ``state.batch_idx`` on; False when a hook stopped the run in ``before_train_epoch``:
        the epoch did not start, so it has no end events and no record."""
        st, engine, timer = self.state, self._engine, self._run_timer
        engine.train()
        st.phase = "train"
        _set_sampler_epoch(run.train_loader, epoch)
        skip = st.batch_idx  # resuming inside the epoch: start after the batches already trained on
        loader = _epoch_loader(run.train_loader)
        read_ahead: Optional[list] = None
        if skip == 0:
            self._epoch_start.begin(epoch)
            data_iter = iter(loader)
        else:
            epoch_rng, read_ahead = self._epoch_start.take(epoch, skip)
            if st.iters_per_epoch is not None:  # a loader without len then, one with len now: its epoch is read from
                read_ahead = None  # the start again (only an epoch without len trains kept batches first)
            if read_ahead is NOT_STORED:
                read_ahead = None
                if is_rank_0():
                    warnings.warn(f"the batches read ahead of training at this point of epoch {epoch} were not kept in "
                                  f"the checkpoint (they are not tensors and plain values): they are read again, and "
                                  f"random draws made while reading them (a data augmentation in the main process) "
                                  f"differ from the uninterrupted run's from here on", stacklevel=3)
            data_iter = _iterate_from(loader, st.iters_per_epoch, skip, epoch_rng, skip + len(read_ahead or ()))
        engine.window.continue_at(skip)
        st.epoch_start_step = st.step - skip // engine.window.size
        total = None if st.iters_per_epoch is None else st.iters_per_epoch - skip  # (no len: count and rate only)
        progress = make_progress(run.display, f"[Epoch {epoch} / Train]", total, self.states, run=st)
        self.fire(Event.BEFORE_TRAIN_EPOCH)
        self._metric_sums.continue_epoch(skip)
        timer.start("Train-epoch")
        boundary = checkpoints.at_step_boundary if checkpoints is not None and checkpoints.active else None
        preempted = self._train_loop(run, data_iter, progress, boundary, read_ahead=read_ahead or ())
        timer.stop("Train-epoch", keep_in_history=True)
        progress.close(st.batch_idx - skip)
        if st.stop_training and st.batch_idx == skip:
            timer.reset("Train-epoch")
            return False
        if not st.epoch_finished:
            self._note_cut_epoch()
        if preempted:  # the checkpoint is written; the epoch did not end, so no epoch-end events
            return True
        self.check_losses_finite()  # (nonfinite_loss='raise': before the epoch's metrics are read and logged)
        self.fire(Event.AFTER_TRAIN_EPOCH)
        timer.reset("Train-epoch")
        return True

    def _train_loop(self, run: "_Run", data_iter: Iterator, progress, boundary=None, until_step: bool = False,
                    read_ahead: Sequence = ()) -> bool:
        """The epoch's micro-batches from ``state.batch_idx`` on, one training step each, with the iteration's
        events around it. Returns True when a checkpoint ``boundary`` asked to stop (preemption).
        ``until_step``: stop after the first optimizer step (test mode). ``read_ahead``: a loader without len, the
        batches the interrupted run had read ahead of ``state.batch_idx``, trained before ``data_iter``'s."""
        st, engine = self.state, self._engine
        epoch = SizedEpoch(engine.window, data_iter, st.iters_per_epoch) if st.iters_per_epoch is not None \
            else UnsizedEpoch(engine.window, data_iter, st, read_ahead)
        self._epoch_start.running(epoch)
        try:
            return self._train_batches(run, epoch, progress, boundary, until_step)
        finally:
            self._epoch_start.loop_ended()

    def _train_batches(self, run: "_Run", epoch, progress, boundary, until_step: bool) -> bool:
        """``_train_loop``'s loop over ``epoch``'s batches."""
        st, engine, h, timer = self.state, self._engine, self._h, self._run_timer
        max_steps = st.max_steps if st.max_steps is not None else math.inf
        while not st.stop_training and epoch.has(st.batch_idx):  # (a stop asked in before_train_epoch: none runs)
            for fn in h.before_train_iter:
                fn(self)
            timer.start("Train-step")  # (a step's time includes loading its batch, or without len its read-ahead)
            where = epoch.place(st.batch_idx)
            if where.first:
                for fn in h.before_zero_grad:
                    fn(self)
                engine.zero_grad()
            batch = epoch.batch(st.batch_idx)
            self._step.run(batch, where)
            st.iteration += 1
            st.batch_idx += 1
            st.step += where.last
            timer.stop("Train-step", keep_in_history=True)
            output, label = (st.output, st.label) if run.return_output_label else (None, None)
            for fn in h.after_train_iter:
                fn(self, output, label, st.loss)
            progress.advance()
            if where.last and until_step:
                return False  # (test mode reads this step's loss)
            # The iteration's outputs and loss (and through them its autograd graph) are let go now, not in the
            # middle of the next step's allocations when its forward overwrites them.
            output = label = st.output = st.loss = None
            if where.last and self._after_optimizer_step(run, progress, boundary):
                return True
            if st.step >= max_steps:
                break
        return False

    def _after_optimizer_step(self, run: "_Run", progress, boundary) -> bool:
        """Evaluate when a step interval is due; then the checkpoint boundary (True: stop, preempted)."""
        if run.test_loader is not None and run.interval.unit is not TimeUnit.EPOCH \
                and run.interval.is_step_boundary(self.state.step):
            progress.pause()  # one live display at a time
            self._eval(run.test_loader, self.state.epoch, run.display, run.return_output_label)
            progress.resume()
        return boundary is not None and bool(boundary())

    def _evaluate_after_epoch(self, run: "_Run") -> None:
        """Evaluate when the epochs completed are a multiple of an ep interval, and at the end of training.

        An evaluation only the end of training asks for puts the random state back afterwards, and runs with
        ``state.closing_evaluation`` set (hooks that decide training's course leave it out): a longer run resumed
        from the final checkpoint (taken after it, so that ``best`` sees its values) then computes what the
        uninterrupted longer run, which makes no evaluation here, computed (a loader's shuffle and worker seeds,
        MixUp, dropout, an early stop's count)."""
        st = self.state
        if run.test_loader is None or st.last_eval_step == st.step:
            return
        completed = st.epoch + 1
        if st.epoch_finished and run.interval.is_epoch_boundary(completed):
            self._eval(run.test_loader, st.epoch, run.display, run.return_output_label)
        elif (st.max_epochs is not None and completed >= st.max_epochs) or st.max_steps_reached or st.stop_training:
            rng, st.closing_evaluation = capture_rng_state(), True
            try:
                self._eval(run.test_loader, st.epoch, run.display, run.return_output_label)
            finally:
                restore_rng_state(rng)
                st.closing_evaluation = False

    # -- evaluate ----------------------------------------------------------------------------------
    def evaluate(self, test_dataloader: Iterable, hooks: Optional[List[BaseHook]] = None, display_progress: bool = False,
                 return_output_label: bool = True, step: Union[UserStep, Callable, None] = None) -> Dict[str, float]:
        """Run the model over ``test_dataloader`` without gradients; returns the test metrics' values (all ranks).

        ``step``: the ``UserStep`` given to ``fit`` (its ``evaluate`` function runs each batch, as in fit's
        evaluations), or a function ``(trainer, batch)`` -> loss or ``(output, label, loss)`` to run instead."""
        st = self.state
        st.reset_states()
        st.fitting, st.will_test = False, True
        try:
            self._attach(hooks, "evaluation", user_step=step)
            display = bool(display_progress) and is_rank_0()
            self._eval(test_dataloader, None, display, return_output_label)
            return {name: metric.get_accumulated_value() for name, metric in self.states["metrics"]["test"].items()}
        finally:
            self._detach()

    def _eval(self, loader, epoch: Optional[int], display: bool, return_output_label: bool,
              max_batches: Optional[int] = None) -> int:
        """One pass of evaluation's step over ``loader`` (at most ``max_batches``); -> the batches run."""
        st, engine, timer = self.state, self._engine, self._run_timer
        was_training = engine.training
        engine.eval()
        # After training each rank's buffers (BatchNorm's statistics) hold its own last batch's update: the first
        # forward brings rank 0's, the model checkpoints keep, so that every evaluation is of that one model. DDP
        # does this by itself only after a synced training forward, not at an evaluation that follows another.
        engine.strategy.sync_buffers_at_next_forward(engine.model)
        st.phase = "test"
        total = _loader_len(loader)
        if max_batches is not None:
            total = max_batches if total is None else min(total, max_batches)
        self.fire(Event.BEFORE_TEST)
        progress = make_progress(display, "Evaluation" if epoch is None else f"[Epoch {epoch} / Test]", total,
                                 self.states)
        self.fire(Event.BEFORE_TEST_EPOCH)
        timer.start("Test-epoch")
        with torch.no_grad():
            count = self._eval_batches(loader, total, return_output_label, progress)
        timer.stop("Test-epoch", keep_in_history=True)
        # The display's last line shows the values over all ranks, as the log line and the history do. Read on
        # every rank (each is a collective), and kept: the epoch-end hooks that read them next reuse them.
        for metric in self.states["metrics"]["test"].values():
            metric.get_accumulated_value()
        progress.close()
        self.fire(Event.AFTER_TEST_EPOCH)
        self.fire(Event.AFTER_TEST)
        for name in ("Test-step", "Test-epoch"):
            if name in timer:
                timer.reset(name)
        st.last_eval_step = st.step
        # the last batch and its output are let go (its loss is kept: a 0-dim tensor test mode reads), so they do not
        # live on into the training forward that follows, as a hand loop's evaluation function lets them go
        st.batch = st.data = st.label = st.output = None
        if was_training:
            engine.train()
            st.phase = "train"
        return count

    def _eval_batches(self, loader, total: Optional[int], return_output_label: bool, progress) -> int:
        """Evaluation's steps, each followed by ``after_test_iter``; a distributed sampler's padded repeats are cut
        from each batch before its forward, so no loss, hook or metric counts them."""
        st, h, timer, step = self.state, self._h, self._run_timer, self._step
        real = RealRows(loader)
        count = 0
        for batch in self._test_batches(loader, total):
            keep = real.of(batch)  # (the loss: the criterion's, or the model's when it gives one)
            step.forward_only(batch, keep=keep, rows=real.rows)
            timer.stop("Test-step", keep_in_history=True)
            output, label = (st.output, st.label) if return_output_label else (None, None)
            for fn in h.after_test_iter:
                fn(self, output, label, st.loss)
            count += 1
            progress.advance()
        return count

    def _test_batches(self, loader, total: Optional[int]) -> Iterator:
        """The evaluation batches, each fetched after ``before_test_iter`` and the step timer started (a step's time
        includes loading its batch); a loader without len is read one batch ahead, so no iteration starts past
        its end."""
        data_iter = iter(loader)
        ahead = next(data_iter, _END) if total is None else None
        count = 0
        while ahead is not _END if total is None else count < total:
            for fn in self._h.before_test_iter:
                fn(self)
            self._run_timer.start("Test-step")
            batch, ahead = (ahead, next(data_iter, _END)) if total is None else (next(data_iter, _END), None)
            if batch is _END:
                return
            yield batch
            count += 1

    # -- predict -----------------------------------------------------------------------------------
    def predict(self, data: Any, loader: Optional[bool] = None):
        """The model's output, in eval mode under ``torch.no_grad`` (the mode is put back afterwards).

        ``data`` is one batch of inputs (a tensor, or a list/tuple/dict spread into the model) or a loader (a
        DataLoader, a generator, or a list of batches; ``loader=True``/``False`` says which when a list could be
        either). Over a loader each batch is split by the schedule as in evaluation, the outputs are joined
        along the first dimension, and with a distributed sampler they are gathered from every rank (a
        collective: every rank must call it) into one row per sample, in dataset order, the sampler's padding
        removed."""
        engine = self._engine
        # the mode of every module as found (one the user set on the model itself, a BatchNorm frozen in eval mode),
        # and the engine's own flag
        modes, was_training = [(m, m.training) for m in engine.model.modules()], engine.training
        engine.eval()
        try:
            with torch.no_grad():
                if is_loader(data) if loader is None else loader:
                    return predict_loader(engine, data)
                return call_with(engine, move_to_device(data, engine.device))
        finally:
            engine.training = was_training
            for module, mode in modes:
                module.training = mode

    # -- test mode -----------------------------------------------------------------------------------
    def _test_mode(self, run: "_Run") -> TestModeResult:
        """One optimizer step (one window of micro-batches) and one eval batch through all hooks; then a verdict."""
        st = self.state
        saved_progress, saved_hooks = st.state_dict(), self._hooks_test_mode_puts_back()
        st.test_mode = True
        try:
            return self._test_mode_run(run, saved_progress, saved_hooks)
        finally:
            st.test_mode = False

    def _test_mode_run(self, run: "_Run", saved_progress: Dict[str, Any], saved_hooks) -> TestModeResult:
        """``_test_mode``'s run, with ``state.test_mode`` set (hooks that write files read it)."""
        st, engine = self.state, self._engine
        engine.train()
        self.fire(Event.BEFORE_TRAIN)
        st.phase = "train"
        self.fire(Event.BEFORE_TRAIN_EPOCH)
        engine.window.continue_at(st.batch_idx)
        self._train_loop(run, iter(_epoch_loader(run.train_loader)), NO_PROGRESS, until_step=True)
        n_train = st.iteration - saved_progress["iteration"]
        train_loss = None if st.loss is None else st.loss.detach().float()  # (a step of the user's may give none)
        updated = st.updated
        self.fire(Event.AFTER_TRAIN_EPOCH)
        eval_loss, n_eval = None, 0
        if run.test_loader is not None:
            n_eval = self._eval(run.test_loader, st.epoch, False, run.return_output_label, max_batches=1)
            if st.loss is not None:
                eval_loss = st.loss.detach().float()
        checkpoint_note = checkpoint_round_trip(self, run.train_loader)
        self.fire(Event.AFTER_TRAIN)
        losses = [loss for loss in (train_loss, eval_loss) if loss is not None]
        finite = self._all_finite(losses)
        st.load_state_dict(saved_progress)
        for hook, state in saved_hooks:
            hook.load_state_dict(state)
        train_loss, eval_loss = (None if loss is None else float(loss.item()) for loss in (train_loss, eval_loss))
        result = _test_mode_result(finite, checkpoint_note, n_train, n_eval, run.test_loader is not None,
                                   train_loss, eval_loss, bool(updated))
        self.test_mode_result = result
        if not result.ok:
            raise TestModeFailed(result)
        log_rank_0(self._logger if self._logger is not None else get_dist_logger(), result.message)
        return result

    def _hooks_test_mode_puts_back(self) -> List[Tuple[BaseHook, Dict[str, Any]]]:
        """``(hook, a copy of its state)`` of each hook with a state, for test mode to put back: what a hook
        learns from one batch (an early stop's best loss, an average) must not carry into the run. A hook whose
        state is a scheduler's (``checkpoint_entry`` 'lr_schedulers') keeps the step, as the scheduler does."""
        return [(hook, copy.deepcopy(hook.state_dict())) for hook in self.state_registry.parts("hooks").values()
                if getattr(hook, "checkpoint_entry", None) != "lr_schedulers"]

    def _all_finite(self, losses: List[torch.Tensor]) -> bool:
        """The losses and every parameter are finite on every rank (one all-reduce: all ranks give one verdict)."""
        # each rank checks its own shard of a sharded parameter (a ZeRO 2/3 DTensor, which no collective takes)
        params = [p.to_local() if hasattr(p, "to_local") else p for p in self._engine.unwrapped_model.parameters()]
        checks = [torch.isfinite(x).all() for x in losses] + [torch.isfinite(p.detach()).all() for p in params]
        flag = torch.stack(checks).all().to(torch.float32).reshape(1).to(self._engine.device)
        return bool(all_reduce_min_(flag).item() > 0)

    # -- state ------------------------------------------------------------------------------------------
    #: The checkpoint (a folder or a merged file's ``Path``) the run was last restored from: set by the restore
    #: before ``on_load_checkpoint`` fires, so a hook can name it; None when nothing was restored.
    restored_from = None

    #: What the last ``fit(..., test_mode=True)`` ran and found (a ``TestModeResult``); None before one ran.
    test_mode_result: Optional[TestModeResult] = None

    @property
    def logger(self):
        """The logger given to the Trainer (None: none was given)."""
        return self._logger

    @property
    def checkpoints(self) -> Optional[CheckpointSession]:
        """The checkpoints of the running ``fit`` (resume, saves at safe points, preemption); None outside it."""
        return self._checkpoints

    def register_for_checkpointing(self, obj: Any, key: Optional[str] = None) -> str:
        """Keep ``obj``'s state in every checkpoint of this trainer and give it back on resume: any object with
        ``state_dict()`` and ``load_state_dict(state)`` (a sampler of your own, a torch ``Generator`` wrapper, a
        second optimizer, a data-augmentation schedule). ``key`` names it in the checkpoint (default: its class
        name and its order among the registered objects of that class, ``'Curriculum.0'``); returns the key.
        Register before ``fit``; a state restored before its object was registered is loaded when it is."""
        for method in ("state_dict", "load_state_dict"):
            if not callable(getattr(obj, method, None)):
                raise TypeError(f"register_for_checkpointing: {type(obj).__name__} has no {method}(); give an object "
                                f"with state_dict() and load_state_dict(state)")
        registered = self.state_registry.parts("objects")
        if key is None:
            kind = type(obj).__name__
            key = f"{kind}.{sum(k.rsplit('.', 1)[0] == kind for k in registered)}"
        if key in registered and registered[key] is not obj:
            raise ValueError(f"register_for_checkpointing: the key {key!r} is taken by another object; give another")
        self.state_registry.add("objects", key, obj)
        self.state_registry.hand_on("objects")
        return key

    def state_dict(self) -> Dict[str, Any]:
        """``{'progress', 'hooks', 'history', 'trackers', 'objects'}``: the state of each registered part
        (``state_registry``): hooks by key (``'EarlyStoppingHook.0'``, those with a state), the running fit's
        trackers, the objects given to ``register_for_checkpointing``. Inside ``fit`` the values recorded since
        the last flush are not in the history yet; a checkpoint reads them first (on every rank)."""
        return self.state_registry.state()

    def record_values(self, values: Dict[str, float], step: Optional[int] = None, epoch: Optional[int] = None) -> None:
        """Record ``values`` a hook measured (every rank alike) into the history and, during ``fit``, the trackers;
        a test-mode fit keeps none (it leaves the history as it found it)."""
        if self.state.fitting and self._recorder is None:  # (a fit records through its Recorder, except in test mode)
            return
        step = self.state.step if step is None else step
        epoch = self.state.epoch if epoch is None else epoch
        if self._recorder is not None:
            self._recorder.record(step, epoch, values)
        else:
            self.history.add_values(step, epoch, time.time(), values)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore progress and history now; each hook's, tracker's and object's state goes to the part
        registered under its key now, or waits for it (the hooks the next ``fit`` attaches)."""
        self.state_registry.load(state)


class _Run:
    """The arguments of one fit call that the loop reads."""

    __slots__ = ("train_loader", "test_loader", "interval", "display", "return_output_label")

    def __init__(self, train_loader, test_loader, interval: Interval, display: bool, return_output_label: bool):
        self.train_loader = train_loader
        self.test_loader = test_loader
        self.interval = interval
        self.display = display
        self.return_output_label = return_output_label
