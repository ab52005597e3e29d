"""``gpc``: the process-wide view of the launch (config, ranks, group, device).

Before ``launch`` (and in a plain single process) every query gives the single-process
answer: rank 0, world size 1, no group, the current device. If the user initialised
``torch.distributed`` by hand, the ranks and world size are read from it.
"""
from __future__ import annotations

import gc
import os
import random
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from ..context.config import Config
from ..context.parallel_mode import DATA_MODES, ParallelMode


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


class GlobalContext:
    def __init__(self):
        self._config: Optional[Config] = None
        self._launched = False
        self._owns_group = False
        self._local_rank: Optional[int] = None
        self._device: Optional[torch.device] = None
        self.verbose = False
        self.seed: Optional[int] = None
        self._engines = weakref.WeakSet()  # engines built by initialize(); detached from the group on destroy()

    # -- config ----------------------------------------------------------------------------
    @property
    def config(self) -> Optional[Config]:
        return self._config

    def load_config(self, config):
        from ..launch import load_config  # a path, dict or Config, validated

        self._config = load_config(config)
        return self._config

    # -- ranks and groups ------------------------------------------------------------------
    @staticmethod
    def _check_mode(parallel_mode):
        if parallel_mode is not None and not isinstance(parallel_mode, ParallelMode):
            raise TypeError(f"parallel_mode must be a colossal_lite.context.ParallelMode, got {parallel_mode!r}")

    def _is_data(self, parallel_mode) -> bool:
        self._check_mode(parallel_mode)
        return parallel_mode is None or parallel_mode in DATA_MODES

    def is_initialized(self, parallel_mode: Optional[ParallelMode] = None) -> bool:
        """True once ``launch`` (or a hand-made process group) set up the data-parallel world."""
        self._check_mode(parallel_mode)
        return _dist_ready()

    def get_global_rank(self) -> int:
        return dist.get_rank() if _dist_ready() else 0

    def get_world_size(self, parallel_mode: Optional[ParallelMode] = None) -> int:
        if not self._is_data(parallel_mode):
            return 1
        return dist.get_world_size() if _dist_ready() else 1

    def get_local_rank(self, parallel_mode: Optional[ParallelMode] = None) -> int:
        """Rank inside the group of ``parallel_mode``; with no mode, the rank on this node."""
        if parallel_mode is None:
            if self._local_rank is not None:
                return self._local_rank
            return int(os.environ.get("LOCAL_RANK", 0))
        if not self._is_data(parallel_mode):
            return 0
        return self.get_global_rank()

    def get_group(self, parallel_mode: Optional[ParallelMode] = None):
        """The data-parallel process group (the default group) after launch; None before launch."""
        self._is_data(parallel_mode)
        return dist.group.WORLD if _dist_ready() else None

    get_cpu_group = get_group

    def get_ranks_in_group(self, parallel_mode: Optional[ParallelMode] = None):
        return list(range(self.get_world_size(parallel_mode)))

    def is_first_rank(self, parallel_mode: Optional[ParallelMode] = None) -> bool:
        return self.get_local_rank(parallel_mode or ParallelMode.GLOBAL) == 0

    def is_last_rank(self, parallel_mode: Optional[ParallelMode] = None) -> bool:
        return self.get_local_rank(parallel_mode or ParallelMode.GLOBAL) == self.get_world_size(parallel_mode) - 1

    def is_pipeline_first_stage(self, ignore_virtual: bool = False) -> bool:
        return True

    def is_pipeline_last_stage(self, ignore_virtual: bool = False) -> bool:
        return True

    @property
    def world_size(self) -> int:
        return self.get_world_size()

    @property
    def data_parallel_size(self) -> int:
        return self.get_world_size()

    tensor_parallel_size = 1
    pipeline_parallel_size = 1

    # -- device and seeds --------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        if self._device is not None:
            return self._device
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def set_device(self, device_ordinal: Optional[int] = None) -> torch.device:
        """``cuda:device_ordinal`` (default: local rank) when CUDA is available, else CPU."""
        if torch.cuda.is_available():
            ordinal = self.get_local_rank() if device_ordinal is None else device_ordinal
            ordinal %= torch.cuda.device_count()
            torch.cuda.set_device(ordinal)
            self._device = torch.device("cuda", ordinal)
        else:
            self._device = torch.device("cpu")
        return self._device

    def set_seed(self, seed: int):
        """Seed Python, NumPy (when installed) and torch (all devices) with ``seed``."""
        self.seed = seed
        random.seed(seed)
        try:
            import numpy as np
        except ImportError:  # NumPy is optional
            pass
        else:
            np.random.seed(seed % 2**32)
        torch.manual_seed(seed)  # also seeds every CUDA device

    # -- lifecycle -----------------------------------------------------------------------------
    def destroy(self):
        """Destroy the process group this context created and forget the launch.

        Engines first drop their DDP wrapper: a DDP module still holding the destroyed group when the
        interpreter shuts down can abort the process ("terminate called without an active exception").
        """
        for engine in list(self._engines):
            engine.detach_from_group()
        self._engines = weakref.WeakSet()
        gc.collect()
        if self._owns_group and _dist_ready():
            dist.destroy_process_group()
        self._owns_group = False
        self._launched = False
        self._config = None
        self._device = None
        self._local_rank = None


global_context = GlobalContext()
