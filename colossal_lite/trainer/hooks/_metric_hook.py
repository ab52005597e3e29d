"""Metrics and the hooks that feed them.

A metric accumulates on the device during an epoch (no host sync per step). Reading its epoch
value (``get_accumulated_value``) all-reduces over the data-parallel ranks once, then caches the
result until the next ``update``/``reset``, so every rank must read it at the same point and a
second read returns the same number. ``last_step_value()`` gives the last iteration's value of
this rank as a device tensor (or a float), for the progress display and step logs.
"""
from __future__ import annotations

import functools
import time
from collections.abc import MutableMapping
from typing import Any, Callable, Dict, Optional

import torch

from ...core.dist import all_reduce_sum_, is_rank_0, world_size
from ...utils.checkpointing import load_scheduler_state
from ..progress import format_number, to_number
from ._base_hook import BaseHook
from ._schedule_length import warn_if_schedule_ends_early
from ._utils import device_of, resolve_metric

__all__ = ["Metric", "LossMetric", "AccuracyMetric", "LearningRateMetric", "ThroughputMetric", "MetricHook",
           "LossHook", "AccuracyHook", "LRSchedulerHook", "ThroughputHook", "LogMetricByStepHook"]


def _scalar(value: torch.Tensor, what: str) -> torch.Tensor:
    """``value`` detached, as a 0-dim tensor; a clear error when it holds more than one number."""
    value = value.detach()
    if not value.dim():  # the usual case, first
        return value
    if value.numel() != 1:
        raise RuntimeError(f"{what} must be one number per batch, got a tensor of shape {tuple(value.shape)}; "
                           f"reduce it first (e.g. loss.mean())")
    return value.reshape(())


def _wide_dtype(device: torch.device) -> torch.dtype:
    """float64 for sums read once per epoch; float32 on MPS, which has no float64."""
    return torch.float32 if device.type == "mps" else torch.float64


def _part_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a few updates are summed in: the values' own when adding them needs no conversion."""
    if dtype in (torch.float32, torch.float64, torch.int64):
        return dtype
    return torch.float32 if dtype.is_floating_point else torch.int64


class _RunningSum:
    """A weighted sum of 0-dim device tensors, for an epoch: one small in-place kernel per update, no
    allocation, no host sync, and nothing from the step kept alive.

    Updates are added in place to a part in the values' dtype (float32 for a loss), unweighted: every value in
    a part has the same weight (a loss's batch size), which multiplies the part when it is added to a float64
    total (float32 on MPS). That happens every ``fold_every`` updates, when the weight changes (a last, smaller
    batch) and when the sum is read, so a long epoch keeps its precision and an update is a plain ``add_``
    (an ``alpha`` or a float32 value added straight into float64 would be extra work at each step).
    The values are summed as they come rather than kept to sum later: on the CPU those small live tensors,
    placed between the step's large buffers, make glibc trim and regrow the heap again and again.

    Values must not require grad: the metrics detach a training loss first.
    """

    fold_every = 16

    def __init__(self):
        self._part: Optional[torch.Tensor] = None
        self._weight: Any = 1  # the weight of every value in the part
        self._in_part = 0
        self._total: Optional[torch.Tensor] = None

    def add(self, value: torch.Tensor, weight=1) -> None:
        part = self._part
        if part is None or weight != self._weight or self._in_part >= self.fold_every:
            part = self._new_part(value, weight)
        try:
            part.add_(value)
        except RuntimeError:  # a fractional value after integer ones: go on in float32
            if part.is_floating_point():
                raise
            self._fold()
            part = self._part = torch.zeros((), dtype=torch.float32, device=part.device)
            part.add_(value)
        self._in_part += 1

    def _new_part(self, value: torch.Tensor, weight) -> torch.Tensor:
        """Fold the part so far; the next one holds values of ``weight`` in ``value``'s dtype (integer counts
        stay exact in int64; the weight, whole or not, multiplies them only in the float64 fold)."""
        self._fold()
        part = self._part
        if part is None or part.device != value.device:
            part = self._part = torch.zeros((), dtype=_part_dtype(value.dtype), device=value.device)
        self._weight = weight
        return part

    def _fold(self) -> None:
        part = self._part
        if part is None or not self._in_part:
            return
        if self._total is None:
            self._total = torch.zeros((), dtype=_wide_dtype(part.device), device=part.device)
        self._total.add_(part, alpha=self._weight)  # (once per fold, not per update)
        part.zero_()
        self._in_part = 0

    def state(self) -> Dict[str, Any]:
        """The sum so far as CPU tensors: the float64 total and the part not yet added to it, with its weight
        (kept apart, so a run that continues from it adds in the same groups as one never stopped, to the
        last bit)."""
        return {"sum": None if self._total is None else self._total.to("cpu", copy=True),
                "part": None if self._part is None else self._part.to("cpu", copy=True), "in_part": self._in_part,
                "weight": self._weight}

    def load_state(self, state: Dict[str, Any], device: torch.device) -> None:
        """Continue from ``state()`` (or from ``{'sum': total}`` alone; a part saved without its weight holds
        values already weighted), on ``device``."""
        total, part = state.get("sum"), state.get("part")
        self._total = None if total is None else \
            total.detach().to(device=device, dtype=_wide_dtype(device), copy=True).reshape(())
        self._part = None if part is None else part.detach().to(device=device, copy=True).reshape(())
        self._in_part = int(state.get("in_part", 0)) if part is not None else 0
        self._weight = state.get("weight", 1)

    def peek(self) -> Optional[torch.Tensor]:
        """The sum so far as a new 0-dim tensor, None before any value. Unlike ``value`` it does not fold: a
        display reading it at its own moments leaves the sum's grouping (and so its last bits) as it was."""
        part = self._part * self._weight if self._part is not None and self._in_part else None
        if self._total is None:
            return part
        return self._total.clone() if part is None else self._total + part

    def value(self, device: torch.device) -> torch.Tensor:
        """A copy of the sum so far, 0-dim float64 (float32 on MPS), on the updates' device (``device`` if none)."""
        self._fold()
        if self._total is not None:
            return self._total.clone()
        return torch.zeros((), dtype=_wide_dtype(device), device=device)


class Metric:
    """Base metric: ``reset``, ``update``, ``last_step_value`` (no sync), ``get_accumulated_value`` (all ranks)."""

    def __init__(self, epoch_only: bool, device: Optional[torch.device] = None):
        self._epoch_only = bool(epoch_only)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._cached: Optional[float] = None

    @property
    def epoch_only(self) -> bool:
        """True when only the epoch value is meaningful (not logged per step by TensorboardHook)."""
        return self._epoch_only

    def reset(self) -> None:
        self._cached = None

    def update(self, *args, **kwargs) -> None:
        raise NotImplementedError

    def last_step_value(self) -> Any:
        """This rank's value at the last update: a device tensor or a float, or None before any update. A tensor
        returned here must not be changed in place later: the history holds it for a few steps before copying it."""
        return None

    def running_value(self) -> Any:
        """This rank's value over the epoch so far (a device tensor or a float; None before any update), not
        reduced over ranks: what a progress display shows during evaluation. By default the last step's."""
        return self.last_step_value()

    def known_accumulated_value(self) -> Optional[float]:
        """``get_accumulated_value()``'s result when it was read since the last update, else None (no collective)."""
        return self._cached

    def get_last_step_value(self) -> Any:
        """``last_step_value()`` as a Python number (reads the device)."""
        return to_number(self.last_step_value())

    def partial_state(self) -> Optional[Dict[str, Any]]:
        """This rank's sums of the epoch so far, for a checkpoint taken inside an epoch (None: not resumable).

        Reads the device (at a checkpoint, not per step). A run resumed inside that epoch continues the sums
        (``load_partial_state``), so its epoch value is the uninterrupted run's."""
        return None

    def load_partial_state(self, state: Dict[str, Any]) -> None:
        """Continue the epoch from ``partial_state()``'s result."""

    def get_accumulated_value(self) -> float:
        """The epoch value reduced over the data-parallel ranks (cached until the next update or reset)."""
        if self._cached is None:
            self._cached = self._compute_accumulated()
        return self._cached

    def _compute_accumulated(self) -> float:
        raise NotImplementedError

    @staticmethod
    def is_better(a, b) -> bool:
        raise NotImplementedError


class _RatioMetric(Metric):
    """An epoch value ``sum / count``: ``_sum`` a ``_RunningSum`` on the device, ``_count`` a host int (or a 0-dim
    device tensor, when the weights are counted on the device: a per-token mean's real tokens).

    Resumable inside an epoch (``partial_state``); read over all ranks with one all-reduce.
    """

    def reset(self) -> None:
        super().reset()
        self._sum = _RunningSum()
        self._count = 0

    def partial_state(self) -> Dict[str, Any]:
        count = self._count.to("cpu", copy=True) if isinstance(self._count, torch.Tensor) else self._count
        return {**self._sum.state(), "count": count}

    def load_partial_state(self, state: Dict[str, Any]) -> None:
        self.reset()
        self._sum.load_state(state, self.device)
        count = state["count"]
        self._count = count.to(self.device, copy=True) if isinstance(count, torch.Tensor) else int(count)

    def running_value(self):
        total = self._sum.peek()
        return None if total is None or not self._count else total / self._count

    def _compute_accumulated(self) -> float:
        total = self._sum.value(self.device)
        buf = torch.stack([total, torch.as_tensor(self._count, dtype=total.dtype, device=total.device)])
        value_sum, count = all_reduce_sum_(buf).tolist()
        return value_sum / count if count else float("nan")


class LossMetric(_RatioMetric):
    """Mean loss per sample over the epoch (each batch's mean loss weighted by its size), over all ranks; per real
    token under ``grad_reduction='per-token-mean'`` (each batch's per-token mean weighted by its tokens).

    An update adds the loss to a ``_RunningSum`` on the device (one small in-place kernel, no host sync).
    The sum of loss * samples is all-reduced once, when the epoch value is read.
    """

    def __init__(self, epoch_only: bool, device: Optional[torch.device] = None):
        super().__init__(epoch_only, device)
        self.reset()

    def reset(self) -> None:
        super().reset()
        self._last: Optional[torch.Tensor] = None

    def update(self, loss: torch.Tensor, num_samples: int = 1) -> None:
        if loss.ndim:
            loss = _scalar(loss, "LossMetric: the loss")
        elif loss.requires_grad:  # a training loss: its graph (and any activation not yet freed) is not kept
            loss = loss.data  # (a detached alias, as ``detach()`` gives, made without a dispatched operator call)
        if isinstance(num_samples, torch.Tensor):  # a token count on the device: weighed there, never read per step
            self._sum.add(loss * num_samples.to(loss.dtype))
        else:
            self._sum.add(loss, num_samples)
        self._count = self._count + num_samples
        self._last = loss
        self._cached = None

    def last_step_value(self):
        return self._last

    @staticmethod
    def is_better(a, b) -> bool:
        return a < b


class AccuracyMetric(_RatioMetric):
    """Fraction of correct predictions; ``accuracy_func(logits, targets)`` returns the number correct.

    The counts are summed in a ``_RunningSum`` on the device (no host sync per batch).
    """

    def __init__(self, epoch_only: bool, accuracy_func: Callable, device: Optional[torch.device] = None):
        super().__init__(epoch_only, device)
        if not callable(accuracy_func):
            raise TypeError(f"AccuracyMetric needs a callable accuracy_func(logits, targets) -> number correct, "
                            f"got {accuracy_func!r}")
        self.accuracy_func = accuracy_func
        self.reset()

    def reset(self) -> None:
        super().reset()  # _sum: predictions right; _count: predictions made
        self._last_correct: Optional[torch.Tensor] = None
        self._last_total = 0

    def update(self, logits, targets, batch_size: Optional[int] = None) -> None:
        if isinstance(logits, (list, tuple)):
            logits = logits[0]
        if isinstance(targets, (list, tuple)):
            targets = targets[0]
        n = int(targets.shape[0]) if isinstance(targets, torch.Tensor) and targets.dim() > 0 else \
            (1 if batch_size is None else int(batch_size))
        if not n:  # an evaluation batch that was only a sampler's padding: nothing to count, and no
            return  # accuracy_func is asked about an empty batch, which some cannot take
        correct = self.accuracy_func(logits, targets)
        if not isinstance(correct, torch.Tensor):
            correct = torch.tensor(correct, device=logits.device)
        if correct.dim() or correct.requires_grad:  # (0-dim and without a graph: as it is)
            correct = _scalar(correct, "AccuracyMetric: accuracy_func's result (the number correct)")
        self._sum.add(correct)
        self._count += n
        self._last_correct, self._last_total = correct, n
        self._cached = None

    def last_step_value(self):
        if self._last_correct is None or not self._last_total:
            return None
        return self._last_correct / self._last_total

    @staticmethod
    def is_better(a, b) -> bool:
        return a > b


class TorchmetricsMetric(Metric):
    """A ``torchmetrics.Metric`` behind the Metric interface (torchmetrics syncs ranks in ``compute``)."""

    def __init__(self, epoch_only: bool, metric, device: Optional[torch.device] = None):
        super().__init__(epoch_only, device)
        self.metric = metric.to(self.device)

    def reset(self) -> None:
        super().reset()
        self.metric.reset()

    def update(self, logits, targets, batch_size: Optional[int] = None) -> None:
        if isinstance(logits, (list, tuple)):
            logits = logits[0]
        if isinstance(targets, torch.Tensor) and targets.dim() and not targets.shape[0]:
            return  # an evaluation batch that was only a sampler's padding (torchmetrics refuses an empty one)
        self.metric.update(logits.detach(), targets)
        self._cached = None

    def _compute_accumulated(self) -> float:
        return float(self.metric.compute())

    @staticmethod
    def is_better(a, b) -> bool:
        return a > b


def _is_torchmetrics_metric(obj) -> bool:
    """True for a torchmetrics.Metric instance, found without importing torchmetrics."""
    return any(cls.__module__.split(".")[0] == "torchmetrics" and cls.__name__ == "Metric"
               for cls in type(obj).__mro__)


class LearningRateMetric(Metric):
    """The learning rate of the first parameter group (a float; the same on every rank, no reduction).

    With ``source`` (a callable returning the current learning rate) the value is read when asked, so
    following the schedule adds no work to a step; ``update(lr)`` sets a value instead. The epoch log line
    shows ``trained_lr``: a scheduler steps at the epoch's end before the line is written, and the line is
    about the epoch that ran.
    """

    def __init__(self, epoch_only: bool, initial_lr: float = 0.0, device: Optional[torch.device] = None,
                 source: Optional[Callable[[], float]] = None):
        super().__init__(epoch_only, device)
        self._lr = float(initial_lr)
        self._source = source
        self._trained: Optional[float] = None  # the LR of the last update, noted before the scheduler moved on

    @property
    def lr(self) -> float:
        return float(self._source()) if self._source is not None else self._lr

    def reset(self) -> None:
        """A new epoch: forget the LR noted at the last one's end. The LR itself is a running value, kept across
        epochs; but the note belongs to the epoch whose updates it was taken after, and an epoch that ends without
        one (cut short by ``max_steps`` or a stop, or whose scheduler steps on a test metric after its line is
        written) would otherwise show the epoch before's LR."""
        self._trained = None

    def update(self, lr: float) -> None:
        self._lr = float(lr)
        self._source = None
        self._trained = None

    def note_trained(self, lr: float) -> None:
        """``lr`` is what the updates so far trained at (``LRSchedulerHook`` notes it before stepping)."""
        self._trained = float(lr)

    @property
    def trained_lr(self) -> float:
        """The LR the last update trained at (the current LR while none is noted)."""
        return self.lr if self._trained is None else self._trained

    def get_accumulated_info(self) -> str:
        """The epoch log line's text: the LR the epoch trained at, not the one its end's scheduler step set."""
        return format_number(self.trained_lr)

    def last_step_value(self):
        return self.lr

    def get_accumulated_value(self) -> float:
        """The current LR, read each time: it is the same on every rank (no collective), and a cached value
        would go stale as soon as the scheduler steps, which is no ``update`` of this metric."""
        return self.lr

    @staticmethod
    def is_better(a, b) -> bool:
        return False


class ThroughputMetric(Metric):
    """Samples per second (all ranks together); the first ``ignored_steps`` updates of an epoch are left out.

    ``update(num_samples, time)``: samples of this rank and the seconds they took. The epoch value sums
    samples over ranks and divides by the ranks' mean time; with ``use_local`` it takes this rank's
    samples times the number of ranks (no collective). ``tflop_per_step``: TFLOP of one update on one rank.
    """

    def __init__(self, epoch_only: bool, ignored_steps: int = 0, tflop_per_step: float = 0, use_local: bool = False,
                 device: Optional[torch.device] = None):
        super().__init__(epoch_only, device)
        self.ignored_steps = int(ignored_steps)
        self.tflop_per_step = float(tflop_per_step)
        self.use_local = bool(use_local)
        self.reset()

    #: Called before the epoch value is computed (``ThroughputHook``: the time since its last update and the device's
    #: queued work join the counted time), so that whoever reads the value first reads the whole epoch's.
    before_read: Optional[Callable[[], None]] = None

    def reset(self) -> None:
        super().reset()
        self._updates = 0
        self._samples = 0
        self._time = 0.0
        self._counted = 0
        self._last: Optional[float] = None
        self._reduced_time = 0.0
        self.open = False  # updated since the time after its last update was added (``before_read``)

    def update(self, num_samples: int, time: float) -> None:
        self._updates += 1
        self.open = True
        if time > 0:
            self._last = num_samples * world_size() / time
        if self._updates > self.ignored_steps:
            self._samples += num_samples
            self._time += time
            self._counted += 1
        self._cached = None

    def add_time(self, seconds: float) -> None:
        """Add seconds that belong to the counted updates (e.g. device work finished at the epoch's end)."""
        if self._counted:
            self._time += seconds
            self._cached = None

    def last_step_value(self):
        return self._last

    def _compute_accumulated(self) -> float:
        if self.before_read is not None:
            self.before_read()
        world = world_size()
        if self.use_local:
            samples, mean_time = self._samples * world, self._time
        else:
            buf = torch.tensor([float(self._samples), self._time], dtype=_wide_dtype(self.device), device=self.device)
            samples, time_sum = all_reduce_sum_(buf).tolist()
            mean_time = time_sum / world
        self._reduced_time = mean_time
        return samples / mean_time if mean_time > 0 else float("nan")

    def get_last_step_info(self) -> str:
        value = self._last if self._last is not None else 0.0
        return f"{format_number(value)} sample_per_sec"

    def get_accumulated_info(self) -> str:
        """``'N sample_per_sec'`` plus ``', T Tflops'`` (per rank) when ``tflop_per_step`` is set; all ranks."""
        value = self.get_accumulated_value()
        info = f"{format_number(value)} sample_per_sec"
        if self.tflop_per_step > 0 and self._reduced_time > 0:
            info += f", {format_number(self.tflop_per_step * self._counted / self._reduced_time)} Tflops"
        return info

    @staticmethod
    def is_better(a, b) -> bool:
        return a > b


class MetricHook(BaseHook):
    """Base of hooks that put metrics into ``trainer.states['metrics'][phase][name]``."""

    def __init__(self, priority: int):
        super().__init__(priority)
        self._is_stage_to_compute = True  # no pipeline stages in colossal_lite

    def _check_metric_states_initialization(self, trainer) -> None:
        metrics = trainer.states.setdefault("metrics", {})
        metrics.setdefault("train", {})
        metrics.setdefault("test", {})

    def _register_metric(self, trainer, phase: str, name: str, metric: Any, fix: str = "") -> None:
        """Put ``metric`` at ``trainer.states['metrics'][phase][name]``; a name another hook of the run put there
        already is refused: the second would replace the first in every reader (history, log, best checkpoint)."""
        metrics = trainer.states["metrics"][phase]
        if name in metrics:
            raise ValueError(f"{type(self).__name__} reports the {phase} metric '{name}', which another hook of this "
                             f"run reports already, and would replace it: "
                             + (fix or f"keep one {type(self).__name__}"))
        metrics[name] = metric


def _num_samples(trainer) -> int:
    """Samples in the batch loaded last (1 when it has no batch dimension); 0 for an evaluation batch that was
    only a distributed sampler's padding."""
    size = trainer.engine.schedule.batch_size
    return 1 if size is None else size


def samples_in(trainer, label) -> int:
    """Samples in this batch, as the metrics a user reads count them (the loss's weight, the throughput): the
    label tensor's first dimension, else the batch's (``_num_samples``). A sequence-first batch (``[T, B, F]``
    inputs, ``[B]`` labels) counts its B samples."""
    if type(label) is torch.Tensor and label.ndim:
        return label.shape[0]
    return _num_samples(trainer)


class LossHook(MetricHook):
    """Train and test ``'Loss'``: the mean loss per sample of the epoch (per real token under
    ``grad_reduction='per-token-mean'``)."""

    reads_train_output = False  # (BaseHook.reads_train_output)

    def __init__(self, priority: int = 0):
        super().__init__(priority)

    def after_hook_is_attached(self, trainer):
        self._check_metric_states_initialization(trainer)
        self._reduction = trainer.engine.reduction  # (a per-token mean's losses are weighed by their tokens)
        device = device_of(trainer)
        self.train_loss = LossMetric(epoch_only=False, device=device)
        self.test_loss = LossMetric(epoch_only=True, device=device)
        self._register_metric(trainer, "train", "Loss", self.train_loss)
        self._register_metric(trainer, "test", "Loss", self.test_loss)

    def before_train_epoch(self, trainer):
        self.train_loss.reset()

    def after_train_iter(self, trainer, output, label, loss):
        if loss is not None:  # (``samples_in``, its common case inline: this runs once per micro-step)
            shape = label.shape if type(label) is torch.Tensor else None
            self.train_loss.update(loss, self._reduction.loss_count(shape[0] if shape else _num_samples(trainer)))

    def before_test_epoch(self, trainer):
        self.test_loss.reset()

    def after_test_iter(self, trainer, output, label, loss):
        if loss is not None:
            self.test_loss.update(loss, self._reduction.loss_count(samples_in(trainer, label)))


def logits_of(output: Any) -> Any:
    """The logits in a model's output: a dict's (a Hugging Face ``ModelOutput``'s) ``'logits'``, else the output."""
    if not isinstance(output, dict):
        return output
    if "logits" not in output:
        raise ValueError(f"the model's output is a {type(output).__name__} with no 'logits' entry (it has "
                         f"{list(output.keys())}): say where the logits are, e.g. "
                         f"AccuracyHook(..., logits_from=lambda output: output[{next(iter(output), 'key')!r}])")
    return output["logits"]


def labels_of(label: Any) -> Any:
    """The targets in a label: a dict's ``'labels'`` entry, else the label."""
    if not isinstance(label, dict):
        return label
    if "labels" not in label:
        raise ValueError(f"the label is a dict with no 'labels' entry (it has {list(label.keys())}): say where the "
                         f"targets are, e.g. AccuracyHook(..., labels_from=lambda label: label[...])")
    return label["labels"]


def _checked_function(fn: Optional[Callable], default: Callable, name: str) -> Callable:
    if fn is None:
        return default
    if not callable(fn):
        raise TypeError(f"AccuracyHook({name}=...) must be a function, e.g. {name}=lambda x: x[...]; got {fn!r}")
    return fn


class AccuracyHook(MetricHook):
    """Test ``'Accuracy'`` (and train ``'Accuracy'`` with ``track_train=True``).

    ``accuracy_func(logits, targets)`` returns the number of correct predictions (e.g.
    ``colossal_lite.nn.metric.Accuracy()``); a ``torchmetrics`` metric is also accepted.
    ``logits_from(output)`` and ``labels_from(label)`` say where the logits and the targets are; by default a
    dict output (a Hugging Face ``ModelOutput``) gives its ``'logits'`` and a dict label its ``'labels'``.
    ``name``: the metric's name, so that one run can report two accuracies (``AccuracyHook(Accuracy(topk=5),
    name='Accuracy_top5')`` beside the top-1 one).
    """

    def __init__(self, accuracy_func: Callable, priority: int = 0, track_train: bool = False,
                 logits_from: Optional[Callable] = None, labels_from: Optional[Callable] = None,
                 name: str = "Accuracy"):
        super().__init__(priority)
        if isinstance(accuracy_func, type):  # a class is callable too, but calling it builds a metric
            raise TypeError(f"AccuracyHook(accuracy_func=...): got the class {accuracy_func.__name__}, not a metric; "
                            f"pass an instance: {accuracy_func.__name__}()")
        if not callable(accuracy_func):
            raise TypeError(f"AccuracyHook(accuracy_func=...) must be callable (logits, targets) -> number correct, "
                            f"e.g. colossal_lite.nn.metric.Accuracy(); got {accuracy_func!r}")
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"AccuracyHook(name={name!r}): give the metric's name as a non-empty string without '/', "
                             f"e.g. 'Accuracy_top5'")
        self.name = name
        self.accuracy_func = accuracy_func
        self.track_train = bool(track_train)
        self.logits_from = _checked_function(logits_from, logits_of, "logits_from")
        self.labels_from = _checked_function(labels_from, labels_of, "labels_from")

    @property
    def skipped_events(self):
        """Without ``track_train`` there is nothing to do in training iterations: the trainer does not call these."""
        return () if self.track_train else ("before_train_epoch", "after_train_iter")

    def _make(self, epoch_only: bool, device) -> Metric:
        if _is_torchmetrics_metric(self.accuracy_func):
            import copy

            return TorchmetricsMetric(epoch_only, copy.deepcopy(self.accuracy_func), device=device)
        return AccuracyMetric(epoch_only=epoch_only, accuracy_func=self.accuracy_func, device=device)

    def after_hook_is_attached(self, trainer):
        self._check_metric_states_initialization(trainer)
        device = device_of(trainer)
        self.metric = self._make(True, device)
        fix = "give one of them another name, e.g. AccuracyHook(..., name='Accuracy_top5')"
        self._register_metric(trainer, "test", self.name, self.metric, fix)
        self.train_metric = None
        if self.track_train:
            self.train_metric = self._make(False, device)
            self._register_metric(trainer, "train", self.name, self.train_metric, fix)

    @staticmethod
    def _check(output, label):
        if output is None or label is None:
            raise RuntimeError("AccuracyHook needs the model outputs and labels, but they were not passed to the hooks: "
                               "call fit/evaluate with return_output_label=True")

    def before_test(self, trainer):
        self.metric.reset()

    def after_test_iter(self, trainer, output, label, *args):
        self._check(output, label)
        self.metric.update(self.logits_from(output), self.labels_from(label), _num_samples(trainer))

    def before_train_epoch(self, trainer):
        if self.train_metric is not None:
            self.train_metric.reset()

    def after_train_iter(self, trainer, output, label, *args):
        if self.train_metric is not None:
            self._check(output, label)
            self.train_metric.update(self.logits_from(output), self.labels_from(label), _num_samples(trainer))


def _is_plateau(lr_scheduler) -> bool:
    """A ``ReduceLROnPlateau`` (also inside the engine's ``EngineLRScheduler``): it steps on a metric value."""
    inner = getattr(lr_scheduler, "lr_scheduler", lr_scheduler)
    return isinstance(inner, torch.optim.lr_scheduler.ReduceLROnPlateau)


class LRSchedulerHook(MetricHook):
    """Steps ``lr_scheduler`` after every optimizer update (or after every finished epoch with ``by_epoch=True``:
    an epoch that ``max_steps`` or a stop cut short steps it when a later ``fit`` finishes it).

    With ``store_lr_in_state`` the learning rate is kept as train metric ``'LR'`` and in ``trainer.state.lr``.
    A step skipped by fp16 (overflow) does not move the schedule.

    ``monitor`` (a metric name such as ``'test/Loss'``, for ``ReduceLROnPlateau``, which needs ``by_epoch=True``):
    the scheduler steps with that metric's epoch value, at the end of each training epoch for a train metric,
    after each evaluation for a test metric.
    """

    reads_train_output = False  # (BaseHook.reads_train_output)

    def __init__(self, lr_scheduler, by_epoch: bool, store_lr_in_state: bool = True, priority: int = 1,
                 monitor: Optional[str] = None):
        super().__init__(priority)
        if not callable(getattr(lr_scheduler, "step", None)):
            raise TypeError(f"LRSchedulerHook needs an LR scheduler with .step(), got {type(lr_scheduler).__name__}")
        if not isinstance(by_epoch, (bool, int)):  # a string such as "no" would be true
            raise TypeError(f"LRSchedulerHook(by_epoch={by_epoch!r}): give True (step after every epoch) or False "
                            f"(after every optimizer update)")
        plateau = _is_plateau(lr_scheduler)
        if plateau and (monitor is None or not by_epoch):
            raise ValueError("LRSchedulerHook: ReduceLROnPlateau steps on a metric once per epoch: pass "
                             "by_epoch=True and monitor='test/Loss' (or another metric, e.g. 'train/Loss', 'Accuracy')")
        if monitor is not None and not plateau:
            raise ValueError(f"LRSchedulerHook(monitor={monitor!r}) is for ReduceLROnPlateau; "
                             f"{type(lr_scheduler).__name__} steps without a metric: leave monitor out")
        in_steps = getattr(lr_scheduler, "milestones_in_steps", None)
        if by_epoch and in_steps:
            raise ValueError(f"LRSchedulerHook(by_epoch=True) steps {type(lr_scheduler).__name__} once per epoch, but "
                             f"its milestones {in_steps} were resolved to optimizer steps, which it would count as "
                             f"epochs (the LR would not decay when meant). Fix: pass by_epoch=False, or give the "
                             f"milestones as epoch numbers (ints) for a scheduler stepped per epoch")
        self.lr_scheduler = lr_scheduler
        self.by_epoch = bool(by_epoch)
        self.store_lr_in_state = bool(store_lr_in_state)
        self.monitor = monitor
        self.metric: Optional[LearningRateMetric] = None

    #: Its state is its scheduler's, kept in the checkpoint's scheduler entry (``shared_state['lr_schedulers']``).
    checkpoint_entry = "lr_schedulers"

    @property
    def watched_metrics(self):
        return () if self.monitor is None else (self.monitor,)

    def state_dict(self) -> Dict[str, Any]:
        """The scheduler's ``state_dict()`` (the engine's wrapper adds how many updates it has seen)."""
        return self.lr_scheduler.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """A scheduler state saved from the engine's wrapper or from a bare scheduler, whichever this one is."""
        load_scheduler_state(self.lr_scheduler, state)

    def on_load_checkpoint(self, trainer, checkpoint):
        self._length_checked = True
        if trainer.restored_from is not None:
            self._warn_if_schedule_ends_early(trainer, trainer.restored_from)

    def before_train(self, trainer):
        """A fit that goes on from an earlier fit of this trainer (no checkpoint read) past the schedule's end: the
        same warning as a resumed one gets."""
        st = trainer.state
        if not self._length_checked and (st.step or st.epoch):
            self._warn_if_schedule_ends_early(trainer, None)

    def _warn_if_schedule_ends_early(self, trainer, restored_from) -> None:
        st = trainer.state
        if st.fitting and st.total_steps and is_rank_0():
            warn_if_schedule_ends_early(trainer.state_registry.key_of(self, "hooks"), self.lr_scheduler, self.by_epoch,
                                        st, restored_from)

    def _current_lr(self) -> float:
        if hasattr(self.lr_scheduler, "get_last_lr"):
            return float(self.lr_scheduler.get_last_lr()[0])
        return float(self.lr_scheduler.optimizer.param_groups[0]["lr"])

    def after_hook_is_attached(self, trainer):
        self._check_metric_states_initialization(trainer)
        self._length_checked = False  # (a checkpoint restored in this fit checks the schedule's length)
        self.metric = None
        if self.store_lr_in_state:  # the metric and state.lr read the scheduler when asked: nothing per step
            self.metric = LearningRateMetric(epoch_only=self.by_epoch, device=device_of(trainer),
                                             source=self._current_lr)
            self._register_metric(trainer, "train", "LR", self.metric,
                                  "pass store_lr_in_state=False to all but one LRSchedulerHook")
            trainer.state.follow_lr(self._current_lr)

    def _step(self, *args) -> None:
        """Step the scheduler; the LR metric first notes the LR that is ending, which the updates trained at."""
        if self.metric is not None:
            self.metric.note_trained(self._current_lr())
        self.lr_scheduler.step(*args)

    def before_train_epoch(self, trainer):
        if self.metric is not None:
            self.metric.reset()  # the LR noted at the last epoch's end is not this epoch's

    def after_train_iter(self, trainer, output, label, loss):
        if not self.by_epoch and trainer.state.updated:
            self._step()

    def _step_on_metric(self, trainer, phase: str) -> None:
        watched_phase, name = resolve_metric(trainer, self.monitor)
        if watched_phase == phase:  # (reading the epoch value is a collective: every rank is here)
            self._step(trainer.states["metrics"][phase][name].get_accumulated_value())

    def after_train_epoch(self, trainer):
        # an epoch cut short (max_steps, a stop) is continued by the next fit, which ends it and steps then
        if not (self.by_epoch and trainer.state.epoch_finished):
            return
        if self.monitor is None:
            self._step()
        else:
            self._step_on_metric(trainer, "train")

    def after_test_epoch(self, trainer):
        st = trainer.state
        if self.monitor is not None and st.fitting and not st.closing_evaluation:
            self._step_on_metric(trainer, "test")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ThroughputHook(MetricHook):
    """Train and test ``'Throughput'`` in samples per second, timed by the hook itself (no timer needed).

    ``ignored_steps``: training iterations left out at the start of each epoch (warm-up); evaluation counts all.

    Each iteration is timed on the host clock from the end of the previous one, so the figure includes
    data loading; at the epoch's end the device is waited for once, so queued work is counted.
    """

    reads_train_output = False  # (BaseHook.reads_train_output)

    def __init__(self, ignored_steps: int = 0, priority: int = 10, tflop_per_step: float = 0, use_local: bool = False):
        super().__init__(priority)
        if int(ignored_steps) < 0:
            raise ValueError(f"ThroughputHook(ignored_steps=...) must be >= 0, got {ignored_steps!r}")
        self._options = dict(ignored_steps=int(ignored_steps), tflop_per_step=tflop_per_step, use_local=use_local)
        self._last = 0.0

    def after_hook_is_attached(self, trainer):
        self._check_metric_states_initialization(trainer)
        device = device_of(trainer)
        self.train_metric = ThroughputMetric(epoch_only=True, device=device, **self._options)
        self.test_metric = ThroughputMetric(epoch_only=True, device=device, **dict(self._options, ignored_steps=0))
        # A hook handling the epoch's end before this one (the same priority, earlier in the list: a log line) reads
        # the value first: the epoch is closed then, so it reads what the history and every later reader get.
        for metric in (self.train_metric, self.test_metric):
            metric.before_read = functools.partial(self._close, metric, trainer)
        self._register_metric(trainer, "train", "Throughput", self.train_metric)
        self._register_metric(trainer, "test", "Throughput", self.test_metric)

    def _tick(self, metric: ThroughputMetric, trainer) -> None:
        now = time.perf_counter()
        metric.update(_num_samples(trainer), now - self._last)
        self._last = now

    def _close(self, metric: ThroughputMetric, trainer) -> None:
        """The device's queued work and the time since the last iteration join the epoch's time, once: at the
        first read of the epoch's value or at the epoch's end, whichever comes first."""
        if not metric.open:
            return
        _synchronize(device_of(trainer))
        now = time.perf_counter()
        metric.add_time(now - self._last)
        self._last, metric.open = now, False

    def before_train_epoch(self, trainer):
        self.train_metric.reset()
        self._last = time.perf_counter()

    def after_train_iter(self, trainer, *args):
        self._tick(self.train_metric, trainer)

    def after_train_epoch(self, trainer):
        self._close(self.train_metric, trainer)

    def before_test_epoch(self, trainer):
        self.test_metric.reset()
        self._last = time.perf_counter()

    def after_test_iter(self, trainer, *args):
        self._tick(self.test_metric, trainer)

    def after_test_epoch(self, trainer):
        self._close(self.test_metric, trainer)


class _StepMetricsView(MutableMapping):
    """``states['step_metrics']`` as a live view, read on access: in training each metric's last-step value, in
    evaluation its value over the batches evaluated so far (a last batch's value says little about a test set),
    this rank's while the evaluation runs and all ranks' once it is over (the value the log line shows).

    A hook of one's own may set values of its own in it, as legacy hooks did in its dict (the progress display
    shows them after the metrics'); a metric's own name is refused, since the view gives the metric's value."""

    def __init__(self, trainer):
        self._trainer = trainer
        self._own: Dict[str, Any] = {}  # values a user's hook set

    def __setitem__(self, key, value):
        if any(name == key for name, _ in self._metric_items()):
            raise KeyError(f"states['step_metrics'][{key!r}] is the metric {key!r}'s value, read from the metric; "
                           f"set a value of your own under another name")
        self._own[key] = value

    def __delitem__(self, key):
        del self._own[key]

    def _items(self):
        yield from self._metric_items()
        yield from self._own.items()

    def _metric_items(self):
        testing = self._trainer.state.phase == "test"
        for name, metric in self._trainer.states["metrics"]["test" if testing else "train"].items():
            if testing:
                value = metric.known_accumulated_value()
                value = metric.running_value() if value is None else value
            else:
                value = metric.last_step_value()
            if value is not None:
                yield name.lower(), value

    def __getitem__(self, key):
        for name, value in self._items():
            if name == key:
                return value
        raise KeyError(key)

    def __iter__(self):
        return (name for name, _ in self._items())

    def __len__(self):
        return sum(1 for _ in self._items())

    def __repr__(self):
        return f"StepMetrics({dict(self._items())!r})"


class LogMetricByStepHook(MetricHook):
    """Makes ``trainer.states['step_metrics']`` show each metric's last-step value (lower-case names).

    It is a live view of the current phase's metrics, so it adds no work to a step, does not depend on
    hook order, and its values stay device tensors until the progress display reads them.
    """

    def __init__(self, priority: int = 10):
        super().__init__(priority)

    def after_hook_is_attached(self, trainer):
        self._check_metric_states_initialization(trainer)
        trainer.states["step_metrics"] = _StepMetricsView(trainer)
