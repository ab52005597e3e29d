"""Model state loading with a readable report of what does not match: missing and unexpected keys, shapes.

The engine's strategies, the legacy ``load_checkpoint`` and the checkpoint tool all load weights through it.
"""
from __future__ import annotations

from typing import Dict

import torch
from torch import nn

__all__ = ["ModelMismatchError", "strip_prefix", "check_model_state", "load_model_state", "unwrap_module",
           "is_sharded"]


class ModelMismatchError(RuntimeError):
    """A checkpoint's weights do not fit the model: missing or unexpected keys (``strict``), or other shapes."""

    def __init__(self, message: str, shapes_differ: bool):
        super().__init__(message)
        self.shapes_differ = shapes_differ


def strip_prefix(state: Dict[str, torch.Tensor], prefix: str = "module.") -> Dict[str, torch.Tensor]:
    """``state`` without ``prefix`` (DDP's ``module.``) when every key has it; else ``state`` as it is."""
    if state and all(k.startswith(prefix) for k in state):
        return {k[len(prefix):]: v for k, v in state.items()}
    return state


def check_model_state(own: Dict[str, torch.Tensor], state: Dict[str, torch.Tensor], strict: bool = True):
    """Raise a ``ModelMismatchError`` listing missing/unexpected keys (with ``strict``) and shape mismatches.

    ``own`` is the model's state dict (DTensors report their global shapes). Returns (missing, unexpected).
    """
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
              for k in sorted(set(own) & set(state))
              if isinstance(state[k], torch.Tensor) and tuple(state[k].shape) != tuple(own[k].shape)]
    if shapes or (strict and (missing or unexpected)):
        parts = []
        if missing:
            parts.append(f"missing keys ({len(missing)}): {', '.join(missing[:20])}{' ...' if len(missing) > 20 else ''}")
        if unexpected:
            parts.append(f"unexpected keys ({len(unexpected)}): {', '.join(unexpected[:20])}"
                         f"{' ...' if len(unexpected) > 20 else ''}")
        if shapes:
            parts.append(f"shape mismatches ({len(shapes)}): {'; '.join(shapes[:20])}")
        raise ModelMismatchError("the checkpoint does not match the model:\n  " + "\n  ".join(parts), bool(shapes))
    return missing, unexpected


def load_model_state(model: nn.Module, state: Dict[str, torch.Tensor], strict: bool = True):
    """Load ``state`` (full tensors) into ``model`` (DDP ``module.`` prefixes ignored either way; a ZeRO
    stage 2/3 model takes its shard of each tensor).

    With ``strict``, a mismatch raises a ``RuntimeError`` listing missing and unexpected
    keys and the shape mismatches.
    """
    model = unwrap_module(model)
    state = strip_prefix(dict(state))
    missing, unexpected = check_model_state(model.state_dict(), state, strict)
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
    else:
        model.load_state_dict(state, strict=False)
    return missing, unexpected


def unwrap_module(model: nn.Module) -> nn.Module:
    """The user's module inside torch.compile (``_orig_mod``) and DDP-style (``.module``) wrappers, in any nesting.

    Its ``state_dict`` has the keys of the plain model, which is what a checkpoint stores and loads.
    """
    while True:
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module) or isinstance(model, nn.ModuleList):
            return model
        model = inner


def is_sharded(model: nn.Module) -> bool:
    """True for a model whose parameters are DTensors (ZeRO stage 2/3, FSDP2)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())
