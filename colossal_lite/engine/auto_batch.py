"""``gradient_accumulation='auto'``: split a batch into more micro-batches when it runs out of memory.

The batch is retried whole with twice as many micro-batches; all ranks agree on the split
(one flag all-reduced per batch, read on the host: the price of this mode). Gradients are
all-reduced once per batch after every rank succeeded, so a rank that ran out of memory
never leaves another waiting inside a collective. What a failed try changed (gradients, token
counts, buffers, random generators) is put back before the retry, and the next batch starts
with the split the last one needed. An evaluation batch that runs out of memory is run in pieces
the same way (its forward only; evaluation keeps a split of its own).
"""
from __future__ import annotations

import torch

from ..core.dist import all_agree, world_size
from .batch import batch_len, call_with, join_samples, split_samples
from .reduction import not_a_loss
from .strategy import AllReduceStrategy


class AutoMicroBatcher:
    def __init__(self, logger=None):
        self.parts = 1
        self.eval_parts = 1  # evaluation's batches (often larger than training's: no gradients kept)
        self.logger = logger
        self._reducer = AllReduceStrategy()

    def run(self, engine, batch, data, label, where=None, keep_output: bool = True):
        """Forward and backward of one batch (``data``, ``label``: its split; ``batch`` itself, which a model's own
        loss counts tokens in), split as often as needed; returns (output, loss). ``keep_output=False``: no piece's
        output is kept (the output returned is None), so none lives through the next piece's forward."""
        where = engine.enter_micro_batch(where)
        n = batch_len(data)
        before = _TryState(engine.model)

        def attempt(parts):
            # each try's first forward brings the ranks' buffers together, as DDP does at an unaccumulated step's
            # (every piece runs without gradient sync, which would otherwise stop it after the first try)
            engine.strategy.sync_buffers_at_next_forward(engine.model)
            return self._forward_backward(engine, batch, data, label, parts, n, where, keep_output)

        def undo():
            before.restore()
            engine.precision.zero_grad(engine.model, engine.optimizer)
            engine.reduction.reset()  # (the failed try's token counts: each batch is a window of its own)

        (outputs, loss), self.parts = self._split_until_it_fits(engine, n, self.parts, "batch", attempt, undo)
        engine.window.backward_done = True
        if world_size() > 1:
            self._reducer.reduce_gradients(engine.model)
        # as after DDP's own synced forward, the next forward (the next batch's, an evaluation's, a prediction's)
        # brings the ranks' buffers together: every piece ran without sync, which turned that off
        engine.strategy.sync_buffers_at_next_forward(engine.model)
        return (join_samples(outputs) if keep_output else None), loss

    @staticmethod
    def _forward_backward(engine, batch, data, label, parts: int, n: int, where, keep_output: bool):
        """The batch in ``parts`` pieces, each weighed by the gradient reduction as its part of the micro-batch
        ``where`` (a mean's piece by its share of the samples, a sum's or a token mean's as it is);
        -> (outputs, the batch's loss as the reduction joins its pieces' losses)."""
        outputs, losses = [], []
        pieces = zip(split_samples(batch, parts, n), split_samples(data, parts, n), split_samples(label, parts, n))
        for b, d, lab in pieces:
            with engine.strategy.no_sync(engine.model):
                out = call_with(engine.run_model, d)  # the pieces are one micro-batch, entered above
                loss = engine.compute_loss(out, lab, b)
                if keep_output:
                    outputs.append(out.detach() if isinstance(out, torch.Tensor) else out)
                del out  # one not kept is let go before its backward, as the plain step lets it go
                if not isinstance(loss, torch.Tensor):
                    raise not_a_loss(loss, engine.criterion.wrapped, engine.reduction.name)
                engine.loss_guard.watch(loss)
                weight = engine.reduction.loss_weight(loss, where, share=batch_len(d) / n)
                engine.precision.backward(loss, weight)
            losses.append((loss.detach(), weight))
        return outputs, engine.reduction.joined_loss(losses)

    def evaluate(self, engine, batch, data, label, with_loss: bool):
        """Evaluation's forward of one placed batch (``data``, ``label``: its split), in as many pieces as memory
        needs, all ranks agreeing (a sharded model gathers its weights at every forward) -> (output, loss).

        The output is the pieces' outputs joined. The loss: the criterion's on the joined output, as for the batch
        whole (a loop that evaluates in chunks computes it so); a model's own loss joined from its pieces' by the
        gradient reduction (a mean's weighed by samples, a sum's added, a token mean's by the tokens
        ``ModelLoss(num_tokens=...)`` counts)."""
        n = batch_len(data)

        def attempt(parts):
            outputs = [call_with(engine.run_model, d) for d in split_samples(data, parts, n)]
            output = join_samples(outputs)
            loss = self._evaluation_loss(engine, batch, label, outputs, output, parts, n) if with_loss else None
            return output, loss

        result, self.eval_parts = self._split_until_it_fits(engine, n, self.eval_parts, "evaluation batch", attempt)
        return result

    def _split_until_it_fits(self, engine, n: int, parts: int, what: str, attempt, undo=None):
        """``attempt(pieces)`` on the ``n`` samples of a ``what`` in ``parts`` pieces (at most ``n``), the split doubled
        after every try that ran out of memory on some rank (all ranks agree: one flag read per try); ``undo()``
        puts back what a failed try changed. -> (the result, the split to start the next one with). One that fits
        in no split raises, and the caller's split stays as it was (not pieces of one sample)."""
        while True:
            pieces = min(parts, n)
            try:
                result, ok = attempt(pieces), True
            except torch.OutOfMemoryError:
                result, ok = None, False
            if not ok and torch.cuda.is_available():
                torch.cuda.empty_cache()  # out of the except block: the failed try's tensors (its traceback) are gone
            if all_agree(ok, engine.device):
                return result, parts
            if undo is not None:
                undo()
            if pieces >= n:
                raise _unsplittable(what, n)
            parts = self._more_parts(pieces, n, what)

    @staticmethod
    def _evaluation_loss(engine, batch, label, outputs, output, parts: int, n: int):
        """The loss of an evaluation batch run in ``parts`` pieces (``outputs``, joined: ``output``)."""
        model_loss = engine.model_loss
        if model_loss is None or parts == 1:
            return engine.compute_loss(output, label, batch, required=False)
        losses = [model_loss.find(out) for out in outputs]
        if any(loss is None for loss in losses):
            return None
        counts_tokens = engine.reduction.name == "per-token-mean" and model_loss.num_tokens is not None
        weights = [torch.as_tensor(model_loss.count_tokens(b) if counts_tokens else batch_len(b) / n,
                                   dtype=torch.float32, device=loss.device)
                   for b, loss in zip(split_samples(batch, parts, n), losses)]
        loss = engine.reduction.joined_loss(list(zip(losses, weights)))
        if not counts_tokens:
            engine.reduction.note_tokens(None)  # (the weights were shares of the samples: no token was counted)
        return loss

    def _more_parts(self, parts: int, n: int, what: str) -> int:
        """The split to retry a ``what`` of ``n`` samples in, after ``parts`` pieces ran out of memory on some rank."""
        if self.logger is not None:
            self.logger.info(f"out of memory with the {what} of {n} in {parts} micro-batch(es) on some rank; "
                             f"retrying the same {what} in {min(parts * 2, n)}", ranks=[0])
        return parts * 2


def _unsplittable(what: str, n: int) -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(f"gradient_accumulation='auto': even micro-batches of 1 sample run out of memory on "
                                  f"some rank ({what} of {n}); reduce the model or the sequence size")


class _TryState:
    """What a try that ran out of memory changed besides the gradients, put back before the retry so that it
    runs as if the failed try had not: the model's buffers (BatchNorm's statistics) and the random generators
    (dropout's masks). A copy of the buffers per batch is this mode's price, with its flag read."""

    def __init__(self, model):
        self.buffers = [(b, b.detach().clone()) for b in model.buffers()]
        # torch's generators only, which a forward draws from; the checkpoints' capture_rng_state makes plain copies
        # of every generator of the process, a cost this mode would pay at every batch
        self.cpu_rng = torch.random.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(self) -> None:
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)
        torch.random.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
