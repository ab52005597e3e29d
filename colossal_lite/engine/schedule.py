"""``NonPipelineSchedule``: the legacy schedule object. It loads a batch, moves it to the device and splits it
into ``(data, label)``; ``forward_backward_step`` runs the engine's one training step on it. ``BaseSchedule`` is
its legacy base class, for schedules users write themselves."""
from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from typing import Any, Callable, Iterable, Optional, Union

import torch

from ..core.global_context import global_context as gpc
from .batch import call_criterion, call_with, first_tensor, move_to_device
from .step import make_train_step

__all__ = ["BaseSchedule", "NonPipelineSchedule", "call_criterion", "call_with", "move_to_device"]

_PIPELINE_SCHEDULES = ("PipelineSchedule", "InterleavedPipelineSchedule")


def __getattr__(name):
    if name in _PIPELINE_SCHEDULES:
        raise ImportError(f"colossal_lite.engine.schedule.{name} is not supported by colossal_lite, which has no "
                          f"pipeline parallelism: use NonPipelineSchedule (what initialize gives the engine) and "
                          f"scale with data parallelism and zero = dict(stage=...) in config.py instead")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class BaseSchedule(ABC):
    """A schedule: how the engine runs one step on the batches of ``data_iter`` (``forward_backward_step``)."""

    def __init__(self, data_process_func: Optional[Callable] = None):
        self.data_process_func = data_process_func
        self.current_batch: Any = None  # the last batch loaded (the Trainer's and execute_schedule's too)
        self._size: Optional[int] = None
        self._size_of: Any = None  # the batch ``_size`` belongs to

    @property
    def batch_size(self) -> Optional[int]:
        """Samples in the last batch loaded (first dimension of its first tensor); None when it has none."""
        batch = self.current_batch
        if self._size_of is not batch:  # worked out when first asked, once per batch
            t = first_tensor(batch)
            self._size = t.shape[0] if t is not None and t.dim() > 0 else None
            self._size_of = batch
        return self._size

    @batch_size.setter
    def batch_size(self, value: Optional[int]) -> None:
        self._size, self._size_of = value, self.current_batch

    def load_batch(self, data_iter: Iterable, to_gpu: Union[bool, torch.device, str] = True):
        """The next batch of ``data_iter`` (it becomes ``current_batch``), moved to this process's device
        (``to_gpu=True``, legacy's form; the CPU without CUDA), left where it is (``False``) or moved to the
        device given in its place."""
        _check_iterator(data_iter)
        batch = next(data_iter)
        if not isinstance(to_gpu, bool):
            batch = move_to_device(batch, to_gpu)
        elif to_gpu:
            batch = move_to_device(batch, gpc.device)
        self.current_batch = batch
        return batch

    def pre_processing(self, engine) -> None:  # noqa: B027 (legacy's optional hook, not abstract)
        """Called once with the engine; in legacy only pipeline schedules prepared anything here."""

    @abstractmethod
    def forward_backward_step(self, engine, data_iter: Iterable, forward_only: bool = False, return_loss: bool = True,
                              return_output_label: bool = True):
        """One step on the next batch of ``data_iter`` -> ``(output, label, loss)``; no optimizer step."""


class NonPipelineSchedule(BaseSchedule):
    """One forward (and backward) per call; ``data_process_func(batch) -> (data, label)`` is optional."""

    def __init__(self, data_process_func: Optional[Callable] = None):
        if data_process_func is not None:
            n = len(inspect.signature(data_process_func).parameters)
            if n != 1:
                raise TypeError(f"data_process_func must take exactly one argument (the batch), it takes {n}")
        super().__init__(data_process_func)

    def place(self, batch, device: torch.device):
        """A loaded batch on ``device``, split: -> (batch, data, label); it becomes ``current_batch``."""
        batch = self.current_batch = move_to_device(batch, device)
        data, label = self.split(batch)
        return batch, data, label

    def split(self, batch):
        """``(data, label)``: ``data_process_func``'s, or a pair as it is; a dict batch goes into the model whole
        (``model(**batch)``, as Hugging Face models take theirs) and its ``'labels'`` entry is the label."""
        if self.data_process_func is not None:
            return self.data_process_func(batch)
        if isinstance(batch, dict):
            return batch, batch.get("labels")
        if not isinstance(batch, (list, tuple)) or len(batch) != 2:
            raise ValueError("a batch must be (data, label); pass data_process_func=lambda batch: (data, label) for other layouts")
        return batch

    def forward_backward_step(self, engine, data_iter: Iterable, forward_only: bool = False, return_loss: bool = True,
                              return_output_label: bool = True):
        """The engine's training step on the next batch, without its optimizer step (or, ``forward_only``,
        evaluation's step under ``torch.no_grad``); -> ``(output, label, loss)``."""
        if not (forward_only or return_loss):
            raise ValueError("a training step needs the loss: use return_loss=True or forward_only=True")
        _check_iterator(data_iter)
        step = make_train_step(engine)
        step.keep_output = return_output_label  # (an output nobody gets back is let go before the backward)
        if forward_only:
            with torch.no_grad():
                step.forward_only(next(data_iter), with_loss=return_loss)
        else:
            step.forward_backward(next(data_iter))
        record = step.record
        return (record.output, record.label, record.loss) if return_output_label else (None, None, record.loss)


def _check_iterator(data_iter) -> None:
    if data_iter is None:
        raise RuntimeError("execute_schedule needs an iterator over batches, got None (pass iter(train_dataloader))")
