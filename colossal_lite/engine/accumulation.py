"""Gradient accumulation: where each micro-batch stands in its window, and the one counter the engine keeps.

A window is ``size`` micro-batches whose gradients add up before one optimizer step. Windows start at
the start of each epoch; the last window of an epoch may be shorter (r < size micro-batches) and is
still exact: its losses are divided by r. The loop that iterates the data knows where the epoch ends,
so it works out each micro-batch's place (``MicroBatch``) and announces it before the batch runs
(``expect``); the engine reads it at the micro-batch's first forward, where data parallelism decides
whether the coming backward synchronises gradients:

- a loader with ``len``: arithmetic on the index and the length (``AccumulationWindow.plan``);
- a loader without one: at each window's first batch the rest of the window and one batch more are read
  ahead, so a window the epoch cuts short is known to have r < size micro-batches before its first forward;
- a user's own loop over a loader ``initialize`` did not wrap: the engine counts ``engine.step()`` calls
  (legacy Colossal-AI's rule), every window has ``size`` micro-batches.

The only state is ``micro_step``, the micro-batches begun in the open window; it goes into checkpoints.
"""
from __future__ import annotations

import warnings
from collections import deque
from typing import Iterable, Iterator, List, NamedTuple, Optional

import torch

from ..utils.data import batches_per_epoch


class MicroBatch(NamedTuple):
    """One micro-batch's place in its accumulation window."""

    divisor: int  # micro-batches in its window: a mean loss is weighed by 1 / divisor
    first: bool  # it opens the window (gradients are cleared before it)
    last: bool  # it closes the window (the optimizer steps after it)


class AccumulationWindow:
    """Windows of ``size`` micro-batches (size 1 = no accumulation) and the open window's progress.

    A micro-batch is everything between two batches of the plan (the loader ``initialize`` returned, or the
    Trainer, announces each batch with ``expect``), or with no plan between two ``engine.step()`` calls, as legacy
    Colossal-AI counted: any number of forward and backward calls add their gradients into it (a GAN's
    discriminator update runs two). Its place is known at its first forward, so the strategy can decide there
    whether the coming backward synchronises gradients.
    """

    def __init__(self, size: int = 1):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"gradient_accumulation must be a positive int, got {size!r}")
        self.size = size
        self.micro_step = 0  # micro-batches begun in the open window
        self.current: Optional[MicroBatch] = None  # the micro-batch in progress, from its first forward or backward
        self.backward_done = False  # a backward ran in the current micro-batch
        self._next: Optional[MicroBatch] = None  # the next micro-batch's place, as the iterating loop announced it

    # -- where a micro-batch stands --------------------------------------------------------------
    def plan(self, index: int, length: int) -> MicroBatch:
        """Place of micro-batch ``index`` (0-based) of an epoch of ``length`` micro-batches."""
        start = index - index % self.size
        divisor = min(self.size, length - start)
        return MicroBatch(divisor, index == start, index == start + divisor - 1)

    def plans(self, length: int) -> List[MicroBatch]:
        """The place of every micro-batch of an epoch of ``length`` (worked out once per epoch): the places of a
        full window repeated, then those of the shorter window the epoch may end with."""
        full, rest = divmod(length, self.size)
        return [self.plan(i, self.size) for i in range(self.size)] * full + [self.plan(i, rest) for i in range(rest)]

    def counted(self) -> MicroBatch:
        """Place of the next micro-batch when nobody said where the epoch ends: every window is full."""
        return MicroBatch(self.size, self.micro_step == 0, self.micro_step + 1 == self.size)

    def expect(self, where: MicroBatch) -> None:
        """The loop about to run a new batch says where it stands (``AccumulationDataLoader``, the Trainer)."""
        self._next = where

    # -- the open window -------------------------------------------------------------------------
    def enter(self, where: Optional[MicroBatch] = None) -> MicroBatch:
        """A forward or backward runs: the place of the micro-batch it belongs to. A new micro-batch begins when
        ``where`` is given or was announced, or, with no plan, after ``end_micro_batch``; otherwise the call
        belongs to the micro-batch in progress."""
        if where is None:
            where = self._next
            if where is None:
                if self.current is not None:
                    return self.current
                where = self.counted()
        elif where is self.current:
            return where
        self._next = None
        self.micro_step = 1 if where.first else self.micro_step + 1
        self.current = where
        self.backward_done = False
        return where

    def end_micro_batch(self) -> None:
        """``engine.step()`` inside a window: the next forward or backward begins the next micro-batch."""
        self.current = None
        self.backward_done = False

    def continue_at(self, index: int) -> None:
        """The epoch's next micro-batch is ``index``: a window left open by a loop that stopped elsewhere is
        dropped (its gradients are cleared by the next window's ``zero_grad``), a restored one continues."""
        if self.micro_step != index % self.size:
            self.close()

    @property
    def at_start(self) -> bool:
        """No micro-batch of the open window has begun."""
        return self.micro_step == 0

    @property
    def opens_next(self) -> bool:
        """``zero_grad`` now clears gradients: the micro-batch about to run (as announced) or running opens a
        window (after its backward, clearing starts it over)."""
        if self._next is not None:
            return self._next.first
        if self.current is not None:
            return self.current.first
        return self.micro_step == 0

    @property
    def closing(self) -> Optional[MicroBatch]:
        """The micro-batch that completes the window (its last, after a backward), until the step; else None."""
        current = self.current
        return current if current is not None and current.last and self.backward_done else None

    @property
    def complete(self) -> bool:
        """The window's last micro-batch went backward: the optimizer may step."""
        return self.closing is not None

    def close(self) -> None:
        self.micro_step = 0
        self.current = None
        self.backward_done = False

    def state_dict(self):
        return {"size": self.size, "micro_step": self.micro_step}

    def load_state_dict(self, state):
        self.micro_step = int(state["micro_step"])
        self.current = None
        self.backward_done = False


class AccumulationDataLoader:
    """The training loader ``initialize`` returns: it tells the engine where each batch stands in its window.

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

    def __iter__(self) -> Iterator:
        window = self.window
        if not window.at_start:
            warnings.warn(
                f"gradient accumulation: the last loop over the train loader stopped inside a window, after "
                f"{window.micro_step} of its {window.size} micro-batches; windows start at each epoch's start, so "
                f"their gradients are dropped, not applied (a loop that breaks early should break at a window's end, "
                f"after engine.step(), to lose nothing)", UserWarning, stacklevel=2)
        try:
            n = len(self.loader)
        except TypeError:
            n = None
        if n is not None:  # a loader resumed inside its epoch yields only the rest: count from where it starts
            length = batches_per_epoch(self.loader)
            for i, batch in enumerate(self.loader, start=length - n):
                window.expect(window.plan(i, length))
                yield batch
            return
        for where, batch, _ in plan_ahead(window, iter(self.loader)):
            window.expect(where)
            yield batch


def plan_ahead(window: AccumulationWindow, it: Iterator, start: int = 0, ahead: Optional[deque] = None) -> Iterator:
    """An epoch without ``len``, from micro-batch ``start`` on: ``(where, batch, length)`` for each batch, where
    ``length`` is the epoch's number of micro-batches once the read-ahead has met its end (None before).

    Before each micro-batch the rest of its window and one batch more are held, so the window's real size is
    known before its first forward: a window the epoch cuts short divides its losses by its own size, exactly as
    with a length. Holds at most ``window.size + 1`` batches, as the loader yielded them: in ``ahead`` when given
    (the caller reads what is held; batches already in it come first, before ``it``'s).
    """
    ahead = deque() if ahead is None else ahead
    index, length = start, None
    while True:
        window_end = index - index % window.size + window.size
        while length is None and len(ahead) < window_end - index + 1:
            batch = next(it, _END)
            if batch is _END:
                length = index + len(ahead)
            else:
                ahead.append(batch)
        if not ahead:
            return
        # past the window's end while the epoch goes on, else the epoch's length
        where = window.plan(index, index + len(ahead))
        yield where, ahead.popleft(), length
        index += 1


_END = object()


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
