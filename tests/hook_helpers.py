"""Hooks that tests share: act once, at a chosen optimizer step."""
import os
import signal

from colossal_lite.trainer.hooks import BaseHook


class AtStep(BaseHook):
    """Calls ``action()`` after optimizer step ``step`` (last among the hooks of the iteration by default)."""

    def __init__(self, step, action, priority=100):
        super().__init__(priority=priority)
        self.step, self.action = step, action

    def after_train_iter(self, trainer, *args):
        if trainer.state.stepped and trainer.state.step == self.step:
            self.action()


def _crash():
    raise RuntimeError("simulated crash")


def crash_at(step):
    """A hook that raises ``RuntimeError('simulated crash')`` after optimizer step ``step``."""
    return AtStep(step, _crash)


def sigterm_at(step):
    """A hook that sends this process SIGTERM after optimizer step ``step`` (first among the hooks)."""
    return AtStep(step, lambda: os.kill(os.getpid(), signal.SIGTERM), priority=0)
