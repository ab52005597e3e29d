"""Optimizers of the legacy ``colossalai.nn.optimizer`` API.

``FusedSGD``, ``FusedAdam``, ``CPUAdam`` and ``HybridAdam`` are torch's SGD and Adam/AdamW (fused or
multi-tensor kernels) with the legacy signatures; ``Lamb``, ``FusedLAMB`` and ``Lars`` are written here from
the published algorithms. All are ``torch.optim.Optimizer`` subclasses. ``ColossalaiOptimizer`` is the legacy
wrapper, for scripts that wrap an optimizer by hand.
"""
from ...registry import OPTIMIZERS
from ._torch_backed import CPUAdam, FusedAdam, FusedSGD, HybridAdam
from .colossalai_optimizer import ColossalaiOptimizer
from .lamb import FusedLAMB, Lamb
from .lars import Lars

__all__ = ["Lamb", "Lars", "FusedSGD", "FusedAdam", "FusedLAMB", "HybridAdam", "CPUAdam", "ColossalaiOptimizer"]

# legacy registered its optimizers, so a config or builder can name one: OPTIMIZERS.get_module('Lamb')
for _optimizer in (Lamb, Lars, FusedSGD, FusedAdam, FusedLAMB, HybridAdam, CPUAdam):
    OPTIMIZERS.register_module(_optimizer)
del _optimizer
