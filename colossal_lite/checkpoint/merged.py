"""A sharded (ZeRO stage 2/3) checkpoint merged into one file by ``colossal-lite ckpt merge``.

The file is the checkpoint's shared state with the full model and optimizer tensors in
``engine``, plus a ``merged`` entry that keeps what the folder held besides ``shared.pt``::

    {"engine": {"model": {name: tensor}, "optimizer": {"state": {name: ...}, "param_groups": [...]}, ...},
     "lr_schedulers": ..., "trainer": ..., "hooks": ..., "colossal_lite": ...,     # as in shared.pt
     "merged": {"format": "colossal_lite.merged", "format_version": 1, "from": "<folder>",
                "meta": {epoch, step, metrics, world_size, config, ...},        # from meta.json
                "rank_states": [rank0.pt, rank1.pt, ...]}}

So it resumes like the folder, with any number of ranks and any ZeRO stage: each rank takes its own
random state and data position when the world size is the one that wrote it. The optimizer state is
keyed by parameter name, as sharded runs write it; ``optimizer_state_by_position`` turns it into the
layout ``torch.optim.Optimizer.state_dict()`` has, for optimizers over unsharded parameters, and
``optimizer_state_by_name`` turns that layout back, for optimizers over sharded ones.
The file is verified by the CRC-32 ``torch.save`` records for each record of its zip archive.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .io import CheckpointError

MERGED_KEY = "merged"
MERGED_FORMAT = "colossal_lite.merged"
MERGED_FORMAT_VERSION = 1
# meta.json entries a merged file keeps (files and checksums describe the folder, not the file)
_META_KEYS = ("name", "epoch", "step", "metrics", "world_size", "created_utc", "version", "torch_version", "config")


def merged_state(shared: Dict[str, Any], full: Dict[str, Any], rank_states: List[Dict[str, Any]],
                 meta: Dict[str, Any], folder: Path) -> Dict[str, Any]:
    """The content of a merged file: ``shared`` with ``full``'s model and optimizer, the rank states, ``meta``."""
    state = dict(shared)
    state["engine"] = dict(shared.get("engine") or {}, model=full["model"], optimizer=full["optimizer"])
    state[MERGED_KEY] = {"format": MERGED_FORMAT, "format_version": MERGED_FORMAT_VERSION, "from": str(folder),
                         "meta": {k: meta.get(k) for k in _META_KEYS}, "rank_states": list(rank_states)}
    return state


def is_merged(state: Any) -> bool:
    """True for the content of a file ``ckpt merge`` wrote."""
    info = state.get(MERGED_KEY) if isinstance(state, dict) else None
    return isinstance(info, dict) and info.get("format") == MERGED_FORMAT


def merged_meta(state: Dict[str, Any]) -> Dict[str, Any]:
    """The ``meta.json`` entries of the folder the merged ``state`` was made from."""
    return dict(state[MERGED_KEY].get("meta") or {})


def split_merged(state: Dict[str, Any], path: Path, rank: int, world_size: Optional[int]
                 ) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
    """``(shared_state, rank_state of rank)`` of a merged file's content, as ``read_checkpoint`` returns a folder's."""
    if not is_merged(state):
        raise CheckpointError(f"{path} is a single file but not a merged checkpoint (written by save_checkpoint or "
                              f"torch.save): load it with colossal_lite.utils.load_checkpoint, or LoadCheckpointHook"
                              f"({str(path)!r}) in a Trainer")
    info = state[MERGED_KEY]
    rank_states = info.get("rank_states") or []
    saved_world = (info.get("meta") or {}).get("world_size")
    warn_other_world(path, saved_world, rank, world_size)
    shared = {k: v for k, v in state.items() if k != MERGED_KEY}
    if rank < len(rank_states):
        return shared, rank_states[rank]
    warn_no_rank_state(path, saved_world, rank)
    return shared, None


def warn_other_world(path: Path, saved_world: Optional[int], rank: int, world_size: Optional[int]) -> None:
    if world_size is not None and saved_world is not None and saved_world != world_size and rank == 0:
        warnings.warn(f"checkpoint {path} was written by {saved_world} rank(s) and this run has {world_size}: "
                      f"each rank's share of the data and its random state differ, so the resumed run will not "
                      f"match an uninterrupted one exactly", stacklevel=3)


def warn_no_rank_state(path: Path, saved_world: Optional[int], rank: int) -> None:
    warnings.warn(f"checkpoint {path} was written by {saved_world} rank(s) and has no state for rank {rank}: its "
                  f"random state and data position start fresh, so the resumed run will not match an uninterrupted "
                  f"one exactly", stacklevel=3)


def keyed_by_name(optimizer_state: Any) -> bool:
    """True for an optimizer state dict whose parameters are names (sharded runs), not positions."""
    groups = optimizer_state.get("param_groups") if isinstance(optimizer_state, dict) else None
    return bool(groups) and any(isinstance(p, str) for g in groups for p in g.get("params", []))


def optimizer_state_by_position(optimizer_state: Dict[str, Any]) -> Dict[str, Any]:
    """A name-keyed optimizer state dict in ``Optimizer.state_dict()``'s layout (parameters by position).

    ``Optimizer.load_state_dict`` matches parameters by their order in the param groups, which is
    the order the sharded run's optimizer had; that order is the order of the names here.
    """
    if not keyed_by_name(optimizer_state):
        return optimizer_state
    position: Dict[str, int] = {}
    groups = []
    for group in optimizer_state["param_groups"]:
        ids = [position.setdefault(name, len(position)) for name in group["params"]]
        groups.append(dict(group, params=ids))
    state = optimizer_state.get("state") or {}
    unknown = sorted(set(state) - set(position))
    if unknown:
        raise CheckpointError(f"the optimizer state names parameters that are in none of its param groups: "
                              f"{', '.join(map(str, unknown[:10]))}")
    return {"state": {position[name]: v for name, v in state.items()}, "param_groups": groups}


def parameter_names(model, optimizer) -> List[str]:
    """The names (in ``model``) of ``optimizer``'s parameters, in the order of its param groups."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names.get(id(p)) for g in optimizer.param_groups for p in g["params"]]
    if None in order:
        raise CheckpointError("the optimizer holds parameters that are not the model's (e.g. fp32 master copies): "
                              "its state cannot be matched to the checkpoint's by parameter name")
    return order


def optimizer_state_by_name(optimizer_state: Dict[str, Any], names: List[str]) -> Dict[str, Any]:
    """An optimizer state dict by position (``Optimizer.state_dict()``) keyed by parameter name instead,
    as sharded optimizers load it; ``names`` are the parameter names in the optimizer's order."""
    if keyed_by_name(optimizer_state) or not isinstance(optimizer_state.get("param_groups"), list):
        return optimizer_state  # already by name, or not torch's layout (a wrapper's own state): as it is
    count = sum(len(g["params"]) for g in optimizer_state["param_groups"])
    if count != len(names):
        raise CheckpointError(f"the checkpoint's optimizer has {count} parameters and this optimizer {len(names)}")
    return {"state": {names[i]: v for i, v in (optimizer_state.get("state") or {}).items()},
            "param_groups": [dict(g, params=[names[i] for i in g["params"]]) for g in optimizer_state["param_groups"]]}
