"""Checkpoints that resume exactly, survive crashes and refuse tampered files.

``CheckpointManager`` writes one folder per checkpoint atomically (every rank takes part) and keeps
``last``/``best`` pointers and a retention policy; ``capture_rng_state``/``restore_rng_state`` carry
the random state; ``checkpoint_info`` summarises a checkpoint; ``load_weights`` reads the weights to deploy
(the model's, or an ``EMAHook``'s average). See ``docs/checkpoints.md``.
"""
from .io import (
    CheckpointDamagedError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    UnsafeCheckpointError,
    UnsupportedValueError,
    atomic_save,
    load_file,
    to_plain,
)
from .manager import (
    CheckpointManager,
    checkpoint_info,
    checkpoint_name,
    model_state_from,
    read_checkpoint,
    remove_leftovers,
)
from .rng import capture_rng_state, restore_rng_state
from .weights import load_weights

__all__ = [
    "CheckpointManager", "checkpoint_info", "checkpoint_name", "model_state_from", "read_checkpoint",
    "load_weights", "remove_leftovers", "capture_rng_state", "restore_rng_state", "atomic_save", "load_file", "to_plain",
    "CheckpointError", "CheckpointDamagedError", "CheckpointNotFoundError", "CheckpointWriteError", "UnsafeCheckpointError",
    "UnsupportedValueError",
]
