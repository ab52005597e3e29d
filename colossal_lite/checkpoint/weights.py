"""The weights to deploy, read out of a checkpoint: the model's own, or the EMA average a run kept beside them.

``load_weights`` is what ``colossal-lite ckpt export`` writes. A checkpoint keeps the model's live (training)
weights under ``engine`` -> ``model``, the weights a resume continues from; an ``EMAHook`` keeps its average
as its hook state (``trainer`` -> ``hooks`` -> ``'EMAHook.0'``), an ``AveragedModel`` state dict:
``{'module.<name>': tensor, ..., 'n_averaged': tensor}``. ``ema=True`` returns that average, keyed as the
model's own ``state_dict``, so either loads into the same model.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, NamedTuple, Optional, Union

import torch

from .io import CheckpointError, PathLike, load_single_file
from .model_state import strip_prefix
from .pointers import is_single_file, resolve_path
from .reader import load_shared, model_state_from
from .sharded import has_sharded_state, merge_sharded

__all__ = ["load_weights", "read_weights", "averaged_models", "Weights"]

_AVERAGED_PREFIX = "module."  # AveragedModel keeps the averaged copy as its submodule ``module``
_COUNT = "n_averaged"


class Weights(NamedTuple):
    """Weights read from a checkpoint, and where in it they were found (for a message)."""

    state: Dict[str, torch.Tensor]
    source: str  # 'model', or the key of the hook whose average they are ('EMAHook.0')
    steps: Optional[int]  # optimizer steps averaged in (None for the model's own weights)
    read_from: Optional[Path] = None  # the checkpoint folder or file read (a run's folder names one of its own)


def averaged_models(shared: Dict[str, Any]) -> Dict[str, Dict[str, torch.Tensor]]:
    """``{hook key: AveragedModel state dict}`` for every hook state in ``shared`` that is one (an ``EMAHook``'s)."""
    trainer = shared.get("trainer") if isinstance(shared.get("trainer"), dict) else {}
    hooks = trainer.get("hooks") if isinstance(trainer.get("hooks"), dict) else {}
    return {key: state for key, state in hooks.items() if _is_averaged_model(state)}


def _is_averaged_model(state: Any) -> bool:
    return (isinstance(state, dict) and isinstance(state.get(_COUNT), torch.Tensor) and len(state) > 1
            and all(isinstance(v, torch.Tensor) and (k == _COUNT or str(k).startswith(_AVERAGED_PREFIX))
                    for k, v in state.items()))


def _pick_average(shared: Dict[str, Any], ema: Union[bool, str], where: PathLike) -> Weights:
    found = averaged_models(shared)
    if not found:
        raise CheckpointError(f"checkpoint {where} holds no EMA weights: no hook state in it is an average "
                              f"(an EMAHook's), so the run that wrote it had no EMAHook in fit's hooks. Export the "
                              f"model's own weights without --ema (ema=False), or train with EMAHook(decay=0.999)")
    if isinstance(ema, str):
        key = ema
        if key not in found:
            raise CheckpointError(f"checkpoint {where} has no EMA weights under {key!r}; it has {sorted(found)}: "
                                  f"name one of those")
    elif len(found) > 1:
        raise CheckpointError(f"checkpoint {where} holds {len(found)} EMA averages ({', '.join(sorted(found))}): "
                              f"name the one to export, e.g. --ema-hook {sorted(found)[-1]} "
                              f"(ema={sorted(found)[-1]!r})")
    else:
        (key,) = found
    state = found[key]
    weights = {k[len(_AVERAGED_PREFIX):]: v for k, v in state.items() if k != _COUNT}
    return Weights(weights, key, int(state[_COUNT]))


def read_weights(path: PathLike, ema: Union[bool, str] = False) -> Weights:
    """``load_weights``'s weights with where they came from: the model, or which hook's average over how many steps."""
    p = Path(path)
    if is_single_file(p):
        folder, shared = None, load_single_file(p)
        if not isinstance(shared, dict):
            raise CheckpointError(f"{p} does not hold a checkpoint dict (it holds a {type(shared).__name__})")
    else:
        folder = resolve_path(p)
        shared = load_shared(folder)
    if ema:
        return _pick_average(shared, ema, folder or p)._replace(read_from=folder or p)
    if folder is not None and has_sharded_state(folder) and "model" not in (shared.get("engine") or {}):
        shared = {"model": merge_sharded(folder)["model"]}  # a zero stage 2/3 checkpoint: its shards, merged
    return Weights(strip_prefix(dict(model_state_from(shared))), "model", None, folder or p)


def load_weights(path: PathLike, ema: Union[bool, str] = False) -> Dict[str, torch.Tensor]:
    """The bare model ``state_dict`` (no DDP ``module.`` prefix) a checkpoint holds, for inference or deployment.

    ``path``: a checkpoint folder (sharded ones too), a ``last``/``best`` pointer, a checkpoint directory (its
    ``last``), a merged file or a ``save_checkpoint`` file; every file is verified before it is read.
    ``ema=True``: the EMA average an ``EMAHook`` kept instead of the live weights (``ema='EMAHook.1'`` names one
    when the run had several); a checkpoint without one raises ``CheckpointError`` saying so. Load the result
    with ``model.load_state_dict(weights)``.
    """
    return read_weights(path, ema).state
