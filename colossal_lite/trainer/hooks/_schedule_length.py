"""How long an LR schedule is, and the warning for a restored schedule that ends before the resumed run does."""
from __future__ import annotations

import warnings
from typing import Optional

from torch.optim import lr_scheduler

from ...nn.lr_scheduler import LinearWarmupLR, PolynomialLR
from ...nn.lr_scheduler._base import _TwoStageScheduler

__all__ = ["schedule_length", "warn_if_schedule_ends_early"]


def _unwrapped(scheduler):
    """The scheduler inside wrappers such as the engine's (which steps it only after real updates)."""
    while not isinstance(scheduler, lr_scheduler.LRScheduler) and getattr(scheduler, "lr_scheduler", None) is not None:
        scheduler = scheduler.lr_scheduler
    return scheduler


def schedule_length(scheduler) -> Optional[int]:
    """Scheduler steps after which ``scheduler``'s schedule has run its course, or None when it has no end.

    Past its end a cosine climbs back up, a decay stays at its final LR and OneCycleLR refuses to step.
    Step, exponential, multi-step, lambda and warm-up-only (rising ``LinearLR``) schedules have no end.
    """
    scheduler = _unwrapped(scheduler)
    if isinstance(scheduler, _TwoStageScheduler):  # warm-up / delay, then the inner schedule
        inner = schedule_length(scheduler.after_scheduler)
        return None if inner is None else scheduler.warmup_epochs + scheduler.delay_epochs + inner
    if isinstance(scheduler, (LinearWarmupLR, PolynomialLR)):
        return scheduler.total_steps
    if isinstance(scheduler, lr_scheduler.CosineAnnealingLR):
        return scheduler.T_max
    if isinstance(scheduler, lr_scheduler.OneCycleLR):
        return scheduler.total_steps
    if isinstance(scheduler, lr_scheduler.PolynomialLR):
        return scheduler.total_iters
    if isinstance(scheduler, lr_scheduler.LinearLR) and scheduler.end_factor < scheduler.start_factor:
        return scheduler.total_iters
    if isinstance(scheduler, lr_scheduler.SequentialLR):
        last = schedule_length(scheduler._schedulers[-1])
        return None if last is None else scheduler._milestones[-1] + last
    return None


def warn_if_schedule_ends_early(key: str, scheduler, by_epoch: bool, state, path) -> None:
    """Warn when ``scheduler``, just restored from ``path`` (None: stepped by an earlier ``fit`` of this trainer), has
    fewer steps left than the run ``fit`` was asked for (``state``: the trainer's ``State``): it was built for the
    run that wrote the checkpoint, or for that earlier fit."""
    length = schedule_length(scheduler)
    if length is None:
        return
    unit = "epochs" if by_epoch else "optimizer steps"
    run_length = state.max_epochs if by_epoch else state.total_steps
    if run_length is None:  # a train loader without len: the run's length in this unit is unknown
        return
    run_left = run_length - (state.epoch if by_epoch else state.step)
    schedule_left = length - int(getattr(scheduler, "last_epoch", 0))
    if schedule_left >= run_left:
        return
    name = type(_unwrapped(scheduler)).__name__
    whence = (f"the {name} restored from {path} was built for the run that wrote it" if path is not None else
              f"the {name} this trainer's earlier fit stepped was built for that fit")
    warnings.warn(
        f"{key}: {whence}: it is {length} {unit} long and has {max(schedule_left, 0)} left, but this fit runs "
        f"{run_left} more {unit}. Past its end the learning rate no longer follows a schedule (a cosine climbs "
        f"back up, a decay stays at its last value). To extend a finished run, load only the engine state (model "
        f"and optimizer) and build a scheduler for the {unit} still to run: see 'Extending a finished run' in "
        f"docs/checkpoints.md", stacklevel=3)
