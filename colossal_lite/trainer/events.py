"""The events of a training run; each is a method name on ``BaseHook``.

The legacy lifecycle methods (``before_train_iter``, ``after_train_epoch`` ...) are events like the
finer ones inside a training iteration (``after_batch_loaded``, ``after_loss`` ...); one mechanism
calls them all. ``docs/trainer.md`` lists the state fields each event may change.
"""
from __future__ import annotations

from enum import Enum

__all__ = ["Event", "LEGACY_EVENTS", "ITERATION_EVENTS", "ENGINE_EVENTS", "CHECKPOINT_EVENTS"]


class Event(str, Enum):
    """An event; its value is the name of the ``BaseHook`` method that handles it."""

    AFTER_HOOK_IS_ATTACHED = "after_hook_is_attached"
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


LEGACY_EVENTS = (
    Event.AFTER_HOOK_IS_ATTACHED, Event.BEFORE_TRAIN, Event.AFTER_TRAIN, Event.BEFORE_TRAIN_EPOCH,
    Event.AFTER_TRAIN_EPOCH, Event.BEFORE_TRAIN_ITER, Event.AFTER_TRAIN_ITER, Event.BEFORE_TEST, Event.AFTER_TEST,
    Event.BEFORE_TEST_EPOCH, Event.AFTER_TEST_EPOCH, Event.BEFORE_TEST_ITER, Event.AFTER_TEST_ITER,
)
ITERATION_EVENTS = (
    Event.BEFORE_ZERO_GRAD, Event.AFTER_BATCH_LOADED, Event.BEFORE_FORWARD, Event.AFTER_FORWARD, Event.AFTER_LOSS,
    Event.BEFORE_BACKWARD, Event.AFTER_BACKWARD, Event.AFTER_GRAD_NORM, Event.BEFORE_OPTIMIZER_STEP,
    Event.AFTER_OPTIMIZER_STEP,
)
# the events around the update at a window's end, fired by the training step between the engine's calls
ENGINE_EVENTS = (Event.AFTER_GRAD_NORM, Event.BEFORE_OPTIMIZER_STEP, Event.AFTER_OPTIMIZER_STEP)
CHECKPOINT_EVENTS = (Event.ON_SAVE_CHECKPOINT, Event.ON_LOAD_CHECKPOINT)
