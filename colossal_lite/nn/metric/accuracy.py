"""Top-1 accuracy counted on the device of the logits."""
from __future__ import annotations

from typing import Sequence, Union

import torch
from torch import nn

__all__ = ["Accuracy", "calc_acc"]

Logits = Union[torch.Tensor, Sequence[torch.Tensor]]


def calc_acc(logits: Logits, targets: torch.Tensor) -> torch.Tensor:
    """Number of samples whose arg-max over the last dim equals the target (a 0-dim integer tensor).

    ``logits`` may be a tensor or a list/tuple whose first element holds the logits.
    """
    if isinstance(logits, (list, tuple)):
        if len(logits) == 0:
            raise ValueError("calc_acc got an empty list/tuple of logits")
        logits = logits[0]
    preds = torch.argmax(logits, dim=-1)
    return (preds == targets.to(preds.device)).sum()


class Accuracy(nn.Module):
    """Module form of ``calc_acc``: ``forward`` returns the count of correct top-1 predictions as a tensor."""

    def forward(self, logits: Logits, targets: torch.Tensor) -> torch.Tensor:
        return calc_acc(logits, targets)
