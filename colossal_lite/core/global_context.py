"""``gpc``: the process-wide view of the launch (config, ranks, group, device).

Before ``launch`` (and in a plain single process) every query gives the single-process
answer: rank 0, world size 1, no group, the current device. If the user initialised
``torch.distributed`` by hand, the ranks and world size are read from it.
"""
from __future__ import annotations

import atexit
import gc
import os
import random
import socket
import sys
import time
import weakref
from typing import List, Optional

import torch
import torch.distributed as dist

from ..context.config import Config
from ..context.parallel_mode import DATA_MODES, ParallelMode
from ..context.validation import load_config


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
        self.num_processes_on_current_node = -1  # legacy's value before launch; launch detects it
        self._engines = weakref.WeakSet()  # engines built by initialize(); detached from the group on destroy()

    @property
    def engines(self) -> tuple:
        """The live engines ``initialize`` built, so ``save_checkpoint`` can find the one that owns a model."""
        return tuple(self._engines)

    def add_engine(self, engine) -> None:
        """An engine ``initialize`` built: listed in ``engines``, detached from the group by ``destroy``."""
        self._engines.add(engine)

    # -- what launch sets ------------------------------------------------------------------------
    def begin_launch(self, config: Config, local_rank: int, verbose: bool) -> None:
        """``launch`` starts: the checked config, this process's local rank, whether to print."""
        self._config = config
        self._local_rank = local_rank
        self.verbose = verbose

    def own_group(self) -> None:
        """``launch`` started the process group, so ``destroy`` (or the exit) ends it."""
        self._owns_group = True

    def finish_launch(self) -> None:
        """The process group is up (started by ``launch`` or found running): the process is launched."""
        self._launched = True

    # -- config ----------------------------------------------------------------------------
    @property
    def config(self) -> Optional[Config]:
        return self._config

    def load_config(self, config):
        """``config`` (a path to a ``.py`` file, a dict or a Config) validated, as this process's config."""
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
        """The global ranks in this process's group of ``parallel_mode``: all of them for the data-parallel
        modes; for a model-parallel mode (a group of one process here) this process's own rank."""
        if not self._is_data(parallel_mode):
            return [self.get_global_rank()]
        return list(range(self.get_world_size(parallel_mode)))

    def get_next_global_rank(self, parallel_mode: ParallelMode) -> int:
        """The global rank after this one in its group of ``parallel_mode``, wrapping around (legacy's ring order)."""
        return self._neighbour(parallel_mode, 1)

    def get_prev_global_rank(self, parallel_mode: ParallelMode) -> int:
        """The global rank before this one in its group of ``parallel_mode``, wrapping around."""
        return self._neighbour(parallel_mode, -1)

    def _neighbour(self, parallel_mode, offset: int) -> int:
        ranks = self.get_ranks_in_group(parallel_mode)
        return ranks[(ranks.index(self.get_global_rank()) + offset) % len(ranks)]

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
    virtual_pipeline_parallel_size = None  # legacy set these only for an interleaved pipeline, which there is not
    virtual_pipeline_parallel_rank = None

    def detect_num_processes_on_current_node(self) -> int:
        """Count the processes of the group on this machine into ``num_processes_on_current_node``: torchrun's
        ``LOCAL_WORLD_SIZE`` where the launcher gives it, else by host name, a collective, as in legacy (every rank
        calls it: ``launch`` does, and every rank of one launch has the same environment)."""
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        if local.isdigit():
            self.num_processes_on_current_node = int(local)
            return self.num_processes_on_current_node
        host = socket.gethostname()
        if _dist_ready() and dist.get_world_size() > 1:
            hosts: List[Optional[str]] = [None] * dist.get_world_size()
            dist.all_gather_object(hosts, host)
        else:
            hosts = [host]
        self.num_processes_on_current_node = hosts.count(host)
        return self.num_processes_on_current_node

    def check_sanity(self) -> None:
        """Legacy's check that the world is data x pipeline x tensor parallel; here pipeline and tensor are 1."""
        product = self.data_parallel_size * self.pipeline_parallel_size * self.tensor_parallel_size
        if product != self.world_size:
            raise RuntimeError(f"world size {self.world_size} is not data ({self.data_parallel_size}) x pipeline "
                               f"({self.pipeline_parallel_size}) x tensor ({self.tensor_parallel_size}) parallel size")

    def init_global_dist(self, rank: int, world_size: int, backend: str, host: str, port: int) -> None:
        """Legacy's first step of ``launch``; here ``launch`` starts the group (after checking the config), so
        this call is refused with the call to write instead."""
        if _dist_ready():
            raise RuntimeError("gpc.init_global_dist: the process group is already running (launch started it); "
                               "remove the call")
        raise RuntimeError(f"gpc.init_global_dist is not supported by colossal_lite: start the group with "
                           f"colossal_lite.launch(config, rank={rank}, world_size={world_size}, host={host!r}, "
                           f"port={port}, backend={backend!r}), which also checks the config, sets the device and "
                           f"the seed (in place of load_config + init_global_dist + init_parallel_groups)")

    def init_parallel_groups(self) -> None:
        """Legacy's second step of ``launch``, which made a group per parallel mode. With data parallelism only,
        every mode is answered from the one group ``launch`` started, so there is nothing to make: after
        ``launch`` this does nothing, before it it is refused (the group does not exist yet)."""
        if not _dist_ready():
            raise RuntimeError("gpc.init_parallel_groups: no process group is running; call colossal_lite.launch "
                               "(or launch_from_torch), which starts it; every ParallelMode then uses that group")

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

    def use_cpu(self) -> torch.device:
        """Train on the CPU, even where CUDA is available (``launch(..., device='cpu')``)."""
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

        Engines first drop their DDP wrapper, so that nothing but torch's own tables holds the group and
        destroying it frees it: its gloo worker threads are then joined (see ``_destroy_at_exit``).
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
        self.num_processes_on_current_node = -1


global_context = GlobalContext()


# -- exit ------------------------------------------------------------------------------------------
# Why a process that never calls gpc.destroy() can abort at exit ("terminate called without an active
# exception", status 134), and why the group is destroyed by an exit handler:
#
# A gloo process group runs each collective on one of its worker threads. The worker drops its reference
# to the finished collective (the Work) only after it has marked it complete, so the main thread, which
# woke up on that completion and dropped its own reference, often leaves the worker with the last one:
# the Work is destroyed on the worker thread. A Work made during a backward pass (DDP's and FSDP's
# gradient reductions) keeps a copy of the thread-local state, which holds a Python object (the
# contextvars context that autograd stores while it runs), and a Work may hold tensors whose Python
# objects it keeps alive (broadcast_object_list, torch.distributed.checkpoint). Dropping those needs the
# GIL. If the script ends right then, the worker waits for the GIL while the main thread starts the
# interpreter's finalization; when it gets the GIL, CPython ends the thread (pthread_exit), and the
# unwinding passes through the Work's noexcept destructor, so the C++ runtime calls std::terminate.
# This is a race of a few milliseconds after the last collective, so it hits some runs and not others,
# and plain torch scripts that skip destroy_process_group() hit it too.
#
# An atexit handler still runs in a whole interpreter, before finalization. Destroying the group there
# frees it when nothing else holds it (the engines drop their DDP wrapper first): torch releases the GIL
# while it destroys the group, whose destructor joins the worker threads, so every pending drop is done
# before finalization starts. When something still holds the group (FSDP2 keeps it in the sharded
# module, ZeroRedundancyOptimizer and a DDP wrapper the script kept hold it too) the threads live on;
# the handler then releases the GIL until every worker thread sleeps, so a worker with a finished Work
# to drop gets the GIL while the interpreter is still whole.
_GLOO_WORKER_THREAD = "pt_gloo_runloop"  # the name torch gives a gloo group's worker threads
_exit_handler_registered = False


def destroy_group_at_exit() -> None:
    """Make the interpreter's exit destroy the group ``launch`` created, if the script has not (once per process)."""
    global _exit_handler_registered
    if not _exit_handler_registered:
        atexit.register(_destroy_at_exit)
        _exit_handler_registered = True


def _destroy_at_exit() -> None:
    if getattr(sys, "last_value", None) is not None:
        return  # an uncaught exception: a peer may never join a pending collective, so no teardown that could wait on it
    if global_context._owns_group and _dist_ready():  # not when the script called gpc.destroy() itself
        global_context.destroy()
    _let_gloo_workers_finish()  # also after the script's own gpc.destroy(): FSDP2 keeps the threads alive


def _gloo_worker_states() -> Optional[List[str]]:
    """The scheduler state (``R``, ``S``, ...) of each live gloo worker thread; None without Linux's /proc."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    states = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()  # "tid (name) state ..."
        except OSError:
            continue  # the thread ended meanwhile
        name_end = stat.rfind(")")
        if stat[stat.find("(") + 1:name_end] == _GLOO_WORKER_THREAD:
            states.append(stat[name_end + 2:name_end + 3])
    return states


def _let_gloo_workers_finish(limit_s: float = 1.0, step_s: float = 0.002) -> None:
    """Release the GIL until every gloo worker thread has slept through two checks in a row (at most ``limit_s``).

    A worker waiting for the GIL gets it while this thread sleeps, so one seen sleeping twice across a
    sleep of this thread is parked with nothing left to drop. Without /proc it waits ``limit_s`` / 10.
    """
    deadline = time.monotonic() + limit_s
    quiet = 0
    while time.monotonic() < deadline:
        time.sleep(step_s)
        states = _gloo_worker_states()
        if states is None:
            time.sleep(limit_s / 10)
            return
        quiet = quiet + 1 if all(state == "S" for state in states) else 0
        if quiet == 2:
            return
