"""What the Engine does about a non-finite (nan or inf) training loss: config key ``nonfinite_loss``.

One class per choice, always called by the Engine (``watch`` in ``backward``, ``allows_step`` in ``step``):

- ``RaiseOnNonFinite`` ('raise', the default): flags the loss on the device, with no host read in the step,
  and ``check()`` raises ``NonFiniteLossError`` naming the first step, where the Trainer reads metrics anyway
  (an epoch's end, a checkpoint, the end of ``fit``). One inf loss turns every parameter into NaN, so the
  run is stopped there rather than left to train on NaN.
- ``SkipNonFinite`` ('skip'): an update whose accumulation window had a non-finite loss on any rank is
  skipped, as torch's GradScaler does for fp16; it reads one flag per update (and all-reduces it).
- ``IgnoreNonFinite`` ('ignore', and the fp16 modes, whose loss scaler already skips such updates): nothing.

Each keeps its device flags across ranks' steps; every rank must call ``check``/``allows_step`` together
(they all-reduce when the world has more than one rank).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["NonFiniteLossError", "IgnoreNonFinite", "RaiseOnNonFinite", "SkipNonFinite", "build_loss_guard",
           "NONFINITE_LOSS_CHOICES"]

NONFINITE_LOSS_CHOICES = ("raise", "skip", "ignore")


class NonFiniteLossError(FloatingPointError):
    """The training loss was nan or inf (config ``nonfinite_loss='raise'``)."""


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class IgnoreNonFinite:
    """The do-nothing guard: every update goes ahead and nothing is checked."""

    def watch(self, loss: torch.Tensor) -> None:
        pass

    def end_window(self) -> None:
        pass

    def allows_step(self) -> bool:
        return True

    def start_counting_at(self, num_updates: int) -> None:
        pass

    def check(self) -> None:
        pass


def _added(total: Optional[torch.Tensor], loss: torch.Tensor) -> torch.Tensor:
    """``total + loss`` (a running float32 sum on the loss's device), in place after the first call.

    A sum is non-finite once any of its terms is (inf + x = inf, inf - inf = nan), so one in-place add per
    micro-step is all the watching costs; ``.data`` keeps autograd out of it."""
    value = loss.data if not loss.ndim else loss.data.sum()
    if total is None:
        return value.to(torch.float32, copy=True)
    return total.add_(value)


class RaiseOnNonFinite(IgnoreNonFinite):
    """Flags non-finite losses on the device; ``check`` raises naming the first optimizer step that had one.

    Per micro-step one small in-place add (the running sum of the losses), per update two (count the updates
    whose sum is still finite): no host read until ``check``.
    """

    def __init__(self):
        self._loss_sum: Optional[torch.Tensor] = None  # every loss watched so far, summed (finite while they all are)
        self._good_updates: Optional[torch.Tensor] = None  # int64: updates before the first non-finite loss
        self._first_update = 0  # engine.num_updates when the watch began (the count above starts there)

    def watch(self, loss: torch.Tensor) -> None:
        self._loss_sum = _added(self._loss_sum, loss)

    def end_window(self) -> None:
        if self._loss_sum is not None:
            if self._good_updates is None:
                self._good_updates = torch.zeros((), dtype=torch.int64, device=self._loss_sum.device)
            self._good_updates.add_(self._loss_sum.isfinite())

    def start_counting_at(self, num_updates: int) -> None:
        """The engine's update count now (set at build and after a checkpoint is loaded): steps are named from it."""
        self._first_update = num_updates
        self._loss_sum = self._good_updates = None

    def check(self) -> None:
        """Raise ``NonFiniteLossError`` if any rank saw a non-finite loss (reads the device; a collective)."""
        world = _world()
        if self._loss_sum is None and world == 1:
            return
        if self._loss_sum is None:
            flags = torch.tensor([1, 2**62], dtype=torch.int64)
        else:
            finite = self._loss_sum.isfinite()
            good = self._good_updates if self._good_updates is not None else torch.zeros_like(finite, dtype=torch.int64)
            flags = torch.stack([finite.to(torch.int64), torch.where(finite, 2**62, good)])
        if world > 1:
            flags = flags.to(_collective_device())
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        all_finite, good = flags.tolist()
        if all_finite:
            return
        step = self._first_update + good + 1
        raise NonFiniteLossError(
            f"the training loss was not finite (nan or inf) in optimizer step {step} (the update that made the step "
            f"count {step}); from that update on the parameters are likely nan. Check the data and the loss for "
            f"nan/inf, lower the learning rate or set clip_grad_norm; or set nonfinite_loss = 'skip' in the config to "
            f"skip such updates (nonfinite_loss = 'ignore' trains on regardless)")


class SkipNonFinite(IgnoreNonFinite):
    """Skips an update whose window had a non-finite loss on any rank (one host read per update)."""

    def __init__(self):
        self._window_sum: Optional[torch.Tensor] = None  # the window's losses, summed
        self.skipped = 0  # updates skipped so far

    def watch(self, loss: torch.Tensor) -> None:
        self._window_sum = _added(self._window_sum, loss)

    def end_window(self) -> None:
        self._window_sum = None

    def allows_step(self) -> bool:
        total = self._window_sum
        ok = torch.ones((), dtype=torch.int64) if total is None else total.isfinite().to(torch.int64)
        if _world() > 1:
            ok = ok.to(_collective_device())
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if bool(ok):  # the one host read per update that 'skip' costs
            return True
        self.skipped += 1
        return False


def _collective_device() -> torch.device:
    """Where the default process group's collectives take tensors (the GPU for nccl)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_loss_guard(choice: str, precision) -> IgnoreNonFinite:
    """The guard for config value ``choice``; fp16 loss-scaling precisions skip such updates themselves."""
    if choice not in NONFINITE_LOSS_CHOICES:
        raise ValueError(f"nonfinite_loss must be one of {NONFINITE_LOSS_CHOICES}, got {choice!r}")
    if choice == "ignore" or getattr(precision, "skips_nonfinite_steps", False):
        return IgnoreNonFinite()
    return RaiseOnNonFinite() if choice == "raise" else SkipNonFinite()
