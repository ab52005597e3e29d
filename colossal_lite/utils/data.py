"""``get_dataloader``, the data-parallel sampler and resuming the data order mid-epoch."""
from __future__ import annotations

import math
import random
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from ..core import dist as cl_dist
from ..core.global_context import global_context as gpc


class DataParallelSampler(Sampler):
    """Gives each rank its own equal share of the dataset (padded by repeating) and can resume mid-epoch.

    With ``shuffle`` the order is drawn from ``seed + epoch``; ``epoch`` moves on by itself
    at every new iteration, so no ``set_epoch`` call is needed (``set_epoch`` still works).

    ``state_dict()`` is ``{'epoch', 'offset'}``: the epoch whose order is in use and how many of
    this rank's samples of it were consumed. After ``load_state_dict`` the next iteration yields
    that epoch's order from ``offset`` on, without touching the skipped samples, and ``len()``
    is the number of samples that iteration yields (``num_samples`` is always the full epoch).
    The count is exact when the sampler feeds a ``ResumableDataLoader`` (what ``get_dataloader``
    returns), which reports the batches it really handed out; otherwise it counts the indices
    handed out, which a DataLoader with workers fetches ahead of use.
    """

    def __init__(self, dataset: Dataset, shuffle: bool = False, seed: int = 0, drop_last: bool = False,
                 num_replicas: Optional[int] = None, rank: Optional[int] = None):
        self.dataset = dataset
        self.num_replicas = cl_dist.world_size() if num_replicas is None else num_replicas
        self.rank = cl_dist.rank() if rank is None else rank
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank {self.rank} is outside [0, {self.num_replicas})")
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self._epoch_set = False
        self._iterated = False
        self._pending: Optional[int] = None  # offset the next iteration starts at (after load_state_dict)
        self._iteration = 0  # id of the latest iteration
        self._active = False  # the latest iteration has not finished
        self._start = 0  # offset the latest iteration started at
        self._consumed = 0  # samples of the latest iteration's epoch consumed so far (offset included)
        self._counted_by_loader = False
        n = len(dataset)
        if drop_last and n % self.num_replicas:
            self.num_samples = n // self.num_replicas
        else:
            self.num_samples = math.ceil(n / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def set_epoch(self, epoch: int):
        if self._pending is not None and epoch != self.epoch:
            self._pending = None  # a different epoch than the one a resume pointed at: start it at 0
        self.epoch = epoch
        self._epoch_set = True

    def indices(self, epoch: int):
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            idx = torch.randperm(len(self.dataset), generator=g).tolist()
        else:
            idx = list(range(len(self.dataset)))
        if self.drop_last:
            idx = idx[: self.total_size]
        else:
            pad = self.total_size - len(idx)
            idx += (idx * math.ceil(pad / max(len(idx), 1)))[:pad]
        return idx[self.rank: self.total_size: self.num_replicas]

    def next_epoch(self) -> int:
        """The epoch whose order the next iteration will yield."""
        if self._epoch_set or not self._iterated:
            return self.epoch
        return self.epoch + 1

    def upcoming_start(self) -> int:
        """Where in this rank's share of the epoch the next iteration starts (not 0 after ``load_state_dict``)."""
        return self._pending or 0

    def upcoming_indices(self) -> List[int]:
        """The dataset indices the next iteration will yield, in order, without starting it."""
        return self.indices(self.next_epoch())[self.upcoming_start():]

    def __iter__(self) -> Iterator[int]:
        self.epoch = self.next_epoch()
        self._iterated = True
        self._epoch_set = False
        start = self.upcoming_start()
        self._pending = None
        self._iteration += 1
        self._active = True
        self._start = self._consumed = start
        return self._yield(self.indices(self.epoch)[start:], self._iteration)

    def _yield(self, indices, iteration: int) -> Iterator[int]:
        for i in indices:
            if iteration == self._iteration and not self._counted_by_loader:
                self._consumed += 1
            yield i
        if iteration == self._iteration and not self._counted_by_loader:
            self._active = False

    def __len__(self) -> int:
        if self._pending is not None:
            return self.num_samples - self._pending
        if self._active:
            return self.num_samples - self._start
        return self.num_samples

    # -- resuming --------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, int]:
        """``{'epoch', 'offset'}``: where the data order stands (an epoch fully consumed reads as the next one at 0)."""
        if self._pending is not None:
            epoch, offset = self.epoch, self._pending
        elif self._active:
            epoch, offset = self.epoch, self._consumed
        else:
            epoch, offset = self.next_epoch(), 0
        if offset >= self.num_samples:
            epoch, offset = epoch + 1, 0
        return {"epoch": int(epoch), "offset": int(offset)}

    def load_state_dict(self, state: Dict[str, int]):
        """Make the next iteration yield epoch ``state['epoch']``'s order from ``state['offset']`` on."""
        try:
            epoch, offset = int(state["epoch"]), int(state["offset"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"a DataParallelSampler state is {{'epoch': int, 'offset': int}}, got {state!r}") from None
        if epoch < 0 or offset < 0:
            raise ValueError(f"sampler state must have epoch >= 0 and offset >= 0, got {state!r}")
        if offset >= self.num_samples:
            epoch, offset = epoch + 1, 0
        self.epoch = epoch
        self._epoch_set = True
        self._pending = offset or None
        self._active = False
        self._iteration += 1  # an iteration still running no longer counts

    def _finish(self, iteration: int):
        if iteration == self._iteration:
            self._consumed = self.num_samples
            self._active = False


class _CountingIterator:
    """Tells the sampler how many samples the loader really handed out (workers fetch ahead)."""

    def __init__(self, it, sampler: DataParallelSampler, batch_size: int, drop_last: bool):
        self._it, self._sampler, self._batch_size, self._drop_last = it, sampler, batch_size, drop_last
        self._before = sampler._iteration
        self._iteration: Optional[int] = None
        self._delivered = 0
        self._total = 0

    def __iter__(self):
        return self

    def __len__(self):
        return len(self._it)

    def __getattr__(self, name):
        return getattr(self._it, name)

    def __next__(self):
        sampler = self._sampler
        try:
            batch = next(self._it)
        except StopIteration:
            if self._iteration is not None:
                sampler._finish(self._iteration)
            elif sampler._iteration != self._before:
                sampler._finish(sampler._iteration)
            raise
        if self._iteration is None:
            self._iteration = sampler._iteration
            n = sampler.num_samples - sampler._start
            self._total = n // self._batch_size if self._drop_last else math.ceil(n / self._batch_size)
        if self._iteration == sampler._iteration:
            self._delivered += 1
            sampler._consumed = min(sampler._start + self._delivered * self._batch_size, sampler.num_samples)
            if self._delivered >= self._total:
                sampler._finish(self._iteration)
        return batch


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over a ``DataParallelSampler`` whose position can be saved and restored.

    ``state_dict()`` holds the sampler's ``{'epoch', 'offset'}`` (offset = samples of this rank
    consumed, counted from the batches really handed out) and the state of the loader's
    ``generator`` as it was when the current epoch began (it seeds the workers), so after
    ``load_state_dict`` the next iteration continues where the saved one stood.
    """

    def __iter__(self):
        if self.generator is not None:  # each iteration draws the workers' base seed from it
            self._generator_at_epoch_start = self.generator.get_state()
        it = super().__iter__()
        sampler = self.sampler
        if not isinstance(sampler, DataParallelSampler) or self.batch_size is None:
            return it
        sampler._counted_by_loader = True
        return _CountingIterator(it, sampler, self.batch_size, self.drop_last)

    def state_dict(self) -> Dict[str, Any]:
        sampler = self.sampler
        if not isinstance(sampler, DataParallelSampler):
            raise TypeError(f"ResumableDataLoader.state_dict needs a DataParallelSampler, this one has "
                            f"{type(sampler).__name__}")
        state: Dict[str, Any] = {"sampler": sampler.state_dict()}
        if self.generator is not None:
            mid_epoch = sampler._active and sampler.state_dict()["epoch"] == sampler.epoch
            saved = getattr(self, "_generator_at_epoch_start", None)
            state["generator"] = saved if (mid_epoch and saved is not None) else self.generator.get_state()
        return state

    def load_state_dict(self, state: Dict[str, Any]):
        self.sampler.load_state_dict(state["sampler"])
        if "generator" in state and self.generator is not None:
            self.generator.set_state(state["generator"])


def batches_per_epoch(loader) -> int:
    """Batches in a whole epoch of ``loader``, whatever its resume state (``len(loader)`` is what the
    current or next iteration yields, shorter right after resuming mid-epoch)."""
    sampler = getattr(loader, "sampler", None)
    batch_size = getattr(loader, "batch_size", None)
    if not isinstance(sampler, DataParallelSampler) or not batch_size:
        return len(loader)
    n = sampler.num_samples
    return n // batch_size if getattr(loader, "drop_last", False) else math.ceil(n / batch_size)


def skip_batches(loader, n_batches: int):
    """Make the next iteration of ``loader`` (from ``get_dataloader``) start ``n_batches`` batches into its epoch.

    The skipped samples are not loaded. Sets the sampler offset to ``n_batches * batch_size``.
    """
    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, DataParallelSampler):
        raise TypeError(f"skip_batches needs a loader whose sampler is a DataParallelSampler (from get_dataloader); "
                        f"this one has {type(sampler).__name__}")
    batch_size = getattr(loader, "batch_size", None) or 1
    sampler.load_state_dict({"epoch": sampler.next_epoch(), "offset": int(n_batches) * batch_size})


def seed_worker(worker_id: int):
    """Seed Python and NumPy in a worker from the torch seed the DataLoader gave it (unique per worker)."""
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed)


def get_dataloader(dataset: Dataset, shuffle: bool = False, seed: int = 1024, add_sampler: bool = True,
                   drop_last: bool = False, pin_memory: bool = False, num_workers: int = 0, **kwargs) -> DataLoader:
    """A DataLoader that shards ``dataset`` across data-parallel ranks (one share per rank; the whole
    dataset with one process) in an order that changes every epoch and is reproducible from ``seed``.

    With ``add_sampler`` (the default) it is a ``ResumableDataLoader`` over a ``DataParallelSampler``,
    whose ``state_dict``/``load_state_dict`` let a run continue mid-epoch. Each worker of each rank
    gets its own seed, reproducible from ``seed``. Without ``batch_size`` (or ``batch_sampler``) the
    batch size is the config's ``micro_batch_size`` when it has one, so the config's batch arithmetic
    describes this loader.

    An ``IterableDataset`` has no indices to share out: its ``__iter__`` decides what each rank reads. With one
    process the loader reads the whole stream; on several ranks ``get_dataloader`` refuses it unless
    ``add_sampler=False``, which says that the dataset splits itself over the ranks (by
    ``torch.distributed.get_rank()``), every rank yielding the same number of batches.
    """
    micro = gpc.config.get("micro_batch_size") if gpc.config is not None else None
    if micro is not None and "batch_size" not in kwargs and "batch_sampler" not in kwargs:
        kwargs["batch_size"] = micro
    rank = cl_dist.rank()
    world_size = cl_dist.world_size()
    generator = torch.Generator()
    generator.manual_seed(seed + 104729 * rank)
    kwargs.setdefault("worker_init_fn", seed_worker)
    if add_sampler and world_size > 1 and "sampler" in kwargs:
        raise ValueError("get_dataloader(sampler=...) conflicts with add_sampler=True; pass add_sampler=False to use your own")
    if add_sampler and world_size > 1 and isinstance(dataset, IterableDataset):
        # a sampler would need indices the stream does not have, and handing every rank the whole stream would
        # train each sample world_size times: only the dataset's own __iter__ can split it
        raise ValueError(
            f"get_dataloader({type(dataset).__name__}(), ...) on {world_size} ranks: an IterableDataset cannot be "
            f"split over the ranks by a sampler. Split it in its own __iter__ (e.g. every "
            f"torch.distributed.get_world_size()-th item from torch.distributed.get_rank() on, and by "
            f"torch.utils.data.get_worker_info() with num_workers > 0), with the same number of batches on every "
            f"rank, and pass add_sampler=False (or give it to a torch DataLoader); or use a map-style Dataset "
            f"(__getitem__ and __len__), which get_dataloader shards itself.")
    own_order = "sampler" in kwargs or "batch_sampler" in kwargs or isinstance(dataset, IterableDataset)
    if add_sampler and (world_size > 1 or not own_order):
        sampler = DataParallelSampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last,
                                      num_replicas=world_size, rank=rank)
        return ResumableDataLoader(dataset, sampler=sampler, drop_last=drop_last, pin_memory=pin_memory,
                                   num_workers=num_workers, generator=generator, **kwargs)
    return DataLoader(dataset, shuffle=shuffle, drop_last=drop_last, pin_memory=pin_memory, num_workers=num_workers,
                      generator=generator, **kwargs)
