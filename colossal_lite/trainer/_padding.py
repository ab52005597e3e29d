"""Which rows of an evaluation pass are a distributed sampler's padding, so that no metric or hook counts them.

``DistributedSampler`` (and ``get_dataloader``'s ``DataParallelSampler``) gives every rank an equal share by
repeating the first indices of the epoch's order after its end; rank ``r`` yields the positions ``r``,
``r + world``, ``r + 2 * world``, ... of that padded order, and the positions at or past the dataset's length are
the repeats. They are the last of each rank's share, so a rank knows from its position alone how many of its
samples are real, and a loader batching the sampler in order (torch's ``BatchSampler``) hands those out first:
each batch's rows past that count are padding. A loader with no such sampler has no known padding.
"""
from __future__ import annotations

import math
from typing import Any, Optional

from torch.utils.data import BatchSampler, DistributedSampler

from ..engine.batch import batch_len
from ..utils.data import DataParallelSampler

__all__ = ["RealRows", "padded_sampler", "real_samples"]

_PADDED = (DistributedSampler, DataParallelSampler)


def padded_sampler(loader: Any) -> Optional[Any]:
    """The loader's distributed sampler when its batches take that sampler's indices in order; else None."""
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, _PADDED):
        return sampler
    batch_sampler = getattr(loader, "batch_sampler", None)
    if isinstance(batch_sampler, BatchSampler) and isinstance(batch_sampler.sampler, _PADDED):
        return batch_sampler.sampler
    return None


def real_samples(sampler: Any) -> int:
    """How many of the samples that ``sampler``'s next iteration yields on its rank are real, not repeats (with
    ``drop_last=True`` there are no repeats: all are)."""
    mine = math.ceil((len(sampler.dataset) - sampler.rank) / sampler.num_replicas)
    real = min(max(mine, 0), sampler.num_samples)
    start = sampler.upcoming_start() if isinstance(sampler, DataParallelSampler) else 0  # a resumed share
    return max(real - start, 0)


def _batch_size(loader: Any) -> Optional[int]:
    """Samples per batch of a loader batching its sampler in order (the last batch may hold fewer)."""
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) and size > 0 else None


class RealRows:
    """One evaluation pass over ``loader``: the number of rows and of real rows in each of its batches, in turn.

    A batch's rows are counted from the loader (its batch size, and the samples left in this rank's share), not
    from the batch, whose first tensor need not have a row per sample (a ``collate_fn``'s list of sequences).
    Make it before the pass starts (a ``DataParallelSampler`` moves on when iterated)."""

    def __init__(self, loader: Any):
        sampler = padded_sampler(loader)
        self.left: Optional[int] = None if sampler is None else real_samples(sampler)
        self.to_come: int = 0 if sampler is None else len(sampler)
        self.batch_size = _batch_size(loader)
        self.rows: Optional[int] = None  # the rows of the last batch asked about

    def of(self, batch: Any) -> Optional[int]:
        """How many leading rows of ``batch`` (the loader's next) are real; None when all are, or when that
        cannot be known (no padding known, or a batch with no batch dimension: nothing is dropped from then on)."""
        if self.left is None:
            return None
        if self.batch_size is not None:
            rows = min(self.batch_size, self.to_come)
            self.to_come -= rows
        else:
            try:
                rows = batch_len(batch)
            except TypeError:
                self.left = None
                return None
        self.rows = rows
        keep = min(rows, self.left)
        self.left -= keep
        return None if keep == rows else keep
