"""Gradient accumulation: which micro-step this is, how large the current window really is.

The training loader returned by ``initialize`` tells the window how many micro-batches
remain in the epoch, so a last partial window of r < N micro-batches is divided by r and
applied at the end of the epoch. A loader without ``len`` is read one batch ahead; if its
epoch ends inside a window, the gradients are rescaled by N / r before the update.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch


class AccumulationWindow:
    """Counts micro-steps of a window of ``size`` micro-batches (size 1 = no accumulation)."""

    def __init__(self, size: int = 1):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"gradient_accumulation must be a positive int, got {size!r}")
        self.size = size
        self.micro_step = 0  # backward passes done in the current window
        self.current_size = size  # micro-batches in the current window
        self.correction = 1.0  # gradient rescale for a window cut short by an unsized loader
        self.remaining: Optional[int] = None  # micro-batches left in the epoch, counting the current one
        self.tokens: Optional[torch.Tensor] = None  # real tokens seen in this window (grad_reduction='per-token-mean')
        self.restored = False  # loaded mid-window from a checkpoint: the next epoch iteration continues it

    def begin_backward(self):
        """-> (loss divisor, whether this micro-step ends the window)."""
        if self.micro_step == 0:
            self.current_size = self.size if self.remaining is None else max(1, min(self.size, self.remaining))
            self.correction = 1.0
        elif self.remaining == 1 and self.micro_step + 1 < self.current_size:
            # the epoch ends before the window fills (only possible with a loader without len)
            self.correction = self.current_size / (self.micro_step + 1)
            self.current_size = self.micro_step + 1
        self.remaining = None
        return self.current_size, self.micro_step + 1 == self.current_size

    def end_backward(self):
        self.micro_step += 1

    @property
    def at_start(self) -> bool:
        return self.micro_step == 0

    @property
    def ready(self) -> bool:
        """The window is complete: the optimizer may step."""
        return self.micro_step >= self.current_size

    def reset(self):
        self.micro_step = 0
        self.correction = 1.0
        self.tokens = None

    def state_dict(self):
        return {"size": self.size, "micro_step": self.micro_step, "current_size": self.current_size,
                "correction": self.correction, "tokens": None if self.tokens is None else self.tokens.detach().clone()}

    def load_state_dict(self, state):
        self.micro_step = int(state["micro_step"])
        self.current_size = int(state["current_size"])
        self.correction = float(state["correction"])
        self.tokens = state.get("tokens")
        self.restored = self.micro_step > 0


class AccumulationDataLoader:
    """Wraps the training loader so the window knows where the epoch ends.

    Attributes of the wrapped loader (``sampler``, ``dataset``, ``batch_size``...) are forwarded.
    """

    def __init__(self, loader: Iterable, window: AccumulationWindow):
        self.loader = loader
        self.window = window

    def __len__(self):
        return len(self.loader)

    def __getattr__(self, name):
        if name in ("loader", "window"):
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self):
        window = self.window
        if not window.at_start and not window.restored:  # an epoch left a window open (the loop broke early): drop it
            window.reset()
        window.restored = False
        try:
            n = len(self.loader)
        except TypeError:
            n = None
        if n is not None:
            for i, batch in enumerate(self.loader):
                window.remaining = n - i
                yield batch
            return
        it = iter(self.loader)
        try:
            nxt = next(it)
        except StopIteration:
            return
        while True:
            cur = nxt
            try:
                nxt = next(it)
                last = False
            except StopIteration:
                last = True
            window.remaining = 1 if last else None
            yield cur
            if last:
                return


def rescale_grads_(params, factor):
    """Multiply every gradient by ``factor`` (a float or a 0-dim device tensor; None = 1)."""
    if factor is None or (isinstance(factor, float) and factor == 1.0):
        return
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    if isinstance(factor, torch.Tensor):
        on_device = {}
        for g in grads:  # DTensor gradients: scale the local shard in place
            local = g.to_local() if hasattr(g, "to_local") else g
            f = on_device.get(local.device)
            if f is None:
                f = on_device[local.device] = factor.to(local.device)
            local.mul_(f)
    else:
        torch._foreach_mul_(grads, factor)
