"""``gradient_accumulation='auto'``: split a batch into more micro-batches when it runs out of memory.

The batch is retried whole with twice as many micro-batches; all ranks agree on the split
(one flag all-reduced per batch, read on the host: the price of this mode). Gradients are
all-reduced once per batch after every rank succeeded, so a rank that ran out of memory
never leaves another waiting inside a collective.
"""
from __future__ import annotations

from typing import Any, List

import torch
import torch.distributed as dist

from .schedule import call_criterion, call_with
from .strategy import AllReduceStrategy


def _split(obj: Any, parts: int, n: int) -> List[Any]:
    """``obj`` cut along dim 0 into ``parts`` pieces (tensors inside lists/tuples/dicts too)."""
    if isinstance(obj, torch.Tensor) and obj.dim() > 0 and obj.shape[0] == n:
        return list(torch.tensor_split(obj, parts))
    if isinstance(obj, (list, tuple)):
        cols = [_split(o, parts, n) for o in obj]
        return [type(obj)(c[i] for c in cols) for i in range(parts)]
    if isinstance(obj, dict):
        cols = {k: _split(v, parts, n) for k, v in obj.items()}
        return [type(obj)((k, cols[k][i]) for k in obj) for i in range(parts)]
    return [obj] * parts


def _batch_len(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.shape[0]
    if isinstance(obj, (list, tuple)):
        return _batch_len(obj[0])
    if isinstance(obj, dict):
        return _batch_len(next(iter(obj.values())))
    raise TypeError(f"cannot split a batch of type {type(obj).__name__} into micro-batches")


class AutoMicroBatcher:
    def __init__(self, logger=None):
        self.parts = 1
        self.logger = logger
        self._reducer = AllReduceStrategy()

    def _all_ok(self, ok: bool, device) -> bool:
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return ok
        flag = torch.tensor([1.0 if ok else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def run(self, engine, data, label, return_loss: bool = True):
        """Forward and backward of one batch, split as often as needed; returns (output, loss)."""
        n = _batch_len(data)
        while True:
            parts = min(self.parts, n)
            outputs, loss_total, ok = [], None, True
            try:
                for d, lab in zip(_split(data, parts, n), _split(label, parts, n)):
                    with engine.strategy.no_sync(engine.model):
                        out = call_with(engine, d)
                        loss = call_criterion(engine.criterion, out, lab)
                        engine.loss_guard.watch(loss)
                        weight = _batch_len(d) / n
                        engine.precision.backward(loss * weight)
                    outputs.append(out.detach() if isinstance(out, torch.Tensor) else out)
                    part = loss.detach() * weight
                    loss_total = part if loss_total is None else loss_total + part
            except torch.OutOfMemoryError:
                ok = False
                outputs, loss_total, out, loss = [], None, None, None
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            if self._all_ok(ok, engine.device):
                break
            engine.precision.zero_grad(engine.model, engine.optimizer)
            if parts >= n:
                raise torch.OutOfMemoryError(f"gradient_accumulation='auto': even micro-batches of 1 sample run out of "
                                             f"memory on some rank (batch of {n}); reduce the model or the sequence size")
            self.parts = parts * 2
            if self.logger is not None:
                self.logger.info(f"out of memory with the batch of {n} in {parts} micro-batch(es) on some rank; "
                                 f"retrying the same batch in {min(self.parts, n)}", ranks=[0])
        if dist.is_initialized() and dist.get_world_size() > 1:
            self._reducer.reduce_gradients(engine.model)
        engine.window.end_backward()
        output = torch.cat(outputs) if outputs and all(isinstance(o, torch.Tensor) for o in outputs) else outputs
        return output, loss_total
