"""Model state loading with a readable report of what does not match."""
from __future__ import annotations

from typing import Dict

import torch
from torch import nn


def _strip_prefix(state: Dict[str, torch.Tensor], prefix: str = "module.") -> Dict[str, torch.Tensor]:
    if state and all(k.startswith(prefix) for k in state):
        return {k[len(prefix):]: v for k, v in state.items()}
    return state


def load_model_state(model: nn.Module, state: Dict[str, torch.Tensor], strict: bool = True):
    """Load ``state`` into ``model`` (DDP ``module.`` prefixes ignored either way).

    With ``strict``, a mismatch raises a ``RuntimeError`` listing missing and unexpected
    keys and the shape mismatches.
    """
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    state = _strip_prefix(dict(state))
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
              for k in sorted(set(own) & set(state))
              if isinstance(state[k], torch.Tensor) and state[k].shape != own[k].shape]
    if shapes or (strict and (missing or unexpected)):
        parts = []
        if missing:
            parts.append(f"missing keys ({len(missing)}): {', '.join(missing[:20])}{' ...' if len(missing) > 20 else ''}")
        if unexpected:
            parts.append(f"unexpected keys ({len(unexpected)}): {', '.join(unexpected[:20])}"
                         f"{' ...' if len(unexpected) > 20 else ''}")
        if shapes:
            parts.append(f"shape mismatches ({len(shapes)}): {'; '.join(shapes[:20])}")
        raise RuntimeError("the checkpoint does not match the model:\n  " + "\n  ".join(parts))
    model.load_state_dict(state, strict=False)
    return missing, unexpected
