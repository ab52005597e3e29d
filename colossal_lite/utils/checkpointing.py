"""The legacy ``save_checkpoint``/``load_checkpoint`` single-file API (optimizer and scheduler state included).

``load_model_state`` and ``check_model_state`` (loading with a readable report of what does not match) live in
``colossal_lite.checkpoint.model_state`` and stay importable from here."""
from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from .._version import __version__
from ..checkpoint.io import (
    TMP_PREFIX,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    atomic_save,
    load_single_file,
)
from ..checkpoint.layout import newest_checkpoint, pid_alive, refuse_file_of_folder
from ..checkpoint.manager import (
    META_FILE,
    has_sharded_state,
    is_single_file,
    load_shared,
    merge_checkpoint,
    read_meta,
    resolve_path,
)
from ..checkpoint.merged import (
    is_merged,
    keyed_by_name,
    merged_meta,
    optimizer_state_by_name,
    optimizer_state_by_position,
    parameter_names,
)
from ..checkpoint.model_state import check_model_state, is_sharded, load_model_state, unwrap_module
from ..checkpoint.optimizer_match import OptimizerMismatchError, check_optimizer_state
from ..core.dist import barrier, is_rank_0, world_size
from ..core.global_context import global_context as gpc
from ..core.tree import clone_tensors

__all__ = ["load_model_state", "check_model_state", "save_checkpoint", "load_checkpoint", "load_scheduler_state",
           "write_checkpoint_file", "owning_engine", "engine_resume_state", "refuse_window_on_ranks",
           "get_checkpoint_path", "get_latest_checkpoint_path", "get_latest_checkpoint_pattern"]


# -- legacy v0.1 file names --------------------------------------------------------------------------
def get_checkpoint_path(checkpoint_dir, epoch, suffix: str = "") -> str:
    """Legacy v0.1's name of epoch ``epoch``'s file: ``{checkpoint_dir}/epoch{epoch}-tp0-pp0{suffix}.pt`` (one
    tensor- and pipeline-parallel rank: colossal_lite has neither). ``epoch='{epoch}'`` gives the template that
    ``SaveCheckpointHook`` fills in at each save."""
    return os.path.join(str(checkpoint_dir), f"epoch{epoch}-tp0-pp0{suffix}.pt")


def get_latest_checkpoint_pattern(suffix: str = "") -> str:
    """The regular expression of legacy v0.1's file names, its group the epoch."""
    return rf"epoch(\d+)-tp0-pp0{re.escape(suffix)}\.pt$"


def legacy_epoch_files(checkpoint_dir, suffix: str = "") -> Dict[int, Path]:
    """The legacy v0.1 files ``epoch{E}-tp0-pp0{suffix}.pt`` in ``checkpoint_dir`` by epoch ``E`` (files only)."""
    pattern = re.compile(get_latest_checkpoint_pattern(suffix))
    found: Dict[int, Path] = {}
    for entry in Path(checkpoint_dir).iterdir():
        m = pattern.match(entry.name)
        if m and entry.is_file():
            found[int(m.group(1))] = entry
    return found


def get_latest_checkpoint_path(checkpoint_dir, suffix: str = "") -> str:
    """The legacy v0.1 file of the highest epoch in ``checkpoint_dir``; FileNotFoundError when there is none."""
    found = legacy_epoch_files(checkpoint_dir, suffix)
    if not found:
        raise FileNotFoundError(f"no checkpoint file epoch<N>-tp0-pp0{suffix}.pt in {checkpoint_dir}")
    return os.path.join(str(checkpoint_dir), found[max(found)].name)


# -- legacy single-file checkpoints ----------------------------------------------------------------
_RESERVED = ("epoch", "model", "optimizer", "lr_scheduler", "engine", "colossal_lite")


def save_checkpoint(file, epoch: int, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                    lr_scheduler=None, **kwargs) -> Optional[Path]:
    """Save ``epoch``, the model weights and (unlike legacy Colossal-AI) the optimizer and scheduler state to ``file``.

    When the model, optimizer or scheduler belongs to an engine ``initialize`` built, the engine's own state goes
    in too (``"engine"``: its update count, the fp16 loss scaler, an open accumulation window), so that
    ``load_checkpoint`` continues an engine loop exactly, the scheduler ``initialize`` returned included.
    Written by global rank 0 only, atomically (temp file, fsync, rename), so an interrupted save
    leaves the previous ``file`` intact. The model may be DDP-wrapped or not: the weights are stored
    without the ``module.`` prefix. ``kwargs`` are stored too and must be tensors or plain values.
    The file is a plain dict, readable with ``torch.load(file, weights_only=True)``. Returns the
    path on rank 0, ``None`` elsewhere. Under the engine's ``nonfinite_loss='raise'`` (the default) nan/inf
    weights are refused (``NonFiniteLossError``) and nothing is written. Not a collective (a script may call it on
    rank 0 alone); ``load_checkpoint`` waits for every rank, so a file saved and then loaded is read once written.
    """
    _check_extra(kwargs)
    engine = owning_engine(model, optimizer, lr_scheduler)
    if engine is not None:
        refuse_window_on_ranks(engine, "save_checkpoint")  # on every rank, so that none waits for rank 0 alone
    if engine is not None and engine.shards_state:
        raise ValueError(
            "save_checkpoint: under zero=dict(stage=2|3) the model and optimizer state are sharded over the ranks "
            "and save_checkpoint writes on rank 0 alone, so it cannot gather them (it would write rank 0's shards, "
            "half of every tensor). Fix: let fit save with SaveCheckpointHook(interval, 'ck.pt') (the same single "
            "file, gathered on every rank) or SaveCheckpointHook(interval, 'folder') (sharded, resumable with any "
            "number of ranks after colossal-lite ckpt merge)")
    if optimizer is not None and engine is not None and _optimizer_sharded_by_zero_1(engine):
        raise ValueError(
            "save_checkpoint: under zero=dict(stage=1) the optimizer state is sharded over the ranks and "
            "save_checkpoint writes on rank 0 alone, so it cannot gather it (the state it wrote would be empty). Fix: "
            "save the weights only, save_checkpoint(file, epoch, model), as legacy Colossal-AI did, or let fit save "
            "with SaveCheckpointHook(interval, 'ck.pt'), which gathers the whole state on every rank")
    if not is_rank_0():
        return None
    model_state = unwrap_module(model).state_dict()
    if engine is not None:
        engine.loss_guard.check_weights(model_state, f"save_checkpoint({str(file)!r})")
    return write_checkpoint_file(file, epoch, model_state,
                                 None if optimizer is None else optimizer.state_dict(),
                                 None if lr_scheduler is None else lr_scheduler.state_dict(),
                                 engine_state=None if engine is None else engine_resume_state(engine), **kwargs)


def owning_engine(model: Optional[nn.Module], optimizer=None, lr_scheduler=None):
    """The engine that ``initialize`` built around these objects, or None: the one the scheduler it returned counts
    updates of, else the one driving ``optimizer``, else the one running ``model``."""
    engine = _wrapper_engine(lr_scheduler)
    if engine is not None:
        return engine
    engines = gpc.engines
    if optimizer is not None:
        for candidate in engines:
            # ZeRO stage 1 steps its own optimizer, which shares the param-group list of the user's
            if candidate.optimizer is optimizer or candidate.optimizer.param_groups is optimizer.param_groups:
                return candidate
    module = None if model is None else unwrap_module(model)
    return next((candidate for candidate in engines
                 if module is not None and unwrap_module(candidate.model) is module), None)


def _optimizer_sharded_by_zero_1(engine) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(engine.optimizer, ZeroRedundancyOptimizer)


def refuse_window_on_ranks(engine, what: str) -> None:
    """Refuse a legacy single file taken inside an accumulation window on several ranks: each rank has gathered
    its own gradients (they are reduced only at the window's end) and the file, written by rank 0 alone, would
    give every rank rank 0's, so a run loading it would not continue as the one saved."""
    if world_size() > 1 and not engine.window.at_start:
        raise RuntimeError(f"{what}: a single checkpoint file cannot be taken inside an accumulation window on "
                           f"{world_size()} ranks (each rank holds the gradients it gathered alone, and the file "
                           f"keeps rank 0's only); save at a window's end (an optimizer step boundary), or use a "
                           f"checkpoint folder (SaveCheckpointHook(..., checkpoint_dir='folder')), which keeps each "
                           f"rank's own")


def engine_resume_state(engine) -> Dict[str, Any]:
    """What the engine needs beside the model and optimizer state to continue exactly: its update count (which the
    scheduler wrapper compares with what it has seen), the loss scaler (and naive fp16's fp32 master weights),
    and an open accumulation window with the gradients gathered in it (refused where the gradients are sharded,
    and on several ranks: ``refuse_window_on_ranks``)."""
    refuse_window_on_ranks(engine, "save_checkpoint")
    state = engine.state_dict_without_shards(check_window=engine.shards_state)
    if not engine.window.at_start:
        state["window_grads"] = [None if p.grad is None else p.grad.detach().clone()
                                 for p in engine.unwrapped_model.parameters()]
    return state


def _check_extra(kwargs: Dict[str, Any]) -> None:
    clash = sorted(set(kwargs) & {*_RESERVED, "engine_state"})
    if clash:
        raise ValueError(f"save_checkpoint(**kwargs) cannot use the names {clash}: they hold the checkpoint itself")


def write_checkpoint_file(file, epoch: int, model_state: Dict[str, Any], optimizer_state: Optional[Dict] = None,
                          scheduler_state: Optional[Dict] = None, *, engine_state: Optional[Dict] = None,
                          **kwargs) -> Path:
    """``save_checkpoint``'s file from states already taken, written by this process (atomically) whichever rank
    it is: ``SaveCheckpointHook`` with a file path gathers the states on every rank (a collective where they are
    sharded) and writes on rank 0 only. ``engine_state``: ``engine_resume_state(engine)``."""
    _check_extra(kwargs)
    state: Dict[str, Any] = {"epoch": int(epoch), "model": model_state}
    if optimizer_state is not None:
        state["optimizer"] = optimizer_state
    if scheduler_state is not None:
        state["lr_scheduler"] = scheduler_state
    if engine_state is not None:
        state["engine"] = engine_state
    state.update(kwargs)
    state["colossal_lite"] = {"version": __version__, "torch_version": torch.__version__}
    path = Path(file)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointWriteError(f"could not write checkpoint {path}: cannot create its folder {path.parent} "
                                   f"({e.strerror or e})") from e
    return atomic_save(state, path)


def remove_stale_temp_files(file) -> List[Path]:
    """Delete the temporary files that writes of ``file`` killed midway left next to it (``.tmp-<name>-<pid>`` of
    processes that are gone); other files in that folder are never touched."""
    path = Path(file)
    removed = []
    pattern = re.compile(re.escape(f"{TMP_PREFIX}{path.name}-") + r"(\d+)$")
    if not path.parent.is_dir():
        return removed
    for entry in path.parent.iterdir():
        m = pattern.match(entry.name)
        if m and entry.is_file() and not pid_alive(int(m.group(1))):
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def load_scheduler_state(lr_scheduler, state) -> None:
    """``lr_scheduler.load_state_dict(state)`` for a state saved from the engine's scheduler wrapper loaded into a
    bare scheduler, or the other way round. ``lr_scheduler`` may be a wrapper itself (the engine's, or an object
    holding one as ``.lr_scheduler`` and passing the state on): it then gets the state as saved."""
    if _is_wrapped_state(state) and _wrapper_engine(lr_scheduler) is None:
        state = state["scheduler"]
    lr_scheduler.load_state_dict(state)


def _is_wrapped_state(state) -> bool:
    """The state of the engine's scheduler wrapper: the scheduler's own and the updates it has seen."""
    return isinstance(state, dict) and set(state) == {"scheduler", "seen_updates"}


def _wrapper_engine(target):
    """The engine of ``target`` when it is the engine's scheduler wrapper (an ``EngineLRScheduler``) or holds one
    as ``.lr_scheduler`` (an ``LRSchedulerHook``); else None."""
    while target is not None:
        attributes = getattr(target, "__dict__", {})
        if "_engine" in attributes:
            return attributes["_engine"]
        target = attributes.get("lr_scheduler")
    return None


def load_checkpoint(file, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, lr_scheduler=None,
                    strict: bool = True) -> int:
    """Load a ``save_checkpoint`` file into ``model`` (DDP-wrapped, ZeRO-sharded or not) and, when given,
    ``optimizer`` and ``lr_scheduler``; returns the stored epoch (-1 if the file has none). Every rank calls it
    and reads ``file``, after waiting for the others: a file that rank 0 is still writing (``save_checkpoint``
    returns at once on the other ranks) is read once written, not in its earlier version or missing.

    With ``optimizer`` given, the engine that owns these objects (see ``save_checkpoint``) gets its saved state
    back: update count, loss scaler, open window. A file written before save_checkpoint stored that state gives
    the engine the update count its scheduler wrapper had seen, so the schedule still continues; the loss scale
    then starts afresh (with a warning).

    A file ``colossal-lite ckpt merge`` wrote loads too: its model, optimizer and (first) scheduler,
    and the epoch of the checkpoint it was merged from. So does a checkpoint folder
    (``SaveCheckpointHook``'s): one checkpoint folder, a ``last``/``best`` pointer, or the folder of a
    run's checkpoints, whose ``last`` (else its newest checkpoint) is loaded; its files are verified
    against the checksums its ``meta.json`` records. A file is compared with the CRC-32 of
    each record of its zip archive, then read with ``torch.load(weights_only=True)``: one carrying
    other pickled objects is refused and nothing in it runs. A model that does not match raises
    listing the missing and unexpected keys and the shape mismatches (missing/unexpected keys are
    allowed with ``strict=False``).
    """
    barrier()  # (legacy scripts load right after saving, with no barrier of their own)
    path = Path(file)
    if path.is_dir() or _is_pointer(path):
        folder, state = _folder_state(path)
        return load_checkpoint_state(state, folder, model, optimizer, lr_scheduler, strict)
    return load_checkpoint_state(load_single_file(path), path, model, optimizer, lr_scheduler, strict)


def _is_pointer(path: Path) -> bool:
    """A ``last``/``best`` pointer file naming a checkpoint folder next to it (not a small checkpoint file)."""
    return path.is_file() and not is_single_file(path)


def _folder_state(path: Path) -> Tuple[Path, Dict[str, Any]]:
    """The checkpoint folder ``path`` names and its content in ``save_checkpoint``'s layout (this process only)."""
    folder = _checkpoint_folder(path)
    if has_sharded_state(folder):  # ZeRO stage 2/3: the full model and optimizer come from the shards
        merged = merge_checkpoint(folder)
        return folder, _legacy_view(merged, merged_meta(merged).get("epoch", -1))
    return folder, _legacy_view(load_shared(folder), read_meta(folder).get("epoch", -1))


def _checkpoint_folder(path: Path) -> Path:
    """One checkpoint folder from a checkpoint folder, a pointer, or a folder of checkpoints (its ``last``, else
    its newest complete one, see ``resolve_path``)."""
    if (path.is_dir() and not (path / META_FILE).is_file() and not (path / "last").is_file()
            and newest_checkpoint(path) is None):
        raise CheckpointNotFoundError(f"{path} is a folder, not a checkpoint file, and holds no complete "
                                      f"colossal_lite checkpoint (no {META_FILE}, no 'last' pointer, no "
                                      f"checkpoint folder in it)")
    return resolve_path(path)


def load_checkpoint_state(state, path: Path, model: nn.Module, optimizer=None, lr_scheduler=None,
                          strict: bool = True, engine=None) -> int:
    """``load_checkpoint`` of the content of the file ``path``, already read. ``engine``: the one whose state the
    file's engine state restores (None: the one that owns these objects, if any)."""
    if is_merged(state):
        state = _legacy_view(state, merged_meta(state).get("epoch", -1))
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        refuse_file_of_folder(path)
        found = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"{path} is not a save_checkpoint file: it has no 'model' entry (found {found})")
    if optimizer is not None and isinstance(state.get("optimizer"), dict):
        try:  # before anything is loaded: torch would load another optimizer class's state and fail in its own code
            check_optimizer_state(optimizer, state["optimizer"], (state.get("engine") or {}).get("optimizer_class"))
        except OptimizerMismatchError as e:
            raise OptimizerMismatchError(f"cannot load the optimizer state of {path}: {e}; build the optimizer it "
                                         f"was written with, or load the model alone (no optimizer)") from None
    try:
        load_model_state(model, state["model"], strict=strict)
    except RuntimeError as e:
        raise RuntimeError(f"cannot load {path} into the model: {e}") from None
    owner = engine or owning_engine(model, optimizer, lr_scheduler)
    for name, target in (("optimizer", optimizer), ("lr_scheduler", lr_scheduler)):
        if target is None:
            continue
        if name not in state:
            warnings.warn(f"{path} holds no {name} state (saved without one, or by legacy Colossal-AI); "
                          f"the {name} was left as it is", stacklevel=3)
            continue
        try:
            if name == "optimizer" and owner is not None and _optimizer_sharded_by_zero_1(owner):
                # the state belongs in the engine's ZeroRedundancyOptimizer (each rank keeps its shard's), not in
                # the optimizer the script built, which it steps no more
                owner.strategy.load_optimizer_state_dict(owner.model, owner.optimizer,
                                                         optimizer_state_by_position(clone_tensors(state[name])))
            elif name == "optimizer":
                _load_optimizer(model, target, clone_tensors(state[name]))
            else:
                load_scheduler_state(target, state[name])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"cannot load the {name} state of {path} into this {name} "
                             f"({type(target).__name__}): {e}") from e
    if optimizer is not None:  # weights alone (finetuning) leave the engine's count and loss scale as they are
        _load_engine_state(state, path, owner)
    epoch = state.get("epoch", -1)
    return int(epoch) if isinstance(epoch, (int, float)) else -1


def _load_engine_state(state: Dict[str, Any], path: Path, engine) -> None:
    """The file's engine state into ``engine`` (None: the objects belong to no engine, nothing to do)."""
    if engine is None:
        return
    saved = state.get("engine")
    if saved is None:
        saved = _older_file_engine_state(state, path, engine)
    try:
        engine.load_state_dict(saved)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot load the engine state of {path} (update count, loss scaler, accumulation "
                         f"window) into this engine: {e}") from e


def _older_file_engine_state(state: Dict[str, Any], path: Path, engine) -> Dict[str, Any]:
    """For a file without the engine's state: the update count the scheduler wrapper had seen when it was saved
    (the wrapper steps only when the engine's count differs from it, so a count left at 0 would move it once
    too often)."""
    if engine.loss_scale is not None:
        warnings.warn(f"{path} holds no loss scale (saved by an older colossal_lite, or without the engine's "
                      f"optimizer); the fp16 loss scale starts from its initial value", stacklevel=5)
    scheduler = state.get("lr_scheduler")
    return {"num_updates": int(scheduler["seen_updates"])} if _is_wrapped_state(scheduler) else {}


def _legacy_view(checkpoint: Dict[str, Any], epoch: Any) -> Dict[str, Any]:
    """A trainer checkpoint's content (a folder's shared state, or a merged file) in ``save_checkpoint``'s layout:
    model, optimizer, the engine's own state, the first scheduler, ``epoch``."""
    engine = checkpoint.get("engine") or {}
    view: Dict[str, Any] = {"model": engine.get("model"), "epoch": -1 if epoch is None else epoch}
    if "optimizer" in engine:
        view["optimizer"] = engine["optimizer"]
    if "num_updates" in engine:  # written by an engine (not an outside tool): its state beside model and optimizer
        view["engine"] = {key: value for key, value in engine.items() if key not in ("model", "optimizer")}
    schedulers = checkpoint.get("lr_schedulers") or {}
    if schedulers:
        view["lr_scheduler"] = next(iter(schedulers.values()))  # the first LRSchedulerHook's
    return view


def _load_optimizer(model: nn.Module, optimizer, state: Dict[str, Any]) -> None:
    """Full optimizer state into ``optimizer``: by parameter name for sharded parameters, else by position."""
    if not is_sharded(unwrap_module(model)):
        optimizer.load_state_dict(optimizer_state_by_position(state))
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if not keyed_by_name(state):  # a file of an unsharded run: its parameters by position
        state = optimizer_state_by_name(state, parameter_names(unwrap_module(model), optimizer))
    set_optimizer_state_dict(unwrap_module(model), optimizer, state, options=StateDictOptions(full_state_dict=True))
