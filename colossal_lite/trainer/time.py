"""``colossal_lite.trainer.time``: the time strings of intervals (``'2ep'``, ``'500ba'``, ``'0.25dur'``).

They live in ``colossal_lite.core.time`` so that the LR schedulers, which the trainer's hooks import, can read
milestones written as time strings without importing the trainer."""
from ..core.time import AtSteps, Interval, Time, TimeUnit

__all__ = ["TimeUnit", "Time", "Interval", "AtSteps"]
