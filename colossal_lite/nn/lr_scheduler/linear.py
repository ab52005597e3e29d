"""Linear warm-up followed by linear decay to 0 (optimizer steps)."""
from __future__ import annotations

from typing import Any, List

from torch.optim.lr_scheduler import LRScheduler

from ._base import (
    ExactResumeMixin,
    check_last_epoch,
    check_total_steps,
    check_warmup_steps,
    unwrap_optimizer,
    warn_unused,
)


class LinearWarmupLR(ExactResumeMixin, LRScheduler):
    """``(t + 1) / (warmup_steps + 1) * base_lr`` for the first ``warmup_steps`` optimizer steps, then linear decay
    ``(total_steps - t) / (total_steps - warmup_steps) * base_lr``, reaching 0 at ``total_steps`` (and staying there).
    A warm-up longer than the run keeps the warm-up line for the whole run (with a warning)."""

    def __init__(self, optimizer, total_steps: int, warmup_steps: int = 0, last_epoch: int = -1, **kwargs):
        warn_unused("LinearWarmupLR", kwargs)
        optimizer = unwrap_optimizer(optimizer)
        self.total_steps = check_total_steps(total_steps)
        self.warmup_steps = check_warmup_steps(warmup_steps, self.total_steps, "LinearWarmupLR")
        super().__init__(optimizer, check_last_epoch(last_epoch))

    def get_lr(self) -> List[Any]:
        return self._get_closed_form_lr()

    def _get_closed_form_lr(self) -> List[Any]:
        t, warmup, total = self.last_epoch, self.warmup_steps, self.total_steps
        if t < warmup:  # also past total_steps when the warm-up is the longer (legacy kept the warm-up line)
            factor = (t + 1) / (warmup + 1)
        elif t >= total:
            factor = 0.0
        else:
            factor = (total - t) / (total - warmup)
        return [factor * base_lr for base_lr in self.base_lrs]
