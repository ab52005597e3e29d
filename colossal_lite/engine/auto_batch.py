"""``gradient_accumulation='auto'``: split a batch into more micro-batches when it runs out of memory.

The batch is retried whole with twice as many micro-batches; all ranks agree on the split
(one flag all-reduced per batch, read on the host: the price of this mode). Gradients are
all-reduced once per batch after every rank succeeded, so a rank that ran out of memory
never leaves another waiting inside a collective.
"""
from __future__ import annotations

import torch

from ..core.dist import all_agree, world_size
from .batch import batch_len, call_with, split_samples
from .reduction import not_a_loss
from .strategy import AllReduceStrategy


class AutoMicroBatcher:
    def __init__(self, logger=None):
        self.parts = 1
        self.logger = logger
        self._reducer = AllReduceStrategy()

    def run(self, engine, data, label, where=None):
        """Forward and backward of one batch, split as often as needed; returns (output, loss)."""
        where = engine.enter_micro_batch(where)
        n = batch_len(data)
        while True:
            parts = min(self.parts, n)
            try:
                outputs, loss = self._forward_backward(engine, data, label, parts, n, where)
                ok = True
            except torch.OutOfMemoryError:
                ok, outputs, loss = False, [], None
            if not ok and torch.cuda.is_available():
                torch.cuda.empty_cache()  # out of the except block: the failed try's tensors (its traceback) are gone
            if all_agree(ok, engine.device):
                break
            self._retry_in_more_parts(engine, parts, n)
        engine.window.backward_done = True
        if world_size() > 1:
            self._reducer.reduce_gradients(engine.model)
        output = torch.cat(outputs) if outputs and all(isinstance(o, torch.Tensor) for o in outputs) else outputs
        return output, loss

    @staticmethod
    def _forward_backward(engine, data, label, parts: int, n: int, where):
        """The batch in ``parts`` pieces, each weighed by the gradient reduction as its part of the micro-batch
        ``where`` (a mean's piece by its share of the samples, a sum's or a token mean's as it is);
        -> (outputs, the batch's loss: the pieces' losses weighed by their shares of the samples)."""
        outputs, total = [], None
        for d, lab in zip(split_samples(data, parts, n), split_samples(label, parts, n)):
            with engine.strategy.no_sync(engine.model):
                out = call_with(engine.run_model, d)  # the pieces are one micro-batch, entered above
                loss = engine.compute_loss(out, lab, d)
                if not isinstance(loss, torch.Tensor):
                    raise not_a_loss(loss, engine.criterion.wrapped, engine.reduction.name)
                engine.loss_guard.watch(loss)
                weight = batch_len(d) / n
                engine.precision.backward(loss, engine.reduction.loss_weight(loss, where, share=weight))
            outputs.append(out.detach() if isinstance(out, torch.Tensor) else out)
            part = loss.detach() * weight
            total = part if total is None else total + part
        return outputs, total

    def _retry_in_more_parts(self, engine, parts: int, n: int) -> None:
        engine.precision.zero_grad(engine.model, engine.optimizer)
        engine.reduction.reset()  # (the failed try's token counts: each batch is a window of its own)
        if parts >= n:
            raise torch.OutOfMemoryError(f"gradient_accumulation='auto': even micro-batches of 1 sample run out of "
                                         f"memory on some rank (batch of {n}); reduce the model or the sequence size")
        self.parts = parts * 2
        if self.logger is not None:
            self.logger.info(f"out of memory with the batch of {n} in {parts} micro-batch(es) on some rank; "
                             f"retrying the same batch in {min(self.parts, n)}", ranks=[0])
