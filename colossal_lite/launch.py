"""``launch*``: validate the config, start the process group, pick the device, seed.

The config is validated completely before any process group starts.
"""
from __future__ import annotations

import argparse
import datetime
import os
import signal
import time
import uuid
import warnings
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .context.batch_size import resolve_batch_sizes
from .context.defaults import DEFAULTS
from .context.option_types import check_zero_world_size
from .context.validation import load_config
from .core.global_context import destroy_group_at_exit
from .core.global_context import global_context as gpc
from .logging import get_dist_logger

DEFAULT_TIMEOUT_S = float(DEFAULTS["dist_timeout"])


def get_default_parser() -> argparse.ArgumentParser:
    """The legacy command-line parser: --config --host --port --world_size --rank --local_rank --backend, and
    ``--set KEY=VALUE`` (repeatable) for config overrides: pass ``args.set`` as ``launch*(..., overrides=...)``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=str, help="path to the config file")
    parser.add_argument("--host", type=str, help="the master address for distributed training")
    parser.add_argument("--port", type=int, help="the master port for distributed training")
    parser.add_argument("--world_size", type=int, help="world size for distributed training")
    parser.add_argument("--rank", type=int, help="rank for the default process group")
    parser.add_argument("--local_rank", type=int, help="local rank on the node")
    parser.add_argument("--backend", type=str, default=None, help="nccl or gloo (default: nccl with CUDA, else gloo)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value (repeatable): dotted keys reach into dicts (fp16.mode=bf16, "
                             "zero.stage=2), values are Python literals, true/false/none/null in any case, or else plain "
                             "strings")
    return parser


def _init_method(host: str, port: int) -> str:
    host = str(host).strip()
    if ":" in host and not host.startswith("["):  # IPv6 literal
        host = f"[{host}]"
    return f"tcp://{host}:{int(port)}"


def launch(config, rank: int, world_size: int, host: str, port: int, backend: Optional[str] = None,
           local_rank: Optional[int] = None, seed: int = 1024, verbose: bool = True, timeout: Optional[float] = None,
           overrides: Optional[Sequence[str]] = None, device: Optional[str] = None):
    """Start ``world_size`` processes' group at ``host:port`` as ``rank``; returns ``gpc``.

    ``device``: ``'cpu'`` trains on the CPU even where CUDA is available, ``'cuda'`` insists on a GPU, None
    picks the GPU of the local rank when CUDA is available, else the CPU. ``backend=None`` picks nccl on a
    GPU, gloo on the CPU. ``timeout`` (seconds; default the config's ``dist_timeout`` or 300) bounds the
    wait for missing peers. ``overrides`` (``KEY=VALUE`` strings, as ``--set`` gives them) are applied to
    the config before it is checked.
    """
    cfg = load_config(config, overrides)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size): got rank={rank}, world_size={world_size}")
    resolve_batch_sizes(cfg, world_size)  # before any process group starts
    check_zero_world_size(cfg, world_size)
    on_gpu = _wants_gpu(device)
    backend = _backend_for(backend, on_gpu, world_size)
    if on_gpu:
        check_gpus_per_node(backend, int(os.environ.get("LOCAL_WORLD_SIZE") or 0), torch.cuda.device_count())
    timeout = float(timeout if timeout is not None else cfg.get("dist_timeout", DEFAULT_TIMEOUT_S))
    if local_rank is None:
        local_rank = rank % torch.cuda.device_count() if on_gpu else rank
    gpc.begin_launch(cfg, local_rank, verbose)
    device = gpc.set_device(local_rank) if on_gpu else gpc.use_cpu()

    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(f"a process group is already running with rank {dist.get_rank()} of {dist.get_world_size()}, "
                               f"but launch was asked for rank {rank} of {world_size}; call gpc.destroy() first")
    else:
        _start_group(backend, rank, world_size, host, port, timeout, device)
    gpc.finish_launch()
    gpc.detect_num_processes_on_current_node()
    gpc.set_seed(seed)
    if verbose:
        get_dist_logger().info(
            f"Distributed environment is initialized: world size {world_size}, data parallel size {world_size}, "
            f"backend {backend}, device {device}, seed {seed}", ranks=[0])
    return gpc


def _wants_gpu(device) -> bool:
    """Whether ``launch(device=...)`` puts this process on a GPU: 'cpu', 'cuda' or None (a GPU when there is one)."""
    kind = device.type if isinstance(device, torch.device) and device.index is None else device
    if kind not in (None, "cpu", "cuda"):
        raise ValueError(f"launch(device={device!r}): expected 'cpu', 'cuda' or None (the GPU of the local rank when "
                         f"CUDA is available, else the CPU). Each process takes the GPU of its local rank; to choose "
                         f"the GPUs, set CUDA_VISIBLE_DEVICES")
    if kind == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("launch(device='cuda'): torch.cuda.is_available() is False (no GPU, or a CPU build of "
                           "torch: `colossal-lite info` shows which). Fix: launch(..., device='cpu') or device=None")
    return kind == "cuda" or kind is None and torch.cuda.is_available()


def _backend_for(backend: Optional[str], on_gpu: bool, world_size: int) -> str:
    """The process group's backend: nccl on a GPU, gloo on the CPU, or the one asked for where it can work."""
    if backend is None:
        return "nccl" if on_gpu else "gloo"
    if backend != "nccl" or on_gpu:
        return backend
    where = "launch(device='cpu')" if torch.cuda.is_available() else "torch.cuda.is_available() is False"
    if world_size == 1:
        # one process exchanges nothing, so scripts that pass nccl by default (pytorch/examples' --dist-backend)
        # still run on a CPU machine
        warnings.warn(f"backend='nccl' needs GPUs, but this process trains on the CPU ({where}); with one process "
                      f"the backend carries nothing, so gloo is used instead. Pass backend='gloo' (or None) to "
                      f"silence this", UserWarning, stacklevel=3)
        return "gloo"
    raise RuntimeError(f"backend='nccl' needs GPUs, but the processes train on the CPU ({where}). Fix: "
                       f"backend='gloo' (or backend=None, which picks gloo on the CPU)")


def check_gpus_per_node(backend: str, local_processes: int, gpus: int) -> None:
    """NCCL gives each process a GPU of its own and refuses two processes on one; with more processes on the node
    than GPUs its own error comes from inside the group's start, where it reads like a network failure."""
    if backend == "nccl" and local_processes > gpus:
        raise RuntimeError(f"{local_processes} processes on this node, {gpus} GPU(s): NCCL needs a GPU for each "
                           f"process and refuses two on one. Fix: start at most {gpus} per node "
                           f"(torchrun --nproc_per_node {gpus}), or backend='gloo', which lets processes share a GPU "
                           f"(slower)")


def _start_group(backend: str, rank: int, world_size: int, host, port, timeout: float, device) -> None:
    """``init_process_group`` on the store ``host``/``port`` name; any failure leaves ``gpc`` as before launch."""
    kwargs = dict(backend=backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
    if backend == "nccl":
        kwargs["device_id"] = device
    if world_size == 1 and host is None:
        where = "an in-process store"
    elif host is None or port is None:
        raise ValueError("launch needs host and port (the master's address) when world_size > 1")
    elif _agent_store_serves(host, port):
        where = f"torchrun's store at {host}:{port}"
    else:
        where = kwargs["init_method"] = _init_method(host, port)
    # torch.distributed.nn.functional takes group.WORLD as a default argument, evaluated when it is first
    # imported (DDP imports it through torch._dynamo): imported after the group exists, it would hold the
    # group for good, and destroying the group could never free it and join its threads
    from torch.distributed.nn import functional  # noqa: F401
    try:
        if "init_method" not in kwargs:
            kwargs["store"] = (dist.HashStore() if host is None
                               else _attempt_store(host, port, rank, world_size, kwargs["timeout"]))
        dist.init_process_group(**kwargs)
    except Exception as e:
        gpc.destroy()  # no half-launched state: gpc answers as before launch
        raise RuntimeError(
            f"could not start the process group at {where} as rank {rank} of {world_size} within {timeout:g} s "
            f"({type(e).__name__}: {e}). Check that all {world_size} processes were started, that "
            f"MASTER_ADDR/MASTER_PORT (host/port) are the same for all of them and reachable, "
            f"or raise the limit with launch(..., timeout=SECONDS) or dist_timeout in the config") from e
    gpc.own_group()
    destroy_group_at_exit()


def _agent_store_serves(host: str, port: int) -> bool:
    """True when ``host:port`` is the store torchrun's agent keeps for its workers (``TORCHELASTIC_USE_AGENT_STORE``)."""
    return (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and os.environ.get("MASTER_ADDR") == str(host)
            and os.environ.get("MASTER_PORT") == str(port))


# torchrun's agent keeps its store for the whole job, across the restarts of --max-restarts, so a restarted
# worker could read the gloo/nccl addresses of the killed attempt there. Each attempt therefore starts its
# group under a prefix of its own. TORCHELASTIC_RESTART_COUNT cannot name it: each agent counts only the
# restarts its own workers' failure caused, and an agent whose workers were stopped because another node's
# failed (a membership change) does not count that restart, so nodes disagree. Rank 0 makes up the name,
# and every other rank learns it by a hello carrying a fresh random word that only this attempt's rank 0
# can answer (the workers of earlier attempts were all stopped before this one started).
_ATTEMPT_KEYS = "colossal_lite/attempt"


def _attempt_store(host: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """This attempt's own part of torchrun's store, the same on every rank of every node."""
    store = dist.TCPStore(host, int(port), world_size, is_master=False, timeout=timeout)
    if rank == 0:
        name = uuid.uuid4().hex
        _welcome_every_rank(store, name, world_size, time.monotonic() + timeout.total_seconds())
    else:
        hello = uuid.uuid4().hex
        store.set(f"{_ATTEMPT_KEYS}/hello{rank}", hello)
        name = store.get(f"{_ATTEMPT_KEYS}/welcome{rank}/{hello}").decode()  # waits up to the timeout
        store.set(f"{_ATTEMPT_KEYS}/{name}/joined{rank}", b"")
    return dist.PrefixStore(f"{_ATTEMPT_KEYS}/{name}", store)


def _welcome_every_rank(store: dist.Store, name: str, world_size: int, deadline: float) -> None:
    """Answer each rank's latest hello with ``name`` until every rank has joined under it.

    A hello read here may be a killed attempt's, left in the store: its answer is never read, and the
    rank's fresh hello, once written, is answered on a later pass.
    """
    pending = list(range(1, world_size))
    while pending:
        for r in pending:
            hello = store.get(f"{_ATTEMPT_KEYS}/hello{r}").decode()  # waits until rank r has said hello once
            store.set(f"{_ATTEMPT_KEYS}/welcome{r}/{hello}", name)
        time.sleep(0.01)
        pending = [r for r in pending if not store.check([f"{_ATTEMPT_KEYS}/{name}/joined{r}"])]
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"ranks {pending} did not join this attempt's process group")


def launch_from_torch(config, backend: Optional[str] = None, seed: int = 1024, verbose: bool = True,
                      timeout: Optional[float] = None, overrides: Optional[Sequence[str]] = None,
                      device: Optional[str] = None):
    """Launch from the variables ``torch.distributed.run`` sets (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT).

    Run as a plain ``python script.py`` (no such variables) it launches a single process. ``device='cpu'`` trains
    on the CPU on a machine with GPUs (see ``launch``).
    """
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    # MASTER_ADDR/MASTER_PORT alone (often exported cluster-wide) do not make this a torchrun process
    if not any(n in os.environ for n in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        config = load_config(config, overrides)  # validate (and read the file) once, before the note
        if verbose:
            get_dist_logger().info("No torchrun environment found (RANK, WORLD_SIZE, ...): running as a single process. "
                                   "Use `python -m torch.distributed.run --nproc_per_node N script.py` for N processes.",
                                   ranks=[0])
        return launch(config, rank=0, world_size=1, host=None, port=None, backend=backend, local_rank=0,
                      seed=seed, verbose=verbose, timeout=timeout, device=device)
    missing = [n for n in names if n not in os.environ]
    if missing:
        raise RuntimeError(f"launch_from_torch: the torchrun environment is incomplete, missing {', '.join(missing)}. "
                           f"Start the script with `python -m torch.distributed.run --nproc_per_node N script.py`")
    return launch(config, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                  host=os.environ["MASTER_ADDR"], port=int(os.environ["MASTER_PORT"]), backend=backend,
                  local_rank=int(os.environ["LOCAL_RANK"]), seed=seed, verbose=verbose, timeout=timeout,
                  overrides=overrides, device=device)


def under_torchrun() -> bool:
    """True in a worker process started by ``python -m torch.distributed.run`` (its agent sets TORCHELASTIC_RUN_ID)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def preemption_exit_note(signum: int, status: int) -> str:
    """How a run stopped by ``signum`` ends and how to continue it (the end of the Trainer's stop line).

    torchrun starts each worker in a session of its own, so a terminal's Ctrl-C reaches only torchrun's agent,
    which forwards it to the workers as SIGINT, waits for them (30 s, ``--shutdown-timeout``), then re-raises
    it as ``SignalException``: a traceback and exit status 1 whatever the workers' status. A signal sent to
    the workers alone ends them with ``status``, which torchrun turns into a restart with ``--max-restarts``
    and otherwise into a failed job (exit status 1).
    """
    resume = "with fit(..., resume_from='auto') to continue"
    if not under_torchrun():
        return f"exiting with status {status}. Run again {resume}"
    if signum == signal.SIGINT:
        return (f"the workers exit with status {status}, and torchrun, which got the Ctrl-C too, then ends with a "
                f"SignalException traceback and status 1. Run the same command again {resume}")
    return (f"the workers exit with status {status}: torchrun started with --max-restarts restarts them, otherwise it "
            f"ends with status 1 (after a SignalException traceback if it got the signal too). "
            f"Run the same command again {resume}")


def _launch_from_env(kind: str, config, host, port, rank_var, size_var, local_var, backend, seed, verbose, timeout,
                     overrides, device):
    try:
        rank, world_size = int(os.environ[rank_var]), int(os.environ[size_var])
    except KeyError as e:
        raise RuntimeError(f"Could not find {e} in the {kind} environment; start the script with the {kind} launcher "
                           f"or use launch_from_torch with torchrun") from None
    local_rank = int(os.environ[local_var]) if local_var and local_var in os.environ else None
    return launch(config, rank=rank, world_size=world_size, host=host, port=port, backend=backend,
                  local_rank=local_rank, seed=seed, verbose=verbose, timeout=timeout, overrides=overrides,
                  device=device)


def launch_from_slurm(config, host: str, port: int, backend: Optional[str] = None, seed: int = 1024,
                      verbose: bool = True, timeout: Optional[float] = None, overrides: Optional[Sequence[str]] = None,
                      device: Optional[str] = None):
    """Launch from SLURM's SLURM_PROCID / SLURM_NPROCS (and SLURM_LOCALID when set)."""
    return _launch_from_env("SLURM", config, host, port, "SLURM_PROCID", "SLURM_NPROCS", "SLURM_LOCALID",
                            backend, seed, verbose, timeout, overrides, device)


def launch_from_openmpi(config, host: str, port: int, backend: Optional[str] = None, seed: int = 1024,
                        verbose: bool = True, timeout: Optional[float] = None,
                        overrides: Optional[Sequence[str]] = None, device: Optional[str] = None):
    """Launch from OpenMPI's OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK."""
    return _launch_from_env("OpenMPI", config, host, port, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                            "OMPI_COMM_WORLD_LOCAL_RANK", backend, seed, verbose, timeout, overrides, device)


__all__ = ["launch", "launch_from_torch", "launch_from_slurm", "launch_from_openmpi", "get_default_parser",
           "load_config", "under_torchrun"]
