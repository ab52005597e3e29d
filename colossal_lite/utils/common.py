"""Small helpers kept from the legacy ``colossalai.utils``."""
from __future__ import annotations

import contextlib
import socket

import torch
import torch.distributed as dist
from torch import nn

from ..context.parallel_mode import ParallelMode
from ..core.dist import is_distributed, is_rank_0, log_rank_0, world_size
from ..core.global_context import global_context as gpc
from ..engine.strategy import broadcast_module, clip_grad_norm_


def get_current_device() -> torch.device:
    """The device this process trains on: ``cuda:LOCAL_RANK`` after launch with CUDA, else CPU."""
    return gpc.device


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def print_rank_0(msg, logger=None):
    """Print (or log) ``msg`` on global rank 0 only."""
    if logger is not None:
        log_rank_0(logger, msg)
    elif is_rank_0():
        print(msg, flush=True)


def is_using_ddp() -> bool:
    return world_size() > 1


def is_using_pp() -> bool:
    return False


def is_using_sequence() -> bool:
    return False


def is_dp_rank_0() -> bool:
    return is_rank_0()


def is_tp_rank_0() -> bool:
    return True


def is_no_pp_or_last_stage() -> bool:
    return True


def sync_model_param(model: nn.Module, parallel_mode: ParallelMode = ParallelMode.DATA):
    """Broadcast parameters and buffers from rank 0 to every rank."""
    broadcast_module(model)


def conditional_context(context_manager, enable: bool = True):
    return context_manager if enable else contextlib.nullcontext()


def clip_grad_norm_fp32(parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients to a global norm; returns the total norm as a device tensor."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    return clip_grad_norm_(parameters, max_norm, norm_type)


def barrier():
    if is_distributed():
        dist.barrier()
