"""MixUp: blend each sample with another sample of the same batch, and blend the two losses to match."""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

__all__ = ["mixup_batch", "mixup_loss"]


def _draw_mixing(alpha: float) -> float:
    concentration = torch.tensor(float(alpha))
    return float(torch.distributions.Beta(concentration, concentration).sample())


def mixup_batch(
    input: torch.Tensor,
    target: torch.Tensor,
    alpha: float = 0.2,
    mixing: Optional[float] = None,
    indices: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, float]:
    """Return ``((1 - mixing) * input + mixing * input[indices], target[indices], mixing)``.

    ``mixing`` (a fraction in [0, 1]) is drawn from Beta(alpha, alpha) and ``indices`` from ``torch.randperm``
    with torch's RNG unless given; the first dim of ``input`` and ``target`` is the batch.
    """
    if not alpha > 0:
        raise ValueError(f"mixup alpha must be > 0 (it parametrises Beta(alpha, alpha)), got {alpha!r}")
    batch_size = input.shape[0]
    if target.shape[0] != batch_size:
        raise ValueError(f"mixup input and target batch sizes differ: {batch_size} vs {target.shape[0]}")
    if mixing is None:
        mixing = _draw_mixing(alpha)
    else:
        mixing = float(mixing)
        if not 0.0 <= mixing <= 1.0:
            raise ValueError(f"mixup mixing must be in [0, 1], got {mixing!r}")
    if indices is None:
        indices = torch.randperm(batch_size, device=input.device)
    else:
        indices = torch.as_tensor(indices, dtype=torch.long)
        if indices.shape != (batch_size,):
            raise ValueError(f"mixup indices must have shape ({batch_size},), got {tuple(indices.shape)}")
    mixed_input = (1.0 - mixing) * input + mixing * input[indices.to(input.device)]
    target_perm = target[indices.to(target.device)]
    return mixed_input, target_perm, mixing


def mixup_loss(
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    output: torch.Tensor,
    target: torch.Tensor,
    target_perm: torch.Tensor,
    mixing: float,
) -> torch.Tensor:
    """``(1 - mixing) * loss_fn(output, target) + mixing * loss_fn(output, target_perm)``, mixing in [0, 1]."""
    return (1.0 - mixing) * loss_fn(output, target) + mixing * loss_fn(output, target_perm)
