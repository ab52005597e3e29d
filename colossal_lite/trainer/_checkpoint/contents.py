"""What a trainer checkpoint holds, gathered through the state protocol, and writing it with a ``CheckpointManager``.

The layout (format 1) is drawn in ``colossal_lite.trainer.checkpointing``'s docstring and ``docs/checkpoints.md``.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from ..._version import __version__
from ...checkpoint import CheckpointManager, capture_rng_state, checkpoint_name
from ...core.dist import world_size

__all__ = ["TRAINER_FORMAT", "WINDOW_GRADS_IN_RANK_STATE", "HOOK_ENTRIES", "position", "name_epoch",
           "checkpoint_metrics", "hook_entry", "saved_hook_states", "trainer_checkpoint_state", "save_trainer_checkpoint"]

TRAINER_FORMAT = 1
#: Set in the ``engine`` entry of a checkpoint taken inside an accumulation window: each rank's gathered gradients
#: are in its own ``rank_state["engine"]["window_grads"]``.
WINDOW_GRADS_IN_RANK_STATE = "window_grads_in_rank_state"
#: Where a hook's ``state_dict()`` may be kept (``BaseHook.checkpoint_entry``).
HOOK_ENTRIES = ("trainer", "lr_schedulers")


def position(trainer) -> Tuple[int, int, int, int]:
    """``(epoch, step, iteration, batch_idx)``: where the run stands (two saves at one position are one)."""
    st = trainer.state
    return st.epoch, st.step, st.iteration, st.batch_idx


def name_epoch(trainer) -> int:
    """The epoch a checkpoint is named after: the one its last optimizer step belongs to."""
    st = trainer.state
    if st.batch_idx == 0 and st.epoch > 0 and st.step > 0:
        return st.epoch - 1  # taken after the epoch's end: named after the finished epoch
    return st.epoch


def _loader_state(loader) -> Optional[Dict[str, Any]]:
    fn = getattr(loader, "state_dict", None)
    if not callable(fn):
        return None
    try:
        return fn()
    except TypeError:  # e.g. a ResumableDataLoader over a sampler that cannot resume
        return None


def _metric_value(metric) -> Optional[float]:
    try:
        return float(metric.get_accumulated_value())
    except Exception:  # noqa: BLE001 - a metric that cannot be read is left out (same on every rank)
        return None


def checkpoint_metrics(trainer, watch: Optional[str] = None) -> Dict[str, Optional[float]]:
    """The metric values a checkpoint records (``'train/Loss'``, ``'test/Accuracy'`` ...). Every rank calls it.

    Train metrics are recorded when they cover a whole epoch (at an epoch's end), test metrics when
    the evaluation ran at this very step. ``watch`` (a ``save_best`` name) is always a key: a bare
    name is the test metric when ``fit`` evaluates, else the train one; None when not measured here.
    Reading a metric is a collective (an all-reduce), so every rank reads the same ones in the same order.
    """
    st = trainer.state
    metrics = trainer.states.get("metrics", {})
    out: Dict[str, Optional[float]] = {}
    if st.batch_idx == 0 and st.step > 0:
        for name, metric in metrics.get("train", {}).items():
            out[f"train/{name}"] = _metric_value(metric)
    if st.last_eval_step is not None and st.last_eval_step == st.step:
        for name, metric in metrics.get("test", {}).items():
            out[f"test/{name}"] = _metric_value(metric)
    if watch is not None and watch not in out:
        if "/" in watch:
            out[watch] = None
        else:
            phase = "test" if (st.will_test and watch in metrics.get("test", {})) else "train"
            out[watch] = out.get(f"{phase}/{watch}")
    return out


def hook_entry(hook) -> str:
    """The entry of the shared state that keeps ``hook``'s ``state_dict()`` (``BaseHook.checkpoint_entry``)."""
    entry = getattr(hook, "checkpoint_entry", "trainer")
    if entry not in HOOK_ENTRIES:
        raise ValueError(f"{type(hook).__name__}.checkpoint_entry is {entry!r}: use one of {list(HOOK_ENTRIES)}")
    return entry


def saved_hook_states(shared: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """``{entry: {hook key: state}}`` as the shared state of a checkpoint holds them."""
    return {"trainer": dict((shared.get("trainer") or {}).get("hooks") or {}),
            "lr_schedulers": dict(shared.get("lr_schedulers") or {})}


def _shared_hook_states(trainer, hooks: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """The hooks' states (``{key: state}``) by the checkpoint entry each hook names."""
    shared: Dict[str, Dict[str, Any]] = {entry: {} for entry in HOOK_ENTRIES}
    for key, hook in trainer.state_registry.parts("hooks").items():
        if key in hooks:
            shared[hook_entry(hook)][key] = hooks[key]
    return shared


def trainer_checkpoint_state(trainer, train_loader=None) -> Tuple[Dict[str, Any], Dict[str, Any], Optional[dict]]:
    """``(shared_state, rank_state, sharded_state)`` of the run now; hooks add entries via ``on_save_checkpoint``.

    Every rank calls it (the engine's state dict may gather shards).
    """
    parts = trainer.state_registry.state()  # (the per-step values kept on the device join the history first)
    of_rank = trainer.state_registry.state(rank=True)
    hooks = _shared_hook_states(trainer, parts.pop("hooks"))
    rank_state: Dict[str, Any] = {"rng": capture_rng_state(), "data": _loader_state(train_loader),
                                  "metrics": of_rank["metrics"], "epoch": of_rank["epoch"],
                                  "trainer": {"hooks": of_rank["hooks"]}, "hooks": {}}
    engine = trainer.engine
    sharded = engine.sharded_state_dict(as_it_is=True) if engine.shards_state else None
    engine_state = engine.state_dict_without_shards() if sharded is not None else engine.state_dict()
    # Inside an accumulation window each rank holds the gradients it gathered alone (micro-batches run under
    # no_sync; they are reduced only at the window's end), so they belong to this rank's file: shared.pt is
    # written by rank 0 alone, and every rank would resume with rank 0's. shared.pt only says where they are.
    window_grads = engine_state.pop("window_grads", None)
    if window_grads is not None:
        engine_state[WINDOW_GRADS_IN_RANK_STATE] = True
        rank_state["engine"] = {"window_grads": window_grads}
    shared: Dict[str, Any] = {
        "engine": engine_state,
        "lr_schedulers": hooks["lr_schedulers"],
        "trainer": dict(parts, hooks=hooks["trainer"]),
        "hooks": {},
        # (the epoch's length in batches per rank: a checkpoint inside an epoch lines up only with it)
        "colossal_lite": {"version": __version__, "world_size": world_size(), "format": TRAINER_FORMAT,
                          "batches_per_epoch": trainer.state.iters_per_epoch},
    }
    checkpoint = dict(shared, rank_state=rank_state)
    trainer.fire("on_save_checkpoint", checkpoint)
    checkpoint.pop("rank_state", None)
    return checkpoint, rank_state, sharded


def save_trainer_checkpoint(trainer, manager: CheckpointManager, train_loader=None,
                            metrics: Optional[Dict[str, Any]] = None, started_at: Optional[float] = None) -> Path:
    """Write the run's checkpoint with ``manager``, named ``epoch{E}-step{S}``; returns its folder. Every rank calls it.

    Take it at a safe point (an optimizer step boundary in a hook's ``after_train_iter``, or what
    ``SaveCheckpointHook`` does); inside an accumulation window the gathered gradients are saved too.
    ``train_loader`` defaults to the one the running ``fit`` trains on. ``started_at``: ``time.perf_counter()``
    when the caller began this save (an asynchronous save counts its blocking time from there; default: now).
    """
    started_at = time.perf_counter() if started_at is None else started_at
    if train_loader is None and trainer.checkpoints is not None:
        train_loader = trainer.checkpoints.train_loader
    shared, rank_state, sharded = trainer_checkpoint_state(trainer, train_loader)
    return manager.save(checkpoint_name(name_epoch(trainer), trainer.state.step), shared, rank_state, metrics or {},
                        sharded_state=sharded, started_at=started_at)
