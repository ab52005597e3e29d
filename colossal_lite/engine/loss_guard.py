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


class RaiseOnNonFinite(IgnoreNonFinite):
    """Flags non-finite losses on the device; ``check`` raises naming the first optimizer step that had one.

    Per micro-step two small device kernels (is the loss finite; and the running "all finite so far"), per
    update one (count the updates that were all finite): no host read until ``check``.
    """

    def __init__(self):
        self._all_finite: Optional[torch.Tensor] = None  # bool: every loss watched so far was finite
        self._good_updates: Optional[torch.Tensor] = None  # int64: updates before the first non-finite loss
        self._first_update = 0  # engine.num_updates when the watch began (the count above starts there)

    def watch(self, loss: torch.Tensor) -> None:
        finite = torch.isfinite(loss.detach()).all()
        if self._all_finite is None:
            self._all_finite = finite.clone()
            self._good_updates = torch.zeros((), dtype=torch.int64, device=finite.device)
        else:
            self._all_finite.logical_and_(finite)

    def end_window(self) -> None:
        if self._all_finite is not None:
            self._good_updates.add_(self._all_finite)

    def start_counting_at(self, num_updates: int) -> None:
        """The engine's update count now (set at build and after a checkpoint is loaded): steps are named from it."""
        self._first_update = num_updates
        self._all_finite = self._good_updates = None

    def check(self) -> None:
        """Raise ``NonFiniteLossError`` if any rank saw a non-finite loss (reads the device; a collective)."""
        world = _world()
        if self._all_finite is None and world == 1:
            return
        flags = torch.tensor([1, 2**62], dtype=torch.int64) if self._all_finite is None else \
            torch.stack([self._all_finite.to(torch.int64), torch.where(self._all_finite, 2**62, self._good_updates)])
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
        self._window_finite: Optional[torch.Tensor] = None
        self.skipped = 0  # updates skipped so far

    def watch(self, loss: torch.Tensor) -> None:
        finite = torch.isfinite(loss.detach()).all()
        if self._window_finite is None:
            self._window_finite = finite.clone()
        else:
            self._window_finite.logical_and_(finite)

    def end_window(self) -> None:
        self._window_finite = None

    def allows_step(self) -> bool:
        flag = self._window_finite
        ok = torch.ones((), dtype=torch.int64) if flag is None else flag.to(torch.int64)
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
