"""torch's LambdaLR, MultiplicativeLR, StepLR and ExponentialLR with the legacy ``(optimizer, total_steps, ...)``
signature; ``total_steps`` is accepted and unused (optimizer steps)."""
from __future__ import annotations

from torch.optim import lr_scheduler as _torch_sched

from ._base import ExactResumeMixin, check_int, check_last_epoch, check_number, unwrap_optimizer


def _check_lr_lambda(lr_lambda):
    fns = lr_lambda if isinstance(lr_lambda, (list, tuple)) else [lr_lambda]
    if not fns or not all(callable(fn) for fn in fns):
        raise TypeError(f"lr_lambda must be a callable or a list of callables (one per param group), "
                        f"got {lr_lambda!r}")
    return lr_lambda


class LambdaLR(ExactResumeMixin, _torch_sched.LambdaLR):
    """LR = ``base_lr * lr_lambda(t)`` at optimizer step ``t`` (torch's LambdaLR)."""

    def __init__(self, optimizer, total_steps, lr_lambda=None, last_epoch: int = -1):
        optimizer = unwrap_optimizer(optimizer)
        super().__init__(optimizer, _check_lr_lambda(lr_lambda), last_epoch=check_last_epoch(last_epoch))
        self.total_steps = total_steps


class MultiplicativeLR(ExactResumeMixin, _torch_sched.MultiplicativeLR):
    """LR multiplied by ``lr_lambda(t)`` at each optimizer step ``t >= 1`` (torch's MultiplicativeLR)."""

    def __init__(self, optimizer, total_steps, lr_lambda=None, last_epoch: int = -1):
        optimizer = unwrap_optimizer(optimizer)
        super().__init__(optimizer, _check_lr_lambda(lr_lambda), last_epoch=check_last_epoch(last_epoch))
        self.total_steps = total_steps


class StepLR(ExactResumeMixin, _torch_sched.StepLR):
    """LR multiplied by ``gamma`` every ``step_size`` optimizer steps (torch's StepLR)."""

    def __init__(self, optimizer, total_steps, step_size: int = 1, gamma: float = 0.1, last_epoch: int = -1):
        optimizer = unwrap_optimizer(optimizer)
        step_size = check_int("step_size", step_size, 1)
        gamma = check_number("gamma", gamma, minimum=0)
        super().__init__(optimizer, step_size=step_size, gamma=gamma, last_epoch=check_last_epoch(last_epoch))
        self.total_steps = total_steps


class ExponentialLR(ExactResumeMixin, _torch_sched.ExponentialLR):
    """LR multiplied by ``gamma`` at every optimizer step (torch's ExponentialLR)."""

    def __init__(self, optimizer, total_steps, gamma: float = 1.0, last_epoch: int = -1):
        optimizer = unwrap_optimizer(optimizer)
        gamma = check_number("gamma", gamma, minimum=0)
        super().__init__(optimizer, gamma=gamma, last_epoch=check_last_epoch(last_epoch))
        self.total_steps = total_steps
