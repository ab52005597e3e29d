"""``ColossalaiOptimizer``: the legacy wrapper ``initialize`` put around every optimizer, for scripts that build it.

colossal_lite's ``initialize`` gives the engine the torch optimizer itself (``engine.optimizer``), so this class
is only for code that wraps an optimizer by hand or checks for the wrapper.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ...amp.convert import AMPOptimizer
from ...amp.precision import FP32Precision

__all__ = ["ColossalaiOptimizer"]


class ColossalaiOptimizer(AMPOptimizer):
    """Legacy ``colossalai.nn.optimizer.ColossalaiOptimizer(optim)``: the wrapped optimizer as ``.optim``, its
    ``param_groups``, ``state`` and ``defaults`` (so an LR scheduler can be built on the wrapper), ``step``,
    ``zero_grad``, ``backward(loss)``, ``backward_by_grad(tensor, grad)`` and ``clip_grad_norm(model, max_norm)``;
    ``state_dict`` is the wrapped optimizer's."""

    def __init__(self, optim: torch.optim.Optimizer):
        if not isinstance(optim, torch.optim.Optimizer):
            raise TypeError(f"ColossalaiOptimizer(optim=...) wraps a torch.optim.Optimizer, got {type(optim).__name__}")
        super().__init__(optim, FP32Precision(), model=None)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> Optional[torch.Tensor]:
        """Clip the gradients of ``model``'s parameters to the global L2 norm ``max_norm``; 0 does nothing."""
        if max_norm <= 0:
            return None
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def state_dict(self) -> dict:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optim.load_state_dict(state_dict)
