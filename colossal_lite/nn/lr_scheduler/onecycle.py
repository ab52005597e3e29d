"""One-cycle policy over ``total_steps`` optimizer steps."""
from __future__ import annotations

from torch import Tensor
from torch.optim import lr_scheduler as _torch_sched

from ._base import ExactResumeMixin, check_last_epoch, check_number, check_total_steps, unwrap_optimizer, warn_unused


class OneCycleLR(ExactResumeMixin, _torch_sched.OneCycleLR):
    """torch's OneCycleLR over ``total_steps`` optimizer steps, peaking at each param group's LR at construction."""

    def __init__(self, optimizer, total_steps: int, pct_start=0.3, anneal_strategy='cos', cycle_momentum=True,
                 base_momentum=0.85, max_momentum=0.95, div_factor=25.0, final_div_factor=10000.0, last_epoch=-1,
                 **kwargs):
        warn_unused("OneCycleLR", kwargs)
        optimizer = unwrap_optimizer(optimizer)
        total_steps = check_total_steps(total_steps)
        pct_start = float(check_number("pct_start", pct_start, minimum=0, maximum=1, max_inclusive=False))
        check_number("div_factor", div_factor)
        check_number("final_div_factor", final_div_factor)
        if div_factor <= 0 or final_div_factor <= 0:
            raise ValueError(f"div_factor and final_div_factor must be > 0, got {div_factor} and {final_div_factor}")
        max_lrs = [g["lr"].item() if isinstance(g["lr"], Tensor) else g["lr"] for g in optimizer.param_groups]
        super().__init__(optimizer, max_lr=max_lrs, total_steps=total_steps, pct_start=pct_start,
                         anneal_strategy=anneal_strategy, cycle_momentum=cycle_momentum,
                         base_momentum=base_momentum, max_momentum=max_momentum, div_factor=div_factor,
                         final_div_factor=final_div_factor, last_epoch=check_last_epoch(last_epoch))
