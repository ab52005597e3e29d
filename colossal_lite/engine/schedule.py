"""``NonPipelineSchedule``: load a batch, move it to the device, forward, loss, backward."""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterable, Optional

import torch


def move_to_device(obj: Any, device: torch.device) -> Any:
    """Tensors, and tensors inside lists, tuples and dicts, moved to ``device``.

    Transfers from pinned memory to CUDA are non-blocking. A ``(data, label)`` pair of tensors already
    on ``device`` is returned as it is (the common case, checked first).
    """
    if type(obj) is tuple and len(obj) == 2:
        a, b = obj
        if type(a) is torch.Tensor and type(b) is torch.Tensor and a.device == device and b.device == device:
            return obj  # (device.type would cost more than both comparisons: it builds a string)
    if isinstance(obj, torch.Tensor):
        if obj.device == device:
            return obj
        return obj.to(device, non_blocking=obj.is_pinned() if device.type == "cuda" else False)
    if isinstance(obj, (list, tuple)):
        moved = [move_to_device(o, device) for o in obj]
        return type(obj)(*moved) if hasattr(obj, "_fields") else type(obj)(moved)
    if isinstance(obj, dict):
        return type(obj)((k, move_to_device(v, device)) for k, v in obj.items())
    return obj


def _first_tensor(obj):
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (list, tuple)):
        for o in obj:
            t = _first_tensor(o)
            if t is not None:
                return t
    if isinstance(obj, dict):
        for o in obj.values():
            t = _first_tensor(o)
            if t is not None:
                return t
    return None


def call_with(fn: Callable, args: Any, *extra):
    """Tensor -> fn(t), list/tuple -> fn(*x), dict -> fn(**x)."""
    if isinstance(args, dict):
        return fn(*extra, **args)
    if isinstance(args, (list, tuple)):
        return fn(*extra, *args)
    return fn(*extra, args)


def call_criterion(criterion: Callable, outputs: Any, labels: Any):
    """Legacy argument spreading: outputs and labels as tensors, sequences or dicts."""
    outs = (outputs,) if not isinstance(outputs, (list, tuple, dict)) else outputs
    labs = (labels,) if not isinstance(labels, (list, tuple, dict)) else labels
    if isinstance(outs, dict):
        if not isinstance(labs, dict):
            raise ValueError("the model returned a dict, so the labels must be a dict too (criterion(**outputs, **labels))")
        return criterion(**outs, **labs)
    if isinstance(labs, dict):
        return criterion(*outs, **labs)
    return criterion(*outs, *labs)


class NonPipelineSchedule:
    """One forward (and backward) per call; ``data_process_func(batch) -> (data, label)`` is optional."""

    def __init__(self, data_process_func: Optional[Callable] = None):
        if data_process_func is not None:
            n = len(inspect.signature(data_process_func).parameters)
            if n != 1:
                raise TypeError(f"data_process_func must take exactly one argument (the batch), it takes {n}")
        self.data_process_func = data_process_func
        self.current_batch: Any = None  # the last batch loaded (the Trainer sets it for the batches it loads)
        self._size: Optional[int] = None
        self._size_of: Any = None  # the batch ``_size`` belongs to

    @property
    def batch_size(self) -> Optional[int]:
        """Samples in the last batch loaded (first dimension of its first tensor); None when it has none."""
        batch = self.current_batch
        if self._size_of is not batch:  # worked out when first asked, once per batch
            t = _first_tensor(batch)
            self._size = t.shape[0] if t is not None and t.dim() > 0 else None
            self._size_of = batch
        return self._size

    @batch_size.setter
    def batch_size(self, value: Optional[int]) -> None:
        self._size, self._size_of = value, self.current_batch

    def load_batch(self, data_iter: Iterable, device: torch.device):
        if data_iter is None:
            raise RuntimeError("execute_schedule needs an iterator over batches, got None (pass iter(train_dataloader))")
        batch = self.current_batch = move_to_device(next(data_iter), device)
        return batch

    def load_split(self, data_iter: Iterable, device: torch.device):
        """``load_batch`` then ``split``: -> (batch, data, label)."""
        return self.place(next(data_iter), device)

    def place(self, batch, device: torch.device):
        """A loaded batch on ``device``, split: -> (batch, data, label); it becomes ``current_batch``.

        The common batch, a ``(data, label)`` tuple or list of two tensors already on ``device``, is
        recognised in one step and passed through as it is (this runs once per micro-batch).
        """
        if (type(batch) is tuple or type(batch) is list) and len(batch) == 2 and self.data_process_func is None:
            a, b = batch
            if type(a) is torch.Tensor and type(b) is torch.Tensor and a.device == device and b.device == device:
                self.current_batch = batch
                return batch, a, b
        batch = self.current_batch = move_to_device(batch, device)
        data, label = self.split(batch)
        return batch, data, label

    def split(self, batch):
        if self.data_process_func is not None:
            return self.data_process_func(batch)
        if isinstance(batch, dict):
            raise ValueError("a dict batch needs data_process_func=lambda batch: (data, label) to say which part is the label")
        if not isinstance(batch, (list, tuple)) or len(batch) != 2:
            raise ValueError("a batch must be (data, label); pass data_process_func=lambda batch: (data, label) for other layouts")
        return batch

    def forward_backward_step(self, engine, data_iter: Iterable, forward_only: bool = False, return_loss: bool = True,
                              return_output_label: bool = True):
        if not (forward_only or return_loss):
            raise ValueError("a training step needs the loss: use return_loss=True or forward_only=True")
        data, label = self.split(self.load_batch(data_iter, engine.device))
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            output = call_with(engine, data)
            loss = call_criterion(engine.criterion, output, label) if return_loss else None
        if not forward_only:
            engine.backward(loss)
        if not return_output_label:
            return None, None, loss
        return output, label, loss
