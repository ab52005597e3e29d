"""Learning-rate schedulers of the legacy Colossal-AI API, stepped once per optimizer step.

Each takes ``(optimizer, total_steps, ...)``; ``state_dict``/``load_state_dict`` restore them exactly,
warm-up/delay ones included (the inner scheduler's state is saved inside the outer one).
"""
from ...registry import LR_SCHEDULERS
from ._base import DelayerScheduler, WarmupDelayerScheduler, WarmupScheduler
from .cosine import CosineAnnealingLR, CosineAnnealingWarmupLR, FlatAnnealingLR, FlatAnnealingWarmupLR
from .linear import LinearWarmupLR
from .multistep import MultiStepLR, MultiStepWarmupLR
from .onecycle import OneCycleLR
from .poly import PolynomialLR, PolynomialWarmupLR
from .torch_schedulers import ExponentialLR, LambdaLR, MultiplicativeLR, StepLR

__all__ = [
    "CosineAnnealingLR", "CosineAnnealingWarmupLR", "FlatAnnealingLR", "FlatAnnealingWarmupLR", "LinearWarmupLR",
    "MultiStepLR", "MultiStepWarmupLR", "OneCycleLR", "PolynomialLR", "PolynomialWarmupLR", "LambdaLR",
    "MultiplicativeLR", "StepLR", "ExponentialLR", "DelayerScheduler", "WarmupScheduler", "WarmupDelayerScheduler"
]

# legacy registered every scheduler, so a config or builder can name one: LR_SCHEDULERS.get_module('LinearWarmupLR')
for _name in __all__:
    LR_SCHEDULERS.register_module(globals()[_name])
del _name
