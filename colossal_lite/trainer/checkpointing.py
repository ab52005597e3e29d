"""Trainer checkpoints: what one holds, how ``fit`` saves and restores it, and preemption.

A trainer checkpoint is one ``CheckpointManager`` folder (``docs/checkpoints.md``), format 1::

    shared_state = {"engine": engine.state_dict(),
                    "lr_schedulers": {key: hook.state_dict()},     # hooks with checkpoint_entry 'lr_schedulers'
                    "trainer": {"progress": state.state_dict(),
                                "hooks": {key: hook.state_dict()},  # every other hook with state
                                "history": ..., "trackers": {key: tracker.state_dict()},
                                "objects": {key: obj.state_dict()}},  # register_for_checkpointing
                    "hooks": {...},                                 # what hooks add in on_save_checkpoint
                    "colossal_lite": {"version", "world_size", "format"}}
    rank_state   = {"rng": capture_rng_state(), "data": train_loader.state_dict(),
                    "metrics": {name: metric.partial_state()},     # this rank's train metric sums so far
                    "trainer": {"hooks": {key: hook.rank_state_dict()}},
                    "hooks": {...}}                                 # this rank's on_save_checkpoint entries

The state protocol: every part that has state gives it as a ``state_dict()`` and takes it back with
``load_state_dict()``, and is registered once in the trainer's ``state_registry`` (``_checkpoint.registry``),
which this code walks; it knows no concrete hook. The trainer registers its progress, history and train metric
sums, each hook of a run (under its key: class name and order among hooks of its class), each tracker of a
run, and the user's objects (``register_for_checkpointing``). A hook's state goes to the entry its
``checkpoint_entry`` names; an ``LRSchedulerHook``'s state is its scheduler's, kept in ``lr_schedulers``
(where checkpoints have always kept schedulers, so older checkpoints resume unchanged). State that differs
between ranks is registered per rank and restored only with the number of ranks that wrote it:
``rank_state_dict()`` / ``load_rank_state_dict()`` for hooks, ``TrainMetricSums`` for the train metrics' sums
of a resumed epoch (each metric's ``partial_state`` / ``load_partial_state``); the loader's ``state_dict`` for
the data position and ``capture_rng_state`` / ``restore_rng_state`` are the run's position, read here.
``on_save_checkpoint`` / ``on_load_checkpoint`` remain for entries a hook lays out itself.

``fit`` saves only at *safe points*: after an optimizer step and the evaluation that may follow it,
or after an epoch's end events, its evaluation and the move to the next epoch. Nothing else happens
between a safe point and the next training batch, so a run resumed from there computes exactly
what the uninterrupted run computed. ``CheckpointSession`` is that part of one ``fit`` call:
resume, interval saves at safe points, and preemption (SIGTERM / SIGINT).

The code lives in ``colossal_lite.trainer._checkpoint``, one idea per module; this module keeps the public names.
"""
from ._checkpoint.contents import (
    TRAINER_FORMAT,
    checkpoint_metrics,
    position,
    save_trainer_checkpoint,
    trainer_checkpoint_state,
)
from ._checkpoint.preemption import PREEMPTED_EXIT_CODE, TrainingPreempted
from ._checkpoint.restore import load_trainer_checkpoint, restore_trainer_checkpoint
from ._checkpoint.round_trip import checkpoint_round_trip
from ._checkpoint.session import CheckpointSession
from .hooks._schedule_length import schedule_length

__all__ = ["PREEMPTED_EXIT_CODE", "TrainingPreempted", "save_trainer_checkpoint", "load_trainer_checkpoint",
           "restore_trainer_checkpoint", "checkpoint_metrics", "CheckpointSession", "checkpoint_round_trip",
           "trainer_checkpoint_state", "position", "schedule_length", "TRAINER_FORMAT"]
