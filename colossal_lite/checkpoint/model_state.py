"""Model state loading with a readable report of what does not match: missing and unexpected keys, shapes.

The engine's strategies, the legacy ``load_checkpoint`` and the checkpoint tool all load weights through it.
"""
from __future__ import annotations

import sys
from typing import Dict, Iterable, Optional

import torch
from torch import nn

__all__ = ["ModelMismatchError", "strip_prefix", "check_model_state", "load_model_state", "unwrap_module",
           "is_sharded"]


class ModelMismatchError(RuntimeError):
    """A checkpoint's weights do not fit the model: missing or unexpected keys (``strict``), or other shapes."""

    def __init__(self, message: str, shapes_differ: bool):
        super().__init__(message)
        self.shapes_differ = shapes_differ


#: The key prefixes wrappers add to a model's state dict: DDP's and torch.compile's.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def strip_prefix(state: Dict[str, torch.Tensor], own: Optional[Iterable[str]] = None) -> Dict[str, torch.Tensor]:
    """``state`` without the prefixes wrappers add (``WRAPPER_PREFIXES``, in any nesting) where every key has
    one; else ``state`` as it is. ``own``: the keys of the model it is for, when known: stripping stops where the
    keys are the model's (a model whose only child is called ``module`` keeps that prefix)."""
    own = set(own) if own is not None else None
    while state and set(state) != own:
        prefix = next((p for p in WRAPPER_PREFIXES if all(k.startswith(p) for k in state)), None)
        if prefix is None:
            break
        state = {k[len(prefix):]: v for k, v in state.items()}
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
    own = model.state_dict()
    state = strip_prefix(dict(state), own)
    missing, unexpected = check_model_state(own, state, strict)
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
    else:
        model.load_state_dict(state, strict=False)
    return missing, unexpected


def unwrap_module(model: nn.Module) -> nn.Module:
    """The user's module inside torch.compile's and data parallelism's wrappers, in any nesting.

    Its ``state_dict`` has the keys of the plain model, which is what a checkpoint stores and loads. Only those
    wrappers are opened: a model of the user's with a child called ``module`` (a backbone beside a head) is the
    model, whole.
    """
    while True:
        inner = _wrapped(model)
        if inner is None:
            return model
        model = inner


def _wrapped(model: nn.Module) -> Optional[nn.Module]:
    """The module a wrapper holds (``DistributedDataParallel``, ``DataParallel``, torch.compile's
    ``OptimizedModule``); None for any other module."""
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        return model.module
    compiled = sys.modules.get("torch._dynamo.eval_frame")  # no compiled module exists before it is imported
    if compiled is not None and isinstance(model, compiled.OptimizedModule):
        return model._orig_mod
    return None


def is_sharded(model: nn.Module) -> bool:
    """True for a model whose parameters are DTensors (ZeRO stage 2/3, FSDP2)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())
