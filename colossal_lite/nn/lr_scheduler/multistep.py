"""Step decay at milestones, with and without warm-up (optimizer steps)."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

from torch.optim import lr_scheduler as _torch_sched

from ...core.time import Time, TimeUnit
from ._base import (
    ExactResumeMixin,
    WarmupScheduler,
    check_int,
    check_last_epoch,
    check_number,
    check_total_steps,
    check_warmup_steps,
    require_initial_lr,
    unwrap_optimizer,
    warn_unused,
)

Milestone = Union[int, str, Time]


def _resolve_milestone(m, total_steps, steps_per_epoch: Optional[int]) -> int:
    """A time string (or ``Time``) as optimizer steps: ``'0.3dur'`` of ``total_steps``, ``'500ba'`` as is, ``'2ep'``
    only with ``steps_per_epoch`` (a scheduler is built before the loader it runs over is known)."""
    try:
        time = Time.from_input(m, default_unit=TimeUnit.BATCH)
    except ValueError as err:
        raise ValueError(f"milestones entry {m!r}: {err}") from None
    if time.unit is TimeUnit.EPOCH and steps_per_epoch is None:
        raise ValueError(f"milestones entry {m!r} counts epochs, but the scheduler counts optimizer steps and does not "
                         f"know how many make an epoch: give steps_per_epoch=..., or write the milestone in 'ba' "
                         f"(optimizer steps) or 'dur' (a fraction of total_steps)")
    total = check_total_steps(total_steps) if time.unit is TimeUnit.DURATION else 0
    spe = check_int("steps_per_epoch", steps_per_epoch, 1) if time.unit is TimeUnit.EPOCH else 0
    steps = time.to_steps(spe, total)
    # a fraction of the run lands after its first update at the earliest, as the Trainer's 'dur' intervals do
    return max(steps, 1) if time.unit is TimeUnit.DURATION else steps


def time_string_milestones(milestones) -> List[str]:
    """The milestones given as time strings (or ``Time``), as written: they were resolved to optimizer steps, so a
    scheduler stepped once per epoch would read them as epochs (``LRSchedulerHook`` refuses that)."""
    return [str(m) for m in (milestones or ()) if isinstance(m, (str, Time))]


def _check_milestones(milestones, total_steps=None,
                      steps_per_epoch: Optional[int] = None) -> Tuple[List[int], List[str]]:
    """The milestones as optimizer steps (ints as given, time strings resolved against the run's length), and the
    time strings as written (``time_string_milestones``)."""
    if milestones is None:
        return [], []
    if isinstance(milestones, (str, bytes)) or not hasattr(milestones, "__iter__"):
        raise TypeError(f"milestones must be a list of integers (optimizer steps) or time strings "
                        f"('0.3dur', '500ba'), got {milestones!r}")
    steps = [_resolve_milestone(m, total_steps, steps_per_epoch) if isinstance(m, (str, Time))
             else check_int("milestones entry", m, 0) for m in milestones]
    return steps, time_string_milestones(milestones)


class MultiStepLR(ExactResumeMixin, _torch_sched.MultiStepLR):
    """torch's MultiStepLR: multiply the LR by ``gamma`` at each optimizer step listed in ``milestones``
    (``None``/empty: constant LR). A milestone is an int (optimizer steps) or a time string: ``'0.3dur'``
    (that fraction of ``total_steps``, rounded), ``'500ba'`` (optimizer steps), ``'2ep'`` (needs
    ``steps_per_epoch``, the optimizer steps of one epoch). ``milestones`` then holds the resolved steps."""

    def __init__(self, optimizer, total_steps: int, milestones: Optional[Sequence[Milestone]] = None,
                 gamma: float = 0.1, last_epoch: int = -1, steps_per_epoch: Optional[int] = None, **kwargs):
        warn_unused("MultiStepLR", kwargs)
        optimizer = unwrap_optimizer(optimizer)
        milestones, written = _check_milestones(milestones, total_steps, steps_per_epoch)
        gamma = check_number("gamma", gamma, minimum=0)
        super().__init__(optimizer, milestones=milestones, gamma=gamma, last_epoch=check_last_epoch(last_epoch))
        self.total_steps = total_steps
        self.milestones_in_steps = written  # (time strings, now optimizer steps in ``milestones``)


class MultiStepWarmupLR(WarmupScheduler):
    """Warm up for ``warmup_steps`` optimizer steps, then multiply by ``gamma`` at each milestone (counted from step 0
    of the whole run; milestones before ``warmup_steps`` are dropped; time strings as in ``MultiStepLR``)."""

    def __init__(self, optimizer, total_steps: int, warmup_steps: int = 0,
                 milestones: Optional[Sequence[Milestone]] = None, gamma: float = 0.1, last_epoch: int = -1,
                 steps_per_epoch: Optional[int] = None, **kwargs):
        warn_unused("MultiStepWarmupLR", kwargs)
        optimizer = unwrap_optimizer(optimizer)
        total_steps = check_total_steps(total_steps)
        warmup_steps = check_warmup_steps(warmup_steps, total_steps, "MultiStepWarmupLR")
        milestones, written = _check_milestones(milestones, total_steps, steps_per_epoch)
        if not milestones:
            raise ValueError("milestones cannot be empty")
        require_initial_lr(optimizer, check_last_epoch(last_epoch))
        shifted = [m - warmup_steps for m in milestones if m >= warmup_steps]
        after = MultiStepLR(optimizer, max(total_steps - warmup_steps, 1), milestones=shifted, gamma=gamma)
        self.total_steps = total_steps
        self.milestones_in_steps = written
        super().__init__(optimizer, warmup_steps, after, last_epoch)
