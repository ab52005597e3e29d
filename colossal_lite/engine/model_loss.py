"""``ModelLoss``: the loss a model computes itself, taken as the criterion of a model trained without one.

A Hugging Face model given ``labels`` returns a ``ModelOutput`` whose ``loss`` is already the micro-batch's loss
(with ``return_dict=False``, a tuple whose first item is that loss); many other models return a dict with a
``'loss'`` entry. ``initialize`` with no criterion trains on that loss; ``ModelLoss(key=...)`` names another entry,
and ``ModelLoss(num_tokens=...)`` says how to count a batch's real tokens for ``grad_reduction='per-token-mean'``.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch

__all__ = ["ModelLoss"]


class ModelLoss:
    """The model's own loss, found in its output: the attribute or entry ``key`` (``'loss'``), or the item at
    index ``key`` of a tuple output. ``'loss'`` in a tuple output is its first item when that is one number, as
    Hugging Face models return it with ``return_dict=False``.

    ``num_tokens(batch) -> count``: the real tokens the model's per-token mean loss was taken over (for a causal
    language model, ``lambda batch: (batch['labels'][:, 1:] != -100).sum()``), read by
    ``grad_reduction='per-token-mean'`` to weigh each micro-batch by its tokens; other reductions ignore it.
    """

    def __init__(self, key: Union[str, int] = "loss", num_tokens: Optional[Callable[[Any], Any]] = None):
        if not isinstance(key, (str, int)) or isinstance(key, bool):
            raise TypeError(f"ModelLoss(key=...) names the loss in the model's output: a str (an attribute or dict "
                            f"key, e.g. 'loss') or an int (the index in a tuple output), got {key!r}")
        if num_tokens is not None and not callable(num_tokens):
            raise TypeError(f"ModelLoss(num_tokens=...) must be a function of the batch that returns its real-token "
                            f"count, e.g. lambda batch: (batch['labels'] != -100).sum(); got {num_tokens!r}")
        self.key = key
        self.num_tokens = num_tokens

    def find(self, output: Any) -> Optional[torch.Tensor]:
        """The loss in ``output``, or None when it holds none."""
        key = self.key
        if isinstance(output, (list, tuple)) and not hasattr(output, "_fields"):
            if isinstance(key, int):
                return output[key] if -len(output) <= key < len(output) else None
            first = output[0] if output else None  # Hugging Face's tuple form puts the loss first
            return first if key == "loss" and isinstance(first, torch.Tensor) and first.numel() == 1 else None
        if isinstance(key, int):
            return None
        if isinstance(output, dict):
            return output.get(key)
        return getattr(output, key, None) if not isinstance(output, torch.Tensor) else None

    def __call__(self, output: Any, label: Any = None) -> torch.Tensor:
        loss = self.find(output)
        if loss is None:
            raise missing_loss(output, self.key)
        return loss

    def count_tokens(self, batch: Any):
        """The batch's real-token count (None without ``num_tokens``)."""
        return None if self.num_tokens is None else self.num_tokens(batch)

    def __repr__(self):
        return f"ModelLoss(key={self.key!r})"


def missing_loss(output: Any, key: Union[str, int]) -> RuntimeError:
    """The error for a model trained without a criterion whose output holds no loss: both ways to fix it."""
    if isinstance(output, dict):
        has = f"a {type(output).__name__} with the entries {list(output.keys())}"
    elif isinstance(output, (list, tuple)):
        has = f"a {type(output).__name__} of {len(output)} items"
    else:
        has = f"a {type(output).__name__}"
    hint = (" A Hugging Face model computes its loss when the batch has 'labels' (a dict batch goes into the model "
            "whole: model(**batch))." if isinstance(output, dict) or type(output).__name__.endswith("Output") else "")
    return RuntimeError(f"initialize() got no criterion, so the loss must come from the model, but its output is {has} "
                        f"with no loss under {key!r}.{hint} Fix: pass criterion=torch.nn.CrossEntropyLoss() (or your "
                        f"loss) to initialize, or name the entry that holds the loss: criterion=ModelLoss(key=...)")
