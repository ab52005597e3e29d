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
from typing import Iterator, List, Sequence

from ..engine.accumulation import AccumulationWindow, MicroBatch, plan_ahead

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
    first batches were read and dropped). The plan comes from ``plan_ahead``, as for the loader ``initialize``
    returns; ``state.epoch_length`` is set once the read-ahead meets the iterator's end.

    ``read_ahead``: batches an interrupted run had read ahead of ``state.batch_idx`` (``held`` at its checkpoint),
    trained first, before ``data_iter``'s."""

    def __init__(self, window: AccumulationWindow, data_iter: Iterator, state, read_ahead: Sequence = ()):
        self.window = window
        self.state = state
        self._ahead: deque = deque(read_ahead)
        self.plans = plan_ahead(window, data_iter, start=state.batch_idx, ahead=self._ahead)
        self.next = None  # (where, batch, length) of the next micro-batch, once read
        state.epoch_length = None

    def has(self, index: int) -> bool:
        if self.next is None:
            self.next = next(self.plans, None)
            if self.next is None and index == 0:
                raise ValueError(
                    f"the train_dataloader yielded no batch in epoch {self.state.epoch}. Each epoch iterates it "
                    f"again: a generator object is used up after one pass, so give an object whose __iter__ "
                    f"starts over (a DataLoader over an IterableDataset, or a class with __iter__)")
            if self.next is None and self.state.epoch_length is None:
                self.state.epoch_length = index
        return self.next is not None

    def place(self, index: int) -> MicroBatch:
        where, _, length = self.next
        if length is not None:
            self.state.epoch_length = length
        # Announced now, before zero_grad reads it: a loader that announces places itself (the one ``initialize``
        # returns) announced those of the batches read ahead.
        self.window.expect(where)
        return where

    def batch(self, index: int):
        batch, self.next = self.next[1], None
        return batch

    @property
    def held(self) -> List:
        """The batches read but not trained yet, in order (what a checkpoint taken now keeps for the resume)."""
        return ([self.next[1]] if self.next is not None else []) + list(self._ahead)
