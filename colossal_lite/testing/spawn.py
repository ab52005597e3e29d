"""``spawn``: run a test function in N fresh processes that form one distributed job, as legacy tests do.

The processes are started with the ``spawn`` method, like legacy's ``torch.multiprocessing.spawn``, so no
thread or lock of the test runner is copied into them. A function defined in a test module that pytest
imported by path (``--import-mode=importlib``) is not importable by name in a new interpreter, so it travels
as its module's file and qualified name and the child loads that file.
"""
from __future__ import annotations

import faulthandler
import functools
import importlib
import importlib.util
import os
import signal
import sys
import time
from typing import Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from ..core.global_context import global_context as gpc
from ..utils.common import free_port

DEFAULT_TIMEOUT_S = 240.0  # below pytest-timeout's 300 s in this project, so spawn's own message is the one seen


class _FunctionRef:
    """A module-level function named by its module (and that module's file) and its qualified name."""

    def __init__(self, func: Callable):
        self.module = func.__module__
        self.qualname = func.__qualname__
        self.file = getattr(sys.modules.get(self.module), "__file__", None)

    def resolve(self) -> Callable:
        module = sys.modules.get(self.module)
        if module is None or not self._is_ours(module):
            module = self._import()
        obj = module
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return obj

    def _is_ours(self, module) -> bool:
        """The module of this name is the file the function came from (not another module of the same name)."""
        return self.file is None or os.path.abspath(getattr(module, "__file__", "") or "") == os.path.abspath(self.file)

    def _import(self):
        try:
            module = importlib.import_module(self.module)
            if self._is_ours(module):
                return module
        except ImportError:
            if self.file is None:
                raise
        return _load_file(self.module, self.file)


def _load_file(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _portable(func: Callable):
    """What to send to the children for ``func``: itself, or a reference when its module is found by file only."""
    if isinstance(func, functools.partial):
        return functools.partial(_portable(func.func), *func.args, **func.keywords)
    named = getattr(func, "__module__", None) not in (None, "__main__") and "<locals>" not in getattr(
        func, "__qualname__", "<locals>")
    return _FunctionRef(func) if named else func


def _call(target, *args, **kwargs):
    if isinstance(target, functools.partial):
        return _call(target.func, *target.args, *args, **{**target.keywords, **kwargs})
    func = target.resolve() if isinstance(target, _FunctionRef) else target
    return func(*args, **kwargs)


def _child(rank: int, target, world_size: int, port: int, kwargs: dict):
    """One rank: the environment a launcher would set, then ``func(rank, world_size=, port=, **kwargs)``."""
    for key in [k for k in os.environ if k.startswith("TORCHELASTIC_")]:
        del os.environ[key]  # a test run under torchrun: these ranks are not its agent's workers
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks for stacks before a timeout kill
    _call(target, rank, world_size=world_size, port=port, **kwargs)
    # a finished rank leaves no group behind (a failed one exits without waiting for peers)
    gpc.destroy()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def spawn(func: Callable, nprocs: int = 1, *, timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs):
    """Run ``func(rank, world_size=nprocs, port=PORT, **kwargs)`` in ``nprocs`` new processes; wait for all.

    Each process has RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT (a port free when
    ``spawn`` was called) set, so ``launch(..., host='127.0.0.1', port=port)`` and ``launch_from_torch`` both
    work. A process that raises fails the call with ``torch.multiprocessing.ProcessRaisedException`` carrying its
    traceback (the others are stopped). After ``timeout_s`` seconds every process prints its Python stacks to
    stderr, is stopped, and ``TimeoutError`` is raised.
    """
    if nprocs < 1:
        raise ValueError(f"spawn(nprocs={nprocs}): at least one process is needed")
    port = free_port()
    context = mp.start_processes(_child, args=(_portable(func), nprocs, port, kwargs), nprocs=nprocs, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(0.05, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                running = [rank for rank, p in enumerate(context.processes) if p.is_alive()]
                _dump_stacks(context.processes)
                raise TimeoutError(
                    f"spawn({getattr(func, '__name__', func)!r}, nprocs={nprocs}): rank(s) {running} still running after "
                    f"{timeout_s:g} s (their Python stacks are printed above); a rank waiting in a collective that "
                    f"another rank never reached looks like this. Raise the limit with spawn(..., timeout_s=SECONDS)")
    finally:
        _stop(context.processes)


def _dump_stacks(processes):
    for p in processes:
        if p.is_alive():
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    time.sleep(0.5)  # faulthandler writes from a signal handler; give it a moment before the kill


def _stop(processes):
    """Terminate, then kill, any process still alive, and reap them all."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
