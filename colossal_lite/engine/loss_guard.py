"""What the Engine does about a non-finite (nan or inf) training loss: config key ``nonfinite_loss``.

One class per choice, always called by the Engine (``watch`` in ``backward``, ``allows_step`` in ``step``):

- ``RaiseOnNonFinite`` ('raise', the default): records the loss on the device, with no host read in the step,
  and ``check()`` raises ``NonFiniteLossError`` naming the first step, where the Trainer reads metrics anyway
  (an epoch's end, a checkpoint, the end of ``fit``). One inf loss turns every parameter into NaN, so the
  run is stopped there rather than left to train on NaN. ``check_weights`` refuses to save nan/inf weights
  (``save_checkpoint``: a user's own loop may never call ``check``).
- ``SkipNonFinite`` ('skip'): an update whose accumulation window had a non-finite loss on any rank is
  skipped, as torch's GradScaler does for fp16; it reads one flag per update (and all-reduces it).
- ``IgnoreNonFinite`` ('ignore', and the fp16 modes, whose loss scaler already skips such updates): nothing.

Every rank must call ``check``/``allows_step`` together: they all-reduce when the world has more than one rank.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch

from ..core.dist import all_reduce_min_, collective_device, world_size

__all__ = ["NonFiniteLossError", "IgnoreNonFinite", "RaiseOnNonFinite", "SkipNonFinite", "build_loss_guard",
           "NONFINITE_LOSS_CHOICES"]

NONFINITE_LOSS_CHOICES = ("raise", "skip", "ignore")


class NonFiniteLossError(FloatingPointError):
    """The training loss was nan or inf (config ``nonfinite_loss='raise'``)."""


class IgnoreNonFinite:
    """The do-nothing guard: every update goes ahead and nothing is checked."""

    choice = "ignore"  # the config's ``nonfinite_loss`` this guard was built for

    def watch(self, loss: torch.Tensor) -> None:
        pass

    def end_window(self) -> None:
        pass

    def open_window(self) -> None:
        """A window's first micro-batch: what an abandoned window saw is forgotten."""

    def allows_step(self) -> bool:
        return True

    def start_counting_at(self, num_updates: int) -> None:
        pass

    def check(self) -> None:
        pass

    def check_weights(self, state: Dict[str, Any], what: str) -> None:
        """Before ``what`` writes ``state`` (a model's state dict): refuse weights that are not finite."""


def _loss_value(loss: torch.Tensor) -> torch.Tensor:
    """The loss as a 0-dim tensor outside autograd (``.data``: no graph, no dispatched detach)."""
    return loss.data if not loss.ndim else loss.data.sum()


class RaiseOnNonFinite(IgnoreNonFinite):
    """Flags non-finite losses on the device; ``check`` raises naming the first optimizer step that had one.

    Each micro-step adds one small device operator and never reads the device: the running sum of the losses so far (non-finite
    once any loss is) is written into the next slot of a ring on the device, while the host notes which
    optimizer step that micro-step belongs to. ``check`` reads the ring once and finds the first non-finite
    sum. When more than ``ring_size`` micro-steps ran since the last check and the oldest kept sum is already
    non-finite, the step is named as "or earlier".
    """

    def __init__(self, ring_size: int = 1024):
        self.ring_size = int(ring_size)
        self._ring: Optional[torch.Tensor] = None  # float32 [ring_size]: running sums, one per micro-step
        self._slots: tuple = ()  # the ring's slots as 0-dim views (made once, so writing a slot makes no new view)
        self._steps = [0] * self.ring_size  # host: the optimizer step each slot's micro-step belongs to
        self._zero: Optional[torch.Tensor] = None
        self._sum: Optional[torch.Tensor] = None  # the slot (or zero) holding the running sum so far
        self._watched = 0  # micro-steps since the last check
        self._updates = 0  # optimizer steps so far (the engine's count: set by start_counting_at)

    def watch(self, loss: torch.Tensor) -> None:
        value = loss.data if not loss.ndim else loss.data.sum()  # (``_loss_value``, on the default guard's path)
        if self._ring is None:  # on the loss's device, at the first micro-step
            self._allocate(value.device)
        i = self._watched % self.ring_size
        slot = self._slots[i]
        torch.add(self._sum, value, out=slot)
        self._sum = slot
        self._steps[i] = self._updates + 1
        self._watched += 1

    def _allocate(self, device: torch.device) -> None:
        self._ring = torch.zeros(self.ring_size, dtype=torch.float32, device=device)
        self._slots = self._ring.unbind(0)
        self._zero = torch.zeros((), dtype=torch.float32, device=device)
        self._sum, self._watched = self._zero, 0

    def end_window(self) -> None:
        self._updates += 1

    def start_counting_at(self, num_updates: int) -> None:
        """The engine's update count now (set at build and after a checkpoint is loaded): steps are named from it."""
        self._updates = num_updates
        self._sum, self._watched = self._zero, 0

    def _first_bad_step(self):
        """``(step, exact)`` of this rank's first non-finite loss since the last check, or None (reads the ring)."""
        n = self._watched
        if not n:
            return None
        sums = self._ring.tolist()
        if math.isfinite(sums[(n - 1) % self.ring_size]):  # the last running sum is finite only if every loss was
            return None
        kept = min(n, self.ring_size)
        start = (n - kept) % self.ring_size
        order = [(start + j) % self.ring_size for j in range(kept)]
        for j, i in enumerate(order):
            if not math.isfinite(sums[i]):
                return self._steps[i], not (j == 0 and n > self.ring_size)
        return None

    def check(self) -> None:
        """Raise ``NonFiniteLossError`` if any rank saw a non-finite loss (reads the device; a collective)."""
        world = world_size()
        if not self._watched and world == 1:
            return
        found = self._first_bad_step()
        step, exact = found if found is not None else (_NONE, True)
        if world > 1:  # the earliest step over the ranks, and whether that rank knew it exactly
            flags = torch.tensor([step * 2 + (0 if exact else 1)], dtype=torch.int64, device=collective_device())
            all_reduce_min_(flags)
            code = int(flags.item())
            step, exact = code // 2, code % 2 == 0
        if step == _NONE:
            self._sum, self._watched = self._zero, 0  # all finite: start the next stretch from a zero sum
            return
        where = f"optimizer step {step}" if exact else f"optimizer step {step} or earlier"
        raise NonFiniteLossError(
            f"the training loss was not finite (nan or inf) in {where} (the update that made the step count "
            f"{step}); from that update on the parameters are likely nan. Check the data and the loss for "
            f"nan/inf, lower the learning rate or set clip_grad_norm; or set nonfinite_loss = 'skip' in the config to "
            f"skip such updates (nonfinite_loss = 'ignore' trains on regardless)")


    def check_weights(self, state: Dict[str, Any], what: str) -> None:
        """Raise ``NonFiniteLossError`` rather than let ``what`` write nan/inf weights over the last good file.

        Reads every floating tensor of ``state`` on this rank alone (no collective: a legacy script may save on
        rank 0 alone); under data parallelism a non-finite loss on any rank reaches every rank's weights. A user's
        own loop has no other point where the guard is read, unless it calls ``engine.check_loss_finite()``."""
        bad = [name for name, value in state.items()
               if isinstance(value, torch.Tensor) and value.is_floating_point() and not _finite(value)]
        if not bad:
            return
        found = self._first_bad_step()
        seen = "" if found is None else (f"; this rank's training loss was first not finite in optimizer step "
                                         f"{found[0]}{'' if found[1] else ' or earlier'}")
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise NonFiniteLossError(
            f"{what}: the model's {shown} hold nan or inf{seen}, so nothing was written (a file saved there before "
            f"is kept). Check the data and the loss for nan/inf, lower the learning rate or set clip_grad_norm; call "
            f"engine.check_loss_finite() in your loop (at each epoch's end, say) to stop at the first such step; or "
            f"set nonfinite_loss = 'skip' in the config to skip such updates (nonfinite_loss = 'ignore' saves "
            f"regardless)")


def _finite(tensor: torch.Tensor) -> bool:
    """No nan or inf in ``tensor``, read from its minimum and maximum (nan spreads to both): two numbers, where
    ``isfinite`` makes a mask and temporaries as large as the tensor (a save's largest weight, on its device)."""
    return tensor.numel() == 0 or bool(torch.isfinite(torch.stack(torch.aminmax(tensor))).all())


_NONE = 2**61  # "no non-finite loss" in the ranks' all-reduced minimum


class SkipNonFinite(IgnoreNonFinite):
    """Skips an update whose window had a non-finite loss on any rank (one host read per update)."""

    def __init__(self):
        self._window_sum: Optional[torch.Tensor] = None  # the window's losses, summed
        self.skipped = 0  # updates skipped so far

    def watch(self, loss: torch.Tensor) -> None:
        # a sum is non-finite once any of its terms is (inf + x = inf, inf - inf = nan)
        value = _loss_value(loss)
        if self._window_sum is None:
            self._window_sum = value.to(torch.float32, copy=True)
        else:
            self._window_sum.add_(value)

    def end_window(self) -> None:
        self._window_sum = None

    def open_window(self) -> None:
        self._window_sum = None

    def allows_step(self) -> bool:
        total = self._window_sum
        ok = torch.ones((), dtype=torch.int64) if total is None else total.isfinite().to(torch.int64)
        if world_size() > 1:
            ok = ok.to(collective_device())
            all_reduce_min_(ok)
        if bool(ok):  # the one host read per update: 'skip' decides on the host whether the optimizer steps
            return True
        self.skipped += 1
        return False


def build_loss_guard(choice: str, precision) -> IgnoreNonFinite:
    """The guard for config value ``choice``; fp16 loss-scaling precisions skip such updates themselves."""
    if choice not in NONFINITE_LOSS_CHOICES:
        raise ValueError(f"nonfinite_loss must be one of {NONFINITE_LOSS_CHOICES}, got {choice!r}")
    if choice == "ignore" or getattr(precision, "skips_nonfinite_steps", False):
        guard = IgnoreNonFinite()
    else:
        guard = RaiseOnNonFinite() if choice == "raise" else SkipNonFinite()
    guard.choice = choice  # what the config asked for (fp16's scaler may stand in for it)
    return guard
