"""Whether a checkpoint's optimizer state fits the optimizer it is loaded into: one of the same class.

torch loads another optimizer's state without a check and fails later, in the optimizer's own code, with a
bare ``KeyError`` naming one of its options ('momentum', 'step'). The engine records its optimizer's class in
what it saves (``optimizer_class``); a checkpoint written before that is judged by its options instead.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

__all__ = ["OptimizerMismatchError", "optimizer_class_name", "check_optimizer_state"]


class OptimizerMismatchError(RuntimeError):
    """A checkpoint's optimizer state was written by another optimizer class than the one it is loaded into."""


def _built_optimizer(optimizer) -> torch.optim.Optimizer:
    """The optimizer a user built: ``ZeroRedundancyOptimizer`` and colossal_lite's wrappers hold it as ``optim``."""
    while isinstance(getattr(optimizer, "optim", None), torch.optim.Optimizer):
        optimizer = optimizer.optim
    return optimizer


def optimizer_class_name(optimizer) -> str:
    """The class name recorded with a checkpoint: by name, so a class that moved between modules (a refactor, a
    torch release) is still the same optimizer."""
    return type(_built_optimizer(optimizer)).__name__


def check_optimizer_state(optimizer, state: Dict[str, Any], saved_class: Optional[str]) -> None:
    """Raise ``OptimizerMismatchError`` when ``state`` (an optimizer ``state_dict``) was written by another class
    than ``optimizer``'s. ``saved_class``: the class recorded with it (None for an older checkpoint: its groups'
    options are compared with the optimizer's defaults)."""
    own = optimizer_class_name(optimizer)
    if saved_class is not None:
        if saved_class != own:
            raise OptimizerMismatchError(f"the checkpoint's optimizer state was written by {saved_class}, and this "
                                         f"run's optimizer is {own}")
        return
    built = _built_optimizer(optimizer)
    saved = {key for group in state.get("param_groups") or [] for key in group} - {"params"}
    own_keys = set(built.defaults) | {key for group in built.param_groups for key in group}
    # Options of another class on both sides. An LR scheduler adds entries of its own to the groups (initial_lr,
    # ...), and torch adds options to an optimizer over its releases, as flags (None or False by default) that it
    # fills in when an older state lacks them: neither is another class.
    foreign = sorted(saved - own_keys)
    lacking = sorted(key for key, default in built.defaults.items()
                     if key not in saved and default is not None and not isinstance(default, bool))
    if foreign and lacking:
        raise OptimizerMismatchError(f"the checkpoint's optimizer state was written by another optimizer class than "
                                     f"this run's {own}: its options {', '.join(foreign)} are not {own}'s, and it "
                                     f"lacks {own}'s {', '.join(lacking)}")
