"""Step decay at milestones, with and without warm-up (optimizer steps)."""
from __future__ import annotations

from typing import List, Optional

from torch.optim import lr_scheduler as _torch_sched

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


def _check_milestones(milestones) -> List[int]:
    if milestones is None:
        return []
    if isinstance(milestones, (str, bytes)) or not hasattr(milestones, "__iter__"):
        raise TypeError(f"milestones must be a list of integers (optimizer steps), got {milestones!r}")
    return [check_int("milestones entry", m, 0) for m in milestones]


class MultiStepLR(ExactResumeMixin, _torch_sched.MultiStepLR):
    """torch's MultiStepLR: multiply the LR by ``gamma`` at each optimizer step listed in ``milestones``
    (``None``/empty: constant LR)."""

    def __init__(self, optimizer, total_steps: int, milestones: Optional[List[int]] = None, gamma: float = 0.1,
                 last_epoch: int = -1, **kwargs):
        warn_unused("MultiStepLR", kwargs)
        optimizer = unwrap_optimizer(optimizer)
        milestones = _check_milestones(milestones)
        gamma = check_number("gamma", gamma, minimum=0)
        super().__init__(optimizer, milestones=milestones, gamma=gamma, last_epoch=check_last_epoch(last_epoch))
        self.total_steps = total_steps


class MultiStepWarmupLR(WarmupScheduler):
    """Warm up for ``warmup_steps`` optimizer steps, then multiply by ``gamma`` at each milestone (counted from step 0
    of the whole run; milestones before ``warmup_steps`` are dropped)."""

    def __init__(self, optimizer, total_steps: int, warmup_steps: int = 0, milestones: Optional[List[int]] = None,
                 gamma: float = 0.1, last_epoch: int = -1, **kwargs):
        warn_unused("MultiStepWarmupLR", kwargs)
        optimizer = unwrap_optimizer(optimizer)
        total_steps = check_total_steps(total_steps)
        warmup_steps = check_warmup_steps(warmup_steps, total_steps, "MultiStepWarmupLR")
        milestones = _check_milestones(milestones)
        if not milestones:
            raise ValueError("milestones cannot be empty")
        require_initial_lr(optimizer, check_last_epoch(last_epoch))
        shifted = [m - warmup_steps for m in milestones if m >= warmup_steps]
        after = MultiStepLR(optimizer, max(total_steps - warmup_steps, 1), milestones=shifted, gamma=gamma)
        self.total_steps = total_steps
        super().__init__(optimizer, warmup_steps, after, last_epoch)
