"""Cosine-shaped schedules: plain cosine annealing, with warm-up, and flat-then-cosine (all in optimizer steps)."""
from __future__ import annotations

from torch.optim import lr_scheduler as _torch_sched

from ._base import (
    DelayerScheduler,
    ExactResumeMixin,
    WarmupDelayerScheduler,
    WarmupScheduler,
    check_last_epoch,
    check_number,
    check_total_steps,
    check_warmup_steps,
    require_initial_lr,
    unwrap_optimizer,
    warn_unused,
)


class CosineAnnealingLR(ExactResumeMixin, _torch_sched.CosineAnnealingLR):
    """torch's cosine annealing from the base LR to ``eta_min`` over ``total_steps`` optimizer steps."""

    def __init__(self, optimizer, total_steps: int, eta_min: int = 0, last_epoch: int = -1, **kwargs):
        warn_unused("CosineAnnealingLR", kwargs)
        optimizer = unwrap_optimizer(optimizer)
        total_steps = check_total_steps(total_steps)
        eta_min = check_number("eta_min", eta_min, minimum=0)
        super().__init__(optimizer, T_max=total_steps, eta_min=eta_min, last_epoch=check_last_epoch(last_epoch))
        self.total_steps = total_steps


class CosineAnnealingWarmupLR(WarmupScheduler):
    """Linear warm-up for ``warmup_steps`` optimizer steps, then cosine annealing to ``eta_min`` over the
    remaining ``total_steps - warmup_steps`` steps."""

    def __init__(self, optimizer, total_steps: int, warmup_steps: int = 0, eta_min: float = 0.,
                 last_epoch: int = -1):
        optimizer = unwrap_optimizer(optimizer)
        total_steps = check_total_steps(total_steps)
        warmup_steps = check_warmup_steps(warmup_steps, total_steps, "CosineAnnealingWarmupLR")
        require_initial_lr(optimizer, check_last_epoch(last_epoch))
        anneal = CosineAnnealingLR(optimizer, max(total_steps - warmup_steps, 1), eta_min=eta_min)
        self.total_steps = total_steps
        super().__init__(optimizer, warmup_steps, anneal, last_epoch)


def _check_pct_start(pct_start) -> float:
    return check_number("pct_start", pct_start, minimum=0, maximum=1, max_inclusive=False)


class FlatAnnealingLR(DelayerScheduler):
    """Constant base LR for ``int(total_steps * pct_start)`` optimizer steps, then cosine annealing to 0 over the
    rest of ``total_steps``."""

    def __init__(self, optimizer, total_steps: int, pct_start: float = 0.72, last_epoch: int = -1, **kwargs):
        warn_unused("FlatAnnealingLR", kwargs)
        optimizer = unwrap_optimizer(optimizer)
        total_steps = check_total_steps(total_steps)
        pct_start = _check_pct_start(pct_start)
        require_initial_lr(optimizer, check_last_epoch(last_epoch))
        flat_steps = int(total_steps * pct_start)
        anneal = CosineAnnealingLR(optimizer, total_steps - flat_steps)
        self.total_steps = total_steps
        super().__init__(optimizer, flat_steps, anneal, last_epoch)


class FlatAnnealingWarmupLR(WarmupDelayerScheduler):
    """Warm-up for ``warmup_steps`` optimizer steps, constant for ``int((total_steps - warmup_steps) * pct_start)``
    steps, then cosine annealing to ``eta_min`` over the rest of ``total_steps``."""

    def __init__(self, optimizer, total_steps: int, warmup_steps: int = 0, pct_start: float = 0.72,
                 eta_min: int = 0, last_epoch: int = -1, **kwargs):
        warn_unused("FlatAnnealingWarmupLR", kwargs)
        optimizer = unwrap_optimizer(optimizer)
        total_steps = check_total_steps(total_steps)
        warmup_steps = check_warmup_steps(warmup_steps, total_steps, "FlatAnnealingWarmupLR")
        pct_start = _check_pct_start(pct_start)
        require_initial_lr(optimizer, check_last_epoch(last_epoch))
        flat_steps = int(max(total_steps - warmup_steps, 0) * pct_start)
        anneal = CosineAnnealingLR(optimizer, max(total_steps - warmup_steps - flat_steps, 1), eta_min=eta_min)
        self.total_steps = total_steps
        super().__init__(optimizer, warmup_steps, flat_steps, anneal, last_epoch)
