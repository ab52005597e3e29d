"""The legacy ``colossalai.trainer``: ``Trainer`` and its hooks, plus the ``State`` and ``Event`` they share."""
from . import hooks, time
from ._trainer import TestModeFailed, TestModeResult, Trainer
from ._user_step import UserStep
from .events import Event
from .state import State

__all__ = ["Trainer", "State", "Event", "TestModeResult", "TestModeFailed", "UserStep", "hooks", "time"]
