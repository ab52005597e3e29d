"""Legacy ``colossalai.builder``: ``build_gradient_handler`` as legacy had it; the other builders are the
registries' ``build`` (``colossal_lite.registry``), which an import of their legacy names points to."""
from .engine.gradient_handler import build_gradient_handler

__all__ = ["build_gradient_handler"]


def __getattr__(name):
    if name.startswith("build_"):
        raise ImportError(f"colossal_lite.builder.{name} is not provided (only build_gradient_handler is): build "
                          f"from the registry instead, e.g. LR_SCHEDULERS.build(dict(type='LinearWarmupLR', "
                          f"total_steps=100), optimizer=optimizer) or HOOKS.build(dict(type='LossHook')) "
                          f"(from colossal_lite.registry import ...)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
