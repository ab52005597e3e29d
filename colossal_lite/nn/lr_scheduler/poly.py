"""Polynomial decay to ``end_lr``, with and without warm-up (optimizer steps)."""
from __future__ import annotations

from typing import Any, List

from torch.optim.lr_scheduler import LRScheduler

from ._base import (
    ExactResumeMixin,
    WarmupScheduler,
    check_last_epoch,
    check_number,
    check_total_steps,
    check_warmup_steps,
    require_initial_lr,
    unwrap_optimizer,
    warn_unused,
)


class PolynomialLR(ExactResumeMixin, LRScheduler):
    """``(base_lr - end_lr) * (1 - min(t, total_steps) / total_steps) ** power + end_lr`` at optimizer step ``t``."""

    def __init__(self, optimizer, total_steps: int, end_lr: float = 0.0001, power: float = 1.0,
                 last_epoch: int = -1, **kwargs):
        warn_unused("PolynomialLR", kwargs)
        optimizer = unwrap_optimizer(optimizer)
        self.total_steps = check_total_steps(total_steps)
        self.end_lr = check_number("end_lr", end_lr, minimum=0)
        self.power = check_number("power", power, minimum=0)
        super().__init__(optimizer, check_last_epoch(last_epoch))

    def get_lr(self) -> List[Any]:
        return self._get_closed_form_lr()

    def _get_closed_form_lr(self) -> List[Any]:
        factor = (1 - min(self.last_epoch, self.total_steps) / self.total_steps) ** self.power
        return [(base_lr - self.end_lr) * factor + self.end_lr for base_lr in self.base_lrs]


class PolynomialWarmupLR(WarmupScheduler):
    """Warm up for ``warmup_steps`` optimizer steps, then polynomial decay to ``end_lr`` over the remaining
    ``total_steps - warmup_steps`` steps."""

    def __init__(self, optimizer, total_steps: int, warmup_steps: int = 0, end_lr: float = 0.0001,
                 power: float = 1.0, last_epoch: int = -1, **kwargs):
        warn_unused("PolynomialWarmupLR", kwargs)
        optimizer = unwrap_optimizer(optimizer)
        total_steps = check_total_steps(total_steps)
        warmup_steps = check_warmup_steps(warmup_steps, total_steps, "PolynomialWarmupLR")
        require_initial_lr(optimizer, check_last_epoch(last_epoch))
        decay = PolynomialLR(optimizer, max(total_steps - warmup_steps, 1), end_lr=end_lr, power=power)
        self.total_steps = total_steps
        super().__init__(optimizer, warmup_steps, decay, last_epoch)
