"""``get_dataloader`` and the data-parallel sampler."""
from __future__ import annotations

import math
import random
from typing import Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ..core.global_context import global_context as gpc


class DataParallelSampler(Sampler):
    """Gives each rank its own equal share of the dataset (padded by repeating).

    With ``shuffle`` the order is drawn from ``seed + epoch``; ``epoch`` moves on by itself
    at every new iteration, so no ``set_epoch`` call is needed (``set_epoch`` still works).
    """

    def __init__(self, dataset: Dataset, shuffle: bool = False, seed: int = 0, drop_last: bool = False,
                 num_replicas: Optional[int] = None, rank: Optional[int] = None):
        self.dataset = dataset
        self.num_replicas = gpc.get_world_size() if num_replicas is None else num_replicas
        self.rank = gpc.get_global_rank() if rank is None else rank
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank {self.rank} is outside [0, {self.num_replicas})")
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self._epoch_set = False
        n = len(dataset)
        if drop_last and n % self.num_replicas:
            self.num_samples = n // self.num_replicas
        else:
            self.num_samples = math.ceil(n / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def set_epoch(self, epoch: int):
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

    def __iter__(self) -> Iterator[int]:
        if not self._epoch_set and getattr(self, "_iterated", False):
            self.epoch += 1
        self._iterated = True
        self._epoch_set = False
        return iter(self.indices(self.epoch))

    def __len__(self) -> int:
        return self.num_samples


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
    """A DataLoader that shards ``dataset`` across data-parallel ranks when the world size is > 1.

    Each worker of each rank gets its own seed, reproducible from ``seed``.
    """
    rank = gpc.get_global_rank()
    generator = torch.Generator()
    generator.manual_seed(seed + 104729 * rank)
    kwargs.setdefault("worker_init_fn", seed_worker)
    if add_sampler and gpc.get_world_size() > 1:
        if "sampler" in kwargs:
            raise ValueError("get_dataloader(sampler=...) conflicts with add_sampler=True; pass add_sampler=False to use your own")
        sampler = DataParallelSampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last)
        return DataLoader(dataset, sampler=sampler, drop_last=drop_last, pin_memory=pin_memory,
                          num_workers=num_workers, generator=generator, **kwargs)
    return DataLoader(dataset, shuffle=shuffle, drop_last=drop_last, pin_memory=pin_memory, num_workers=num_workers,
                      generator=generator, **kwargs)
