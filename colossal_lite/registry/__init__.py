"""Named registries of classes, the legacy ``colossalai.registry``.

A config names a class by a string (``gradient_handler = [dict(type='MyGradientHandler')]``); the registry
turns the string into the class. Registries that legacy backed with a library (``LAYERS`` with ``torch.nn``,
``OPTIMIZERS`` with ``torch.optim``, ...) also find that library's classes; the library is imported on the
first lookup that needs it, so importing this module stays cheap (torchvision is not loaded until asked).
"""
from .registry import Registry, RegistryError

LAYERS = Registry("layers", third_party_library=["torch.nn"])
LOSSES = Registry("losses", third_party_library=["torch.nn"])
MODELS = Registry("models", third_party_library=["torchvision.models"])
OPTIMIZERS = Registry("optimizers", third_party_library=["torch.optim", "torch.distributed.optim"])
DATASETS = Registry("datasets", third_party_library=["torchvision.datasets"])
TRANSFORMS = Registry("transforms", third_party_library=["torchvision.transforms"])
HOOKS = Registry("hooks")
# legacy's schedulers were registered by ``import colossalai``; here by their first lookup
LR_SCHEDULERS = Registry("lr_schedulers", third_party_library=["colossal_lite.nn.lr_scheduler"])
DATA_SAMPLERS = Registry("data_samplers")
SCHEDULE = Registry("schedules")
GRADIENT_HANDLER = Registry("gradient_handler")
DIST_GROUP_INITIALIZER = Registry("dist_group_initializer")
MODEL_WRAPPERS = Registry("model_wrappers")
SCHEDULE.variable = "SCHEDULE"

__all__ = [
    "Registry", "RegistryError", "LAYERS", "LOSSES", "MODELS", "OPTIMIZERS", "DATASETS", "TRANSFORMS", "HOOKS",
    "LR_SCHEDULERS", "DATA_SAMPLERS", "SCHEDULE", "GRADIENT_HANDLER", "DIST_GROUP_INITIALIZER", "MODEL_WRAPPERS",
]
