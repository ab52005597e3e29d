"""One training epoch's batches and each one's place in its accumulation window, for ``Trainer._train_loop``.

The loop asks, for micro-batch ``index`` of the epoch: is there one (``has``), where it stands (``place``, before
its forward: data parallelism decides there whether the coming backward synchronises gradients), and the batch
itself (``batch``). The two kinds of loader differ only in where the answers come from:

- ``SizedEpoch``, a loader with ``len``: arithmetic on the index and the length (``AccumulationWindow.plans``).
- ``UnsizedEpoch``, a loader without one (an ``IterableDataset``, a generator function): the epoch ends when
  its iterator does, so it reads ahead. At a window's first micro-batch (or where a resumed epoch starts) it
  reads the rest of the window and one batch more: the window's real size is then known before its first
  forward, so a window the epoch cuts short divides its losses by its own size, exactly as with a length, and
  whether the epoch goes on after the window is known at the window's step (``state.epoch_length``). It holds
  at most ``gradient_accumulation + 1`` batches, as the loader yielded them (not yet on the device).
"""
from __future__ import annotations

from collections import deque
from typing import Iterator

from ..engine.accumulation import AccumulationWindow, MicroBatch

__all__ = ["SizedEpoch", "UnsizedEpoch"]

_END = object()


class SizedEpoch:
    """An epoch of ``length`` micro-batches (the loader's ``len``)."""

    def __init__(self, window: AccumulationWindow, data_iter: Iterator, length: int):
        self.plans = window.plans(length)
        self.data_iter = data_iter
        self.length = length

    def has(self, index: int) -> bool:
        return index < self.length

    def place(self, index: int) -> MicroBatch:
        return self.plans[index]

    def batch(self, index: int):
        batch = next(self.data_iter, _END)
        if batch is _END:
            raise RuntimeError(f"the train_dataloader stopped after {index} batches of an epoch, but its "
                               f"len() is {self.length}: make __len__ give the number of batches __iter__ yields")
        return batch


class UnsizedEpoch:
    """An epoch that ends when ``data_iter`` does; it starts at micro-batch ``state.batch_idx`` (a resumed epoch's
    first batches were read and dropped). Sets ``state.epoch_length`` when the iterator ends."""

    def __init__(self, window: AccumulationWindow, data_iter: Iterator, state):
        self.size = window.size
        self.window = window
        self.data_iter = data_iter
        self.state = state
        self.ahead: deque = deque()  # batches read, not yet run: micro-batches index, index + 1, ...
        self.read = state.batch_idx  # the epoch's batches read so far (the index of the next one to read)
        self.ended = False
        state.epoch_length = None

    def _read_ahead(self, count: int) -> None:
        """Hold ``count`` batches ahead, or all that are left."""
        while len(self.ahead) < count and not self.ended:
            batch = next(self.data_iter, _END)
            if batch is _END:
                self.ended = True
                self.state.epoch_length = self.read
                if self.read == 0:
                    raise ValueError(
                        f"the train_dataloader yielded no batch in epoch {self.state.epoch}. Each epoch iterates it "
                        f"again: a generator object is used up after one pass, so give an object whose __iter__ "
                        f"starts over (a DataLoader over an IterableDataset, or a class with __iter__)")
            else:
                self.ahead.append(batch)
                self.read += 1

    def has(self, index: int) -> bool:
        self._read_ahead(1)
        return bool(self.ahead)

    def place(self, index: int) -> MicroBatch:
        window_end = index - index % self.size + self.size
        self._read_ahead(window_end - index + 1)  # the window's rest, and the batch after it
        where = self.window.plan(index, index + len(self.ahead))  # (past the window's end when the epoch goes on)
        # Announced now, before zero_grad reads it: a loader that announces places itself (the one ``initialize``
        # returns) announced those of the batches read ahead.
        self.window.expect(where)
        return where

    def batch(self, index: int):
        return self.ahead.popleft()
