"""Shared pieces of the LR schedulers: argument checks, optimizer unwrapping and the two-stage base.

Every scheduler here counts in optimizer steps: ``scheduler.step()`` is called once after each
``optimizer.step()``, and ``last_epoch`` is the index of the current step.
"""
from __future__ import annotations

import numbers
import warnings
from typing import Any, Dict, List, Optional, Sequence

from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

_WRAPPER_ATTRS = ("optim", "optimizer", "_optim", "_optimizer")
_STEP_ORDER_WARNINGS = (r"Detected call of `lr_scheduler\.step\(\)` before", r"Seems like `optimizer\.step\(\)` has been")


def unwrap_optimizer(optimizer: Any) -> Optimizer:
    """The torch ``Optimizer`` behind ``optimizer``: the innermost one (found via ``optim``/``optimizer``/``_optim``/
    ``_optimizer``) whose ``param_groups`` is the very same list, else ``optimizer`` itself."""
    groups = _safe_getattr(optimizer, "param_groups")
    if groups is None:
        raise TypeError(f"optimizer must be a torch.optim.Optimizer (or a wrapper of one exposing its param_groups), "
                        f"got {type(optimizer).__name__}")
    found = optimizer if isinstance(optimizer, Optimizer) else None
    current, seen = optimizer, {id(optimizer)}
    while True:
        inner = None
        for name in _WRAPPER_ATTRS:
            candidate = _safe_getattr(current, name)
            if (candidate is not None and id(candidate) not in seen
                    and _safe_getattr(candidate, "param_groups") is groups):
                inner = candidate
                break
        if inner is None:
            break
        seen.add(id(inner))
        current = inner
        if isinstance(inner, Optimizer):
            found = inner
    if found is None:
        raise TypeError(f"optimizer must be a torch.optim.Optimizer (or a wrapper of one exposing its param_groups), "
                        f"got {type(optimizer).__name__} which wraps no torch optimizer with the same param_groups")
    return found


def _safe_getattr(obj: Any, name: str) -> Any:
    try:
        return getattr(obj, name, None)
    except Exception:  # a property of a half-built wrapper may raise anything
        return None


def check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int >= ``minimum``; ``TypeError``/``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_total_steps(total_steps: Any) -> int:
    """``total_steps`` (optimizer steps) as a positive int."""
    if isinstance(total_steps, bool) or not isinstance(total_steps, numbers.Integral):
        raise TypeError(f"total_steps must be a positive integer (optimizer steps), got {total_steps!r}")
    if total_steps <= 0:
        raise ValueError(f"total_steps must be a positive integer (optimizer steps), got {total_steps}")
    return int(total_steps)


def check_warmup_steps(warmup_steps: Any, total_steps: int, owner: str) -> int:
    """``warmup_steps`` (optimizer steps) as an int >= 0.

    A warm-up longer than the run is allowed, as legacy Colossal-AI allowed it (short test runs of a long
    config do this): the LR then follows the warm-up line for the whole run and never reaches the base LR.
    That is rarely meant in a real run, so it is said once, here, with both numbers."""
    warmup_steps = check_int("warmup_steps", warmup_steps, 0)
    if warmup_steps > total_steps:
        warnings.warn(f"{owner}: warmup_steps ({warmup_steps}) is longer than total_steps ({total_steps}), so the "
                      f"learning rate follows the warm-up line for the whole run and does not reach the base LR; "
                      f"shorten warmup_steps if that is not meant", UserWarning, stacklevel=3)
    return warmup_steps


def check_number(name: str, value: Any, minimum: Optional[float] = None, maximum: Optional[float] = None,
                 max_inclusive: bool = True) -> float:
    """``value`` as a real number within the bounds; ``TypeError``/``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and (value > maximum or (not max_inclusive and value == maximum)):
        bound = "<=" if max_inclusive else "<"
        raise ValueError(f"{name} must be {bound} {maximum}, got {value}")
    return value


def warn_unused(owner: str, kwargs: Dict[str, Any]) -> None:
    """Legacy signatures take ``**kwargs`` (configs passed extra keys); one that nothing reads is most likely a
    misspelt or misplaced argument (``CosineAnnealingLR(..., warmup_steps=5)`` warms nothing up), so say so."""
    if kwargs:
        warnings.warn(f"{owner} ignores the keyword argument(s) {', '.join(sorted(kwargs))}: check their spelling "
                      f"and that this scheduler takes them (e.g. warmup_steps belongs to the *WarmupLR classes)",
                      UserWarning, stacklevel=3)


def check_last_epoch(last_epoch: Any) -> int:
    return check_int("last_epoch", last_epoch, -1)


def require_initial_lr(optimizer: Optimizer, last_epoch: int) -> None:
    """Resuming with ``last_epoch >= 0`` needs ``initial_lr`` in every param group (as in torch)."""
    if last_epoch == -1:
        return
    for i, group in enumerate(optimizer.param_groups):
        if "initial_lr" not in group:
            raise KeyError(f"param 'initial_lr' is not specified in param_groups[{i}] when resuming a scheduler "
                           f"with last_epoch={last_epoch}; load the optimizer state first or use last_epoch=-1")


def apply_lrs(optimizer: Optimizer, lrs: Sequence[Any]) -> None:
    """Write ``lrs`` into the optimizer's param groups (in place for tensor LRs)."""
    for group, lr in zip(optimizer.param_groups, lrs):
        if isinstance(group["lr"], Tensor):
            group["lr"].fill_(lr.item() if isinstance(lr, Tensor) else lr)
        else:
            group["lr"] = lr.clone() if isinstance(lr, Tensor) else lr


class ExactResumeMixin:
    """``load_state_dict`` also writes the restored LRs into the optimizer, so torch's ``group['lr']``-based
    (chainable) formulas resume exactly even before or without loading the optimizer's state."""

    optimizer: Optimizer

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # type: ignore[misc]
        last = getattr(self, "_last_lr", None)
        if last is not None:
            apply_lrs(self.optimizer, last)


class _TwoStageScheduler(ExactResumeMixin, LRScheduler):
    """Warm-up for ``warmup_epochs`` optimizer steps, base LR for ``delay_epochs`` steps, then ``after_scheduler``
    (restarted from ``base_lrs`` as its step 0; its state is saved inside this scheduler's ``state_dict``)."""

    def __init__(self, optimizer, warmup_epochs: int, delay_epochs: int, after_scheduler: LRScheduler,
                 last_epoch: int = -1):
        optimizer = unwrap_optimizer(optimizer)
        last_epoch = check_last_epoch(last_epoch)
        if not isinstance(after_scheduler, LRScheduler):
            raise TypeError(f"after_scheduler must be a torch.optim.lr_scheduler.LRScheduler, "
                            f"got {type(after_scheduler).__name__}")
        if _safe_getattr(after_scheduler.optimizer, "param_groups") is not optimizer.param_groups:
            raise ValueError("after_scheduler must be built on the same optimizer as this scheduler")
        self.warmup_epochs = warmup_epochs
        self.delay_epochs = delay_epochs
        self.after_scheduler = after_scheduler
        self.finished = False  # True once after_scheduler drives the LR
        super().__init__(optimizer, last_epoch)

    def _before_switch_lr(self, step: int) -> List[Any]:
        if step < self.warmup_epochs:
            return [(step + 1) / self.warmup_epochs * base_lr for base_lr in self.base_lrs]
        return list(self.base_lrs)

    def get_lr(self) -> List[Any]:
        offset = self.last_epoch - self.warmup_epochs - self.delay_epochs
        if offset < 0:
            self.finished = False
            return self._before_switch_lr(self.last_epoch)
        inner = self.after_scheduler
        if not self.finished:
            self._restart_after_scheduler()
            self.finished = True
        elif inner.last_epoch > offset:  # stepped backwards with an explicit epoch
            self._restart_after_scheduler()
        if inner.last_epoch < offset:  # normally one step; more only after an explicit epoch or last_epoch
            with warnings.catch_warnings():
                # torch's step-order checks: this scheduler's own step() already ran them for the user's calls
                for pattern in _STEP_ORDER_WARNINGS:
                    warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
                while inner.last_epoch < offset:
                    inner.step()
        return list(inner.get_last_lr())

    def _restart_after_scheduler(self) -> None:
        """Put ``after_scheduler`` at its step 0, starting from this scheduler's ``base_lrs``."""
        inner = self.after_scheduler
        apply_lrs(self.optimizer, self.base_lrs)
        inner.base_lrs = list(self.base_lrs)
        inner.last_epoch = -1
        inner._initial_step()  # torch's own constructor step: step 0 in "initial" mode

    def state_dict(self) -> Dict[str, Any]:
        """This scheduler's state with the inner scheduler's ``state_dict`` under ``'after_scheduler'``."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "after_scheduler")}
        state["after_scheduler"] = self.after_scheduler.state_dict()
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore this scheduler and its inner scheduler from :meth:`state_dict`; the optimizer LRs follow."""
        state = dict(state_dict)
        inner_state = state.pop("after_scheduler", None)
        if isinstance(inner_state, dict):
            self.after_scheduler.load_state_dict(inner_state)
        else:  # no inner state saved: rebuild it from step 0 at the next step
            state["finished"] = False
        self.__dict__.update(state)
        apply_lrs(self.optimizer, self._last_lr)


class DelayerScheduler(_TwoStageScheduler):
    """Keep the base LR for ``delay_epochs`` optimizer steps, then run ``after_scheduler``."""

    def __init__(self, optimizer, delay_epochs: int, after_scheduler: LRScheduler, last_epoch: int = -1):
        delay_epochs = check_int("delay_epochs", delay_epochs, 0)
        super().__init__(optimizer, 0, delay_epochs, after_scheduler, last_epoch)


class WarmupScheduler(_TwoStageScheduler):
    """Warm up linearly, ``(t + 1) / warmup_epochs * base_lr``, for ``warmup_epochs`` optimizer steps, then run
    ``after_scheduler``."""

    def __init__(self, optimizer, warmup_epochs: int, after_scheduler: LRScheduler, last_epoch: int = -1):
        warmup_epochs = check_int("warmup_epochs", warmup_epochs, 0)
        super().__init__(optimizer, warmup_epochs, 0, after_scheduler, last_epoch)


class WarmupDelayerScheduler(_TwoStageScheduler):
    """Warm up for ``warmup_epochs`` optimizer steps, hold the base LR for ``delay_epochs`` steps, then run
    ``after_scheduler``."""

    def __init__(self, optimizer, warmup_epochs: int, delay_epochs: int, after_scheduler: LRScheduler,
                 last_epoch: int = -1):
        warmup_epochs = check_int("warmup_epochs", warmup_epochs, 0)
        delay_epochs = check_int("delay_epochs", delay_epochs, 0)
        super().__init__(optimizer, warmup_epochs, delay_epochs, after_scheduler, last_epoch)
