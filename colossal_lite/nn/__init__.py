"""Layers and optimizers of the legacy ``colossalai.nn`` API (schedulers and metrics are subpackages)."""
from ._checkpoint_module import CheckpointModule
from .optimizer import CPUAdam, FusedAdam, FusedLAMB, FusedSGD, HybridAdam, Lamb, Lars

__all__ = ["CheckpointModule", "Lamb", "Lars", "FusedSGD", "FusedAdam", "FusedLAMB", "HybridAdam", "CPUAdam"]
