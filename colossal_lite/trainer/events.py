"""The events of a training run; each is a method name on ``BaseHook``.

The legacy lifecycle methods (``before_train_iter``, ``after_train_epoch`` ...) are events like the
finer ones inside a training iteration (``after_batch_loaded``, ``after_loss`` ...); one mechanism
calls them all. ``docs/trainer.md`` lists the state fields each event may change.
"""
from __future__ import annotations

from enum import Enum

__all__ = ["Event"]


class Event(str, Enum):
    """An event; its value is the name of the ``BaseHook`` method that handles it."""

    AFTER_HOOK_IS_ATTACHED = "after_hook_is_attached"
    AFTER_HOOK_IS_DETACHED = "after_hook_is_detached"
    BEFORE_TRAIN = "before_train"
    AFTER_TRAIN = "after_train"
    BEFORE_TRAIN_EPOCH = "before_train_epoch"
    AFTER_TRAIN_EPOCH = "after_train_epoch"
    BEFORE_TRAIN_ITER = "before_train_iter"
    AFTER_TRAIN_ITER = "after_train_iter"
    BEFORE_TEST = "before_test"
    AFTER_TEST = "after_test"
    BEFORE_TEST_EPOCH = "before_test_epoch"
    AFTER_TEST_EPOCH = "after_test_epoch"
    BEFORE_TEST_ITER = "before_test_iter"
    AFTER_TEST_ITER = "after_test_iter"

    # inside one training iteration, in this order (see docs/trainer.md)
    BEFORE_ZERO_GRAD = "before_zero_grad"
    AFTER_BATCH_LOADED = "after_batch_loaded"
    BEFORE_FORWARD = "before_forward"
    AFTER_FORWARD = "after_forward"
    AFTER_LOSS = "after_loss"
    BEFORE_BACKWARD = "before_backward"
    AFTER_BACKWARD = "after_backward"
    AFTER_GRAD_NORM = "after_grad_norm"
    BEFORE_OPTIMIZER_STEP = "before_optimizer_step"
    AFTER_OPTIMIZER_STEP = "after_optimizer_step"

    # fired by checkpoint hooks through ``Trainer.fire`` (no built-in hook here fires them)
    ON_SAVE_CHECKPOINT = "on_save_checkpoint"
    ON_LOAD_CHECKPOINT = "on_load_checkpoint"

    def __str__(self) -> str:
        return self.value
