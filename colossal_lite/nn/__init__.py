"""Layers, optimizers, LR schedulers and metrics of the legacy ``colossalai.nn`` API.

As in legacy, the schedulers (``colossal_lite.nn.lr_scheduler``) and metrics (``colossal_lite.nn.metric``) are
also importable from here; they are imported on first use, so ``import colossal_lite.nn`` does not load them.
"""
import importlib
import re

from ._checkpoint_module import CheckpointModule
from .optimizer import CPUAdam, FusedAdam, FusedLAMB, FusedSGD, HybridAdam, Lamb, Lars

_SCHEDULERS = (
    "CosineAnnealingLR", "CosineAnnealingWarmupLR", "FlatAnnealingLR", "FlatAnnealingWarmupLR", "LinearWarmupLR",
    "MultiStepLR", "MultiStepWarmupLR", "OneCycleLR", "PolynomialLR", "PolynomialWarmupLR", "LambdaLR",
    "MultiplicativeLR", "StepLR", "ExponentialLR", "DelayerScheduler", "WarmupScheduler", "WarmupDelayerScheduler",
)
_METRICS = ("Accuracy", "calc_acc")
_LAZY = {**{name: ".lr_scheduler" for name in _SCHEDULERS}, **{name: ".metric" for name in _METRICS}}

# legacy ``colossalai.nn`` also held the tensor-parallel layers (``Linear1D_Col``, ``Embedding2D``, ``LayerNorm2p5D``)
_TENSOR_PARALLEL_NAME = re.compile(r"(1D|2D|2p5D|3D)(_Col|_Row)?$")
_TENSOR_PARALLEL_LAYERS = ("(Linear1D_Col, Linear1D_Row, Linear2D, Embedding1D, ... the tensor-parallel layers) is not "
                          "supported by colossal_lite, which has no tensor parallelism: use torch.nn layers "
                          "(torch.nn.Linear, torch.nn.Embedding, ...) and scale with data parallelism and "
                          "zero = dict(stage=...) in config.py instead")

__all__ = ["CheckpointModule", "Lamb", "Lars", "FusedSGD", "FusedAdam", "FusedLAMB", "HybridAdam", "CPUAdam",
           *_SCHEDULERS, *_METRICS]


def __getattr__(name):
    if name in ("lr_scheduler", "metric"):  # legacy's ``colossalai.nn.lr_scheduler.X`` after ``import colossalai.nn``
        return importlib.import_module(f".{name}", __name__)
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    if _TENSOR_PARALLEL_NAME.search(name):
        raise ImportError(f"colossal_lite.nn.{name} {_TENSOR_PARALLEL_LAYERS}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | {"lr_scheduler", "metric"})
