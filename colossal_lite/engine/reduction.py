"""Gradient reduction: what the gradient of one optimizer step is the average (or sum) of.

One class per config value ``grad_reduction``, always called by the Engine:

- ``MeanReduction`` ('mean', the default): the mean over the window's micro-batches and the ranks;
  each micro-batch's loss is divided by its window's size, data parallelism averages over ranks.
- ``SumReduction`` ('sum'): the sum over every sample of every rank (the loss is not divided, and the
  ranks' average is multiplied back by the world size).
- ``TokenMeanReduction`` ('per-token-mean'): the mean over every real token of the window on every
  rank, whatever the micro-batches' token counts: each micro-batch's per-token mean loss is weighed
  by its token count, and the sum divided by the global count at the step.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from ..core.dist import all_reduce_sum_, world_size
from .accumulation import MicroBatch, rescale_grads_

GRAD_REDUCTIONS = ("mean", "sum", "per-token-mean")


class MeanReduction:
    name = "mean"
    #: The real-token count of the last loss computed (a per-token mean's), None when it counts none: what a loss
    #: metric weighs that loss by in place of its samples (``loss_count``).
    last_tokens: Any = None

    def criterion_result(self, result: Any) -> Any:
        """What ``engine.criterion`` returns for the criterion's ``result``."""
        return result

    def loss_count(self, samples: int) -> Any:
        """What the last loss is a mean over, for a loss metric that averages losses: its samples."""
        return samples

    def __init__(self):
        self._weights: Dict[Any, torch.Tensor] = {}  # 1 / window size, per (size, dtype, device): made once

    def note_tokens(self, num_tokens) -> None:
        """The real-token count of the micro-batch whose loss comes next (a model's own per-token mean loss);
        only the per-token mean reads it."""

    def own_loss(self, loss: Optional[torch.Tensor], num_tokens) -> Optional[torch.Tensor]:
        """A model's own loss of a micro-batch with ``num_tokens`` real tokens (None: not counted), as the step
        takes it; the count is noted for the backward."""
        self.note_tokens(num_tokens)
        return loss

    def loss_weight(self, loss: torch.Tensor, where: MicroBatch, num_tokens=None,
                    share: float = 1.0) -> Optional[torch.Tensor]:
        """The micro-batch loss's weight in the window's loss (None: 1): backward starts from it.

        ``share``: the part of the micro-batch's samples this loss covers, when automatic micro-batching runs
        the micro-batch in pieces (a mean's piece weighs its share; a sum's and a token count's pieces add up
        as they are)."""
        if share != 1:
            return torch.tensor(share / where.divisor, dtype=loss.dtype, device=loss.device)
        if where.divisor == 1 or loss.ndim:  # (a loss of several numbers then meets torch's own error: not a scalar)
            return None
        key = (where.divisor, loss.dtype, loss.device)
        weight = self._weights.get(key)
        if weight is None:
            weight = self._weights[key] = torch.ones((), dtype=loss.dtype, device=loss.device) / where.divisor
        return weight

    def joined_loss(self, parts: List[Tuple[torch.Tensor, Optional[torch.Tensor]]]) -> torch.Tensor:
        """The loss of a micro-batch that automatic micro-batching ran in pieces, from each piece's ``(loss,
        weight)`` (the weight ``loss_weight`` gave its backward): a mean's pieces weighed by their shares; one
        piece's loss as it is."""
        if len(parts) == 1:
            return parts[0][0]
        total = None
        for loss, weight in parts:
            part = loss if weight is None else loss * weight
            total = part if total is None else total + part
        return total

    def finish(self, params, closing: MicroBatch) -> None:
        """The window's gradients are summed (and reduced over ranks): make them the chosen reduction (the mean
        is already made: each loss was weighed by 1 / its window's size)."""

    def reset(self) -> None:
        """A window opens (the last one was applied, skipped or abandoned): nothing of it is kept."""

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass


class SumReduction(MeanReduction):
    name = "sum"

    def loss_weight(self, loss, where, num_tokens=None, share=1.0):
        return None

    def joined_loss(self, parts):
        """The pieces' sums added."""
        return super().joined_loss([(loss, None) for loss, _ in parts])

    def finish(self, params, closing):
        world = world_size()
        if world > 1:  # data parallelism averaged the ranks' sums
            rescale_grads_(params, float(world))


class TokenMeanReduction(MeanReduction):
    name = "per-token-mean"

    def __init__(self):
        super().__init__()
        self._micro_tokens: Optional[torch.Tensor] = None  # the last criterion's real-token count
        self.tokens: Optional[torch.Tensor] = None  # real tokens of the open window on this rank
        #: A power of two near 1 / the real tokens a window held per rank (set at each step from the global count,
        #: so the same on every rank; 1 until the first step). Each backward starts from its token count times it, which makes the
        #: window's gradients of a per-token mean's size before the step divides them by the global count, as a
        #: loop that divides by the window's count beforehand has them: fp16 loss scaling then does not overflow
        #: on a window's token count. A power of two changes no rounding, so the update is the same, bit for bit.
        self._unit: Any = 1.0

    def loss_count(self, samples):
        """The last loss's real tokens (a device tensor, weighed without reading it), else its samples."""
        return samples if self.last_tokens is None else self.last_tokens

    def criterion_result(self, result):
        self.last_tokens = None  # (a plain loss counts no token; a pair's count is taken below)
        if isinstance(result, tuple) and len(result) == 2:  # (loss_sum, num_tokens)
            loss_sum, num_tokens = result
            if not isinstance(num_tokens, (torch.Tensor, int, float)) or isinstance(num_tokens, bool):
                raise TypeError(f"grad_reduction='per-token-mean' reads a criterion's pair as (loss_sum, num_tokens), "
                                f"but its second item is a {type(num_tokens).__name__}, not a count. Fix: return "
                                f"(loss_sum, num_tokens) with num_tokens a tensor or an int (the real tokens of the "
                                f"micro-batch), and keep other values elsewhere")
            return self.token_loss(loss_sum, num_tokens)
        return result

    def token_loss(self, loss_sum: torch.Tensor, num_tokens) -> torch.Tensor:
        """Record a micro-batch's real-token count; returns its per-token mean loss (what ``backward`` takes)."""
        n = torch.as_tensor(num_tokens, dtype=torch.float32, device=loss_sum.device)
        self._micro_tokens = self.last_tokens = n
        return loss_sum / n.clamp(min=1)

    def note_tokens(self, num_tokens) -> None:
        self._micro_tokens = self.last_tokens = num_tokens  # made a tensor on the loss's device at the backward

    def own_loss(self, loss, num_tokens):
        """A micro-batch with no real token (a short document's labels all ignored) has no per-token mean: the
        model's is 0/0, NaN, and would be taken for a non-finite loss although it weighs nothing. It is 0 (its
        gradient, weighed by 0 tokens, is unchanged)."""
        self.note_tokens(num_tokens)
        if loss is None or num_tokens is None:
            return loss
        return _where_counted(torch.as_tensor(num_tokens, device=loss.device), loss)

    def loss_weight(self, loss, where, num_tokens=None, share=1.0):
        n = self._micro_tokens if num_tokens is None else num_tokens
        if n is None:
            raise RuntimeError("grad_reduction='per-token-mean' needs each micro-batch's real-token count: let the "
                               "criterion return (loss_sum, num_tokens), call engine.backward(loss, num_tokens=n), or, "
                               "for a model's own loss, pass criterion=ModelLoss(num_tokens=lambda batch: count)")
        self._micro_tokens = None
        n = torch.as_tensor(n, dtype=torch.float32, device=loss.device)  # (the same tensor when it is one already)
        self.tokens = n if self.tokens is None else self.tokens + n
        self.last_tokens = n
        return (n * self._unit).to(loss.dtype)  # back to the micro-batch's token sum (times the unit); divided at the step

    def joined_loss(self, parts):
        """The pieces' per-token means weighed by their token counts: the micro-batch's per-token mean."""
        if len(parts) == 1:
            return parts[0][0]
        tokens = sum(weight for _, weight in parts)
        joined = super().joined_loss([(_where_counted(weight, loss), weight) for loss, weight in parts])
        # (the weights carry the unit: a power of two, taken off exactly)
        tokens, joined = tokens / self._unit, joined / self._unit
        self.last_tokens = tokens
        return joined / tokens.clamp(min=1)

    def finish(self, params, closing):
        total = self.tokens if self.tokens is not None else torch.zeros(())
        total = all_reduce_sum_(total.clone())  # every rank: the global real-token count
        world = world_size()
        factor = world / total.clamp(min=1)
        rescale_grads_(params, factor / self._unit)
        self._unit = torch.exp2(-torch.floor(torch.log2((total / world).clamp(min=1))))  # (for the next windows)

    def reset(self):
        self.tokens = None

    def state_dict(self):
        return {"tokens": None if self.tokens is None else self.tokens.detach().clone(),
                "unit": torch.as_tensor(self._unit).detach().clone()}

    def load_state_dict(self, state):
        self.tokens = state.get("tokens")
        unit = state.get("unit")
        self._unit = 1.0 if unit is None else unit  # (a checkpoint from before the unit has none: 1, as it was then)


def _where_counted(tokens: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """``loss`` where its micro-batch (or piece) counted real tokens, else 0 (a mean over none is NaN)."""
    return torch.where(tokens > 0, loss, torch.zeros_like(loss))


def not_a_loss(loss: Any, criterion: Any, reduction: str) -> TypeError:
    """The error for a loss that is not a tensor (a criterion that returns ``(loss, extras)``): what a criterion
    must return and how to get there, instead of an ``AttributeError`` from deep inside the engine."""
    if isinstance(loss, tuple):
        got = f"a tuple of {len(loss)} ({', '.join(type(x).__name__ for x in loss)})"
    else:
        got = f"a {type(loss).__name__}"
    name = getattr(criterion, "__name__", None) or type(criterion).__name__
    source = f"the criterion {name} returned it" if criterion is not None else "engine.backward got it"
    tokens = ("" if reduction == "per-token-mean" else
              " (the pair is read as a token count only with grad_reduction = 'per-token-mean' in the config)")
    return TypeError(
        f"the loss is {got}, not a tensor: {source}. A criterion must return one tensor (the loss), or "
        f"(loss_sum, num_tokens) with grad_reduction = 'per-token-mean'{tokens}. Fix: return only the loss from the "
        f"criterion (keep other values on the criterion object, or compute them in a hook from the output), or in "
        f"your own loop unpack it: loss, extras = engine.criterion(output, label); engine.backward(loss)")


def build_reduction(name: str) -> MeanReduction:
    classes = {"mean": MeanReduction, "sum": SumReduction, "per-token-mean": TokenMeanReduction}
    if name not in classes:
        raise ValueError(f"grad_reduction must be 'mean', 'sum' or 'per-token-mean', got {name!r}")
    return classes[name]()
