"""Optimizers of the legacy ``colossalai.nn.optimizer`` API.

``FusedSGD``, ``FusedAdam``, ``CPUAdam`` and ``HybridAdam`` are torch's SGD and Adam/AdamW (fused or
multi-tensor kernels) with the legacy signatures; ``Lamb``, ``FusedLAMB`` and ``Lars`` are written here from
the published algorithms. All are ``torch.optim.Optimizer`` subclasses.
"""
from ._torch_backed import CPUAdam, FusedAdam, FusedSGD, HybridAdam
from .lamb import FusedLAMB, Lamb
from .lars import Lars

__all__ = ["Lamb", "Lars", "FusedSGD", "FusedAdam", "FusedLAMB", "HybridAdam", "CPUAdam"]
