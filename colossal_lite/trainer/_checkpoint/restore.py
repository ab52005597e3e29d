"""Reading a trainer checkpoint back into a run: the engine, then each part's state through the state protocol."""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Dict, Optional, Union

from ...checkpoint import CheckpointManager, restore_rng_state
from ...checkpoint.io import CheckpointDamagedError, CheckpointError
from ...checkpoint.layout import read_save_times
from ...checkpoint.manager import has_sharded_state, load_sharded, model_state_from, optimizer_state_keys
from ...checkpoint.merged import keyed_by_name, optimizer_state_by_name, optimizer_state_by_position, parameter_names
from ...checkpoint.model_state import ModelMismatchError
from ...checkpoint.optimizer_match import OptimizerMismatchError, check_optimizer_state
from ...core.dist import is_rank_0, log_rank_0, world_size
from .contents import WINDOW_GRADS_IN_RANK_STATE, hook_entry, saved_hook_states

__all__ = ["batch_in_resized_epoch", "load_trainer_checkpoint", "restore_trainer_checkpoint"]

PathLike = Union[str, "os.PathLike[str]"]


def load_trainer_checkpoint(trainer, manager: CheckpointManager, which: Union[str, PathLike] = "last",
                            train_loader=None, finetune: bool = False, strict: bool = True) -> Optional[Path]:
    """Restore the run from the checkpoint ``which`` names (see ``CheckpointManager.resolve``); every rank calls it.

    ``which`` may name a checkpoint folder or a file ``ckpt merge`` wrote. ``which='auto'`` with nothing
    to resume returns None (a fresh start), and skips damaged checkpoints with a warning
    (``CheckpointManager.read``). See ``restore_trainer_checkpoint`` for what is restored.
    """
    damaged: Dict[str, str] = {}  # ZeRO 2/3 shards are checked as they load: a damaged one is found here
    while True:
        found = manager.read(which, damaged)
        if found is None:
            return None
        path, shared, rank_state = found
        try:
            return restore_trainer_checkpoint(trainer, path, shared, rank_state, train_loader, finetune, strict)
        except CheckpointDamagedError as error:  # raised on every rank, before anything but the engine changed
            if not (isinstance(which, str) and which == "auto"):
                raise
            damaged[str(path)] = str(error)
            if is_rank_0():
                warnings.warn(f"{error}; resume_from='auto' goes on to the next newest checkpoint in "
                              f"{manager.checkpoint_dir}", stacklevel=3)


def restore_trainer_checkpoint(trainer, path: Path, shared: Dict[str, Any], rank_state: Optional[Dict[str, Any]],
                               train_loader=None, finetune: bool = False, strict: bool = True) -> Path:
    """Restore the run from a checkpoint already read (``read_checkpoint``); every rank calls it. Returns ``path``.

    Restores the engine (model, optimizer, loss scaler, accumulation window), then the progress and the
    ``state_dict`` of every hook (an ``LRSchedulerHook``'s is its scheduler's), each hook's
    ``rank_state_dict``, fires ``on_load_checkpoint``, then the data position, the train metrics' sums and
    the random state of this rank. ``finetune=True``: the model weights only, progress from 0.
    Call it with the hooks attached. ``train_loader`` defaults to the one the running ``fit`` trains on.
    """
    if train_loader is None and trainer.checkpoints is not None:
        train_loader = trainer.checkpoints.train_loader
    position = None if finetune else _position_in_epoch(trainer, path, shared)
    same_world = _same_world(shared)
    rank_state = rank_state if rank_state is not None else {}
    try:
        if finetune:
            _load_weights_only(trainer, path, shared, strict)
        else:
            _restore_engine(trainer.engine, path, shared, rank_state if same_world else {}, strict)
    except ModelMismatchError as err:
        raise ModelMismatchError(f"{err}\n{_ways_on(path, err.shapes_differ)}", err.shapes_differ) from err
    except OptimizerMismatchError as err:
        raise OptimizerMismatchError(f"{err}\nCheckpoint read: {path}. Fix: build the optimizer it was written "
                                     f"with, or take its weights only and train from step 0 with this optimizer: "
                                     f"LoadCheckpointHook('{path.parent}', finetune=True)") from err
    if finetune:
        trainer.load_state_dict({"progress": {"epoch": 0, "step": 0, "iteration": 0, "batch_idx": 0}})
        return path
    saved = shared.get("trainer") or {}
    progress = dict(saved.get("progress", {}))
    if position is not None:
        log_rank_0(trainer.logger, f"checkpoint {path} stopped after {progress['batch_idx']} of its epoch's "
                                   f"{(shared.get('colossal_lite') or {}).get('batches_per_epoch')} batches per rank; "
                                   f"this run's epoch has {trainer.state.iters_per_epoch}: it goes on after batch "
                                   f"{position}, past the same samples")
        progress["batch_idx"] = position
    trainer.load_state_dict({"progress": progress, "hooks": _hook_states_to_load(trainer, path, shared),
                             "history": saved.get("history"), "trackers": saved.get("trackers"),
                             "objects": saved.get("objects")})
    _restore_save_times(trainer, path)
    trainer.restored_from = path
    if same_world:
        _load_rank_hook_states(trainer, rank_state)
    trainer.fire("on_load_checkpoint", dict(shared, rank_state=rank_state))
    _restore_rank_state(trainer, path, shared, rank_state, train_loader, same_world)
    return path


def _position_in_epoch(trainer, path: Path, shared: Dict[str, Any]) -> Optional[int]:
    """Where a checkpoint inside an epoch resumes in this run's epoch: None when it did not stop inside one or the
    epoch has as many batches per rank as then; else the batch after the same share of the epoch's samples.

    With another number of batches per rank (another batch size or number of ranks) the batches already trained
    are counted anew: after 10 of 20 batches of 16 on 1 rank, 5 of 10 batches of 32, or of 16 on 2 ranks, cover
    the same samples of the epoch's order. Where no whole number of this run's batches (and of its accumulation
    windows) covers them, or the checkpoint lies inside a window, the rest of the epoch would be skipped or
    repeated: refused, on every rank alike, before anything is loaded."""
    done = int(((shared.get("trainer") or {}).get("progress") or {}).get("batch_idx") or 0)
    meta = shared.get("colossal_lite") or {}
    saved, now = meta.get("batches_per_epoch"), trainer.state.iters_per_epoch
    if not done or saved is None or now is None or saved == now:
        return None
    window = trainer.engine.window.size
    open_window = ((shared.get("engine") or {}).get("accumulation") or {}).get("micro_step")
    if open_window and meta.get("world_size") != world_size():
        return None  # (refused where the window's gradients are read, naming the ranks to resume with)
    position = None if open_window else batch_in_resized_epoch(done, saved, now, window)
    if position is not None:
        return position
    raise CheckpointError(
        f"checkpoint {path} was taken inside an epoch, after {done} of its {saved} batches per rank "
        f"({meta.get('world_size')} rank(s)), but this run's epoch has {now} batches per rank ({world_size()} "
        f"rank(s)), and no whole number of them" + (f" (in windows of {window})" if window > 1 else "") +
        " covers the samples already trained" + (" (the checkpoint lies inside an accumulation window)"
                                                   if open_window else "") +
        ", so the rest of the epoch would be skipped or repeated. Fix: resume with the batch size and number of "
        "ranks the checkpoint was taken with, or from a checkpoint taken at an epoch's end")


def batch_in_resized_epoch(done: int, saved: int, now: int, window: int) -> Optional[int]:
    """The batch of an epoch of ``now`` batches per rank past the samples that ``done`` of an epoch of ``saved``
    batches covered (the same share of the epoch's order); None when no whole number of batches, and of
    accumulation windows of ``window``, covers them."""
    if (done * now) % saved or (done * now // saved) % window:
        return None
    return done * now // saved


def _restore_save_times(trainer, path: Path) -> None:
    """The times of the save that wrote the checkpoint, into the restored history (recorded after the checkpoint
    was taken, they are added to its folder once it is complete), so a resumed run's history and metrics file hold
    them as the uninterrupted run's do."""
    record = read_save_times(path)
    if record is None:
        return
    names = set(record["values"])
    if not any(r["step"] == record["step"] and r["name"] in names for r in trainer.history.records):
        trainer.history.add_values(record["step"], record["epoch"], record["time"], record["values"])


def _ways_on(path: Path, shapes_differ: bool) -> str:
    """What a user whose model changed since the checkpoint was written can do instead."""
    ways = ["resume from a checkpoint of this model (give the new run its own folder: "
            "SaveCheckpointHook(..., checkpoint_dir='another/folder'))",
            "or start afresh without reading it: fit(..., resume_from=None)"]
    if not shapes_differ:
        ways.append(f"or take the weights that match and train from step 0: "
                    f"LoadCheckpointHook('{path.parent}', finetune=True, strict=False)")
    return f"Checkpoint read: {path}. Fix: " + ", ".join(ways)


def _hook_states_to_load(trainer, path: Path, shared: Dict[str, Any]) -> Dict[str, Any]:
    """The saved ``state_dict`` of each hook by key, from the entry it names. A hook whose entry is one of its
    own kind (a scheduler's) and finds nothing there starts from its current state, with a warning."""
    saved = saved_hook_states(shared)
    states: Dict[str, Any] = {}
    for key, hook in trainer.state_registry.parts("hooks").items():
        entry = hook_entry(hook)
        if key in saved[entry]:
            states[key] = saved[entry][key]
        elif entry != "trainer":
            warnings.warn(f"checkpoint {path} has no state for {key} in its {entry!r} entry (it has "
                          f"{sorted(saved[entry])}); it starts from its current state", stacklevel=3)
    return states


def _same_world(shared: Dict[str, Any]) -> bool:
    """The checkpoint was written by as many ranks as this run has: each rank's own state is its own."""
    return (shared.get("colossal_lite") or {}).get("world_size") in (None, world_size())


def _load_rank_hook_states(trainer, rank_state: Dict[str, Any]) -> None:
    trainer.state_registry.load({"hooks": (rank_state.get("trainer") or {}).get("hooks") or {}}, rank=True)


def _restore_rank_state(trainer, path: Path, shared: Dict[str, Any], rank_state: Dict[str, Any], train_loader,
                        same_world: bool) -> None:
    """This rank's data position and train metric sums (with the world size that wrote them), then its random state."""
    data = rank_state.get("data")
    load = getattr(train_loader, "load_state_dict", None)
    if data is not None and callable(load) and same_world:
        load(data)  # the sampler starts after the samples already seen; nothing is loaded to skip them
    if same_world:  # this rank's sums of the epoch so far, the epoch's starting random state and read-ahead
        trainer.state_registry.load({"metrics": rank_state.get("metrics") or {},
                                     "epoch": rank_state.get("epoch") or {}}, rank=True)
    elif rank_state.get("metrics") and trainer.state.batch_idx:
        saved_world = (shared.get("colossal_lite") or {}).get("world_size")
        warnings.warn(f"checkpoint {path} was written by {saved_world} ranks and this run has {world_size()}: the "
                      f"train metrics of the resumed epoch ({', '.join(sorted(rank_state['metrics']))}) count only "
                      f"its batches from batch {trainer.state.batch_idx} on", stacklevel=4)
    if rank_state.get("rng") is not None:
        restore_rng_state(rank_state["rng"])


# -- the engine ---------------------------------------------------------------------------------
def _load_weights_only(trainer, path: Path, shared: Dict[str, Any], strict: bool) -> None:
    engine = trainer.engine
    if has_sharded_state(path) and "model" not in (shared.get("engine") or {}):
        if not engine.shards_state:
            raise CheckpointError(f"checkpoint {path} holds its model as zero stage 2/3 shards; load it with zero "
                                  f"stage 2/3, or write one file first: colossal-lite ckpt merge {path} merged.pt")
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

        # the model's template alone: torch's whole state dict would step this fresh optimizer at learning rate 0
        # to make its state (Adam's step count one ahead of a fine-tuning run's first update)
        state = {"model": get_model_state_dict(engine.model)}
        load_sharded(path, state)
        set_model_state_dict(engine.model, state["model"], options=StateDictOptions(strict=strict))
        return
    weights = model_state_from(shared)
    if not strict and not engine.shards_state:
        own = set(engine.unwrapped_model.state_dict())
        plain = {k[len("module."):] if k.startswith("module.") else k for k in weights}
        missing, unexpected = sorted(own - plain), sorted(plain - own)
        if missing or unexpected:
            log_rank_0(trainer.logger, f"finetune from {path}: missing keys {missing}, unexpected keys "
                                       f"{unexpected} (left as they are; strict=False)")
    engine.strategy.load_model_state_dict(engine.model, weights, strict=strict)


def _restore_engine(engine, path: Path, shared: Dict[str, Any], rank_state: Dict[str, Any], strict: bool) -> None:
    """Model, optimizer, loss scaler, accumulation window: from the shards with ZeRO 2/3, else from ``shared``."""
    engine_state = shared.get("engine")
    if not isinstance(engine_state, dict):
        raise CheckpointError(f"checkpoint {path} holds no trainer state (no 'engine' entry; top-level keys "
                              f"{sorted(map(str, shared))}); a weights-only file loads with finetune=True or "
                              f"colossal_lite.utils.load_checkpoint")
    # before anything is loaded: torch would load another optimizer class's state and fail in its own code
    check_optimizer_state(engine.optimizer, engine_state.get("optimizer") or {}, engine_state.get("optimizer_class"))
    engine_state = _with_window_grads(engine_state, path, shared, rank_state)
    if has_sharded_state(path) and "model" not in engine_state:
        if not engine.shards_state:
            raise CheckpointError(f"checkpoint {path} holds model and optimizer as zero stage 2/3 shards; resume it "
                                  f"with zero stage 2/3, or write one file first: colossal-lite ckpt merge {path} "
                                  f"merged.pt")
        state = engine.sharded_state_dict()
        # A parameter had no optimizer state when the checkpoint was saved (none had before the first applied
        # update; one unused in the forward never has). This run's template has state for every parameter (torch
        # makes it for an optimizer without any, stepping it at learning rate 0), which the checkpoint cannot fill:
        # those entries are not loaded, and loading the rest leaves them without state, as the saved optimizer was.
        with_state = set()  # every dotted prefix of the saved keys' remainders: a parameter's name is one of them
        for key in optimizer_state_keys(path):
            parts = key[len("optimizer.state."):].split(".")
            with_state.update(".".join(parts[:i]) for i in range(1, len(parts)))
        state["optimizer"]["state"] = {name: entries for name, entries in state["optimizer"]["state"].items()
                                       if name in with_state}
        load_sharded(path, state)
        engine.load_sharded_state_dict(state)
    elif "optimizer" in engine_state:  # whole tensors, by name (merged from shards) or by position (unsharded)
        engine_state = dict(engine_state, optimizer=_optimizer_state_for(engine, engine_state["optimizer"]))
    engine.load_state_dict(engine_state, strict=strict)


def _with_window_grads(engine_state: Dict[str, Any], path: Path, shared: Dict[str, Any],
                       rank_state: Dict[str, Any]) -> Dict[str, Any]:
    """The engine's state with the gradients of the accumulation window open at the save, this rank's own.

    Each rank gathered them alone (they are reduced at the window's end), so each rank's file holds its own
    (``rank_state`` is {} when the checkpoint was written by another number of ranks: refused, as no rank's
    gradients would be right). Checked before anything is loaded, on every rank alike."""
    saved_world = (shared.get("colossal_lite") or {}).get("world_size")
    if engine_state.get(WINDOW_GRADS_IN_RANK_STATE):
        grads = (rank_state.get("engine") or {}).get("window_grads")
        if grads is None:
            raise CheckpointError(f"checkpoint {path} was taken inside an accumulation window by {saved_world} "
                                  f"rank(s), each holding the gradients it gathered alone; resume it with "
                                  f"{saved_world} rank(s) (this run has {world_size()}), or from a checkpoint taken "
                                  f"at a window's end")
        engine_state = {k: v for k, v in engine_state.items() if k != WINDOW_GRADS_IN_RANK_STATE}
        return dict(engine_state, window_grads=grads)
    if engine_state.get("window_grads") is not None and (saved_world or 1) > 1:
        # written before the gradients went to each rank's file: shared.pt holds rank 0's alone
        warnings.warn(f"checkpoint {path} was taken inside an accumulation window on {saved_world} ranks by an "
                      f"older colossal_lite, which kept only rank 0's gathered gradients: every rank resumes the "
                      f"window with them, so this run will not match one that never stopped", stacklevel=4)
    return engine_state


def _optimizer_state_for(engine, optimizer_state):
    """The checkpoint's full optimizer state in the layout this engine's optimizer loads: by parameter name
    over sharded parameters (ZeRO 2/3), by position otherwise (torch's own layout, ZeroRedundancyOptimizer's)."""
    if not engine.shards_state:
        return optimizer_state_by_position(optimizer_state)
    if keyed_by_name(optimizer_state):
        return optimizer_state
    return optimizer_state_by_name(optimizer_state, parameter_names(engine.unwrapped_model, engine.optimizer))
