"""FSDP2's collective buffers kept from step to step in host memory (ZeRO stage 3 on the CPU).

In every step FSDP2 allocates, per unit, the all-gather output (the unit's gathered parameters), the
reduce-scatter input (its unsharded gradients, flattened) and the reduce-scatter output (its sharded gradients,
which stay until the next ``zero_grad``). On the CPU these come from the C library's allocator, which either
hands them fresh pages in every step (page faults, zeroing) or puts them on its heap between long-lived blocks.
Here they are taken from buffers kept from step to step, through FSDP2's own hooks for a collective's memory
(``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``); the collectives themselves are the ones
FSDP2 calls by default.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn


def _held_elsewhere(buffer: torch.Tensor) -> bool:
    """True while anything besides the pool refers to the buffer's memory (a view given out: a gathered
    parameter, a gradient, a collective in flight).

    torch has no public count of a storage's holders: ``torch._C._storage_Use_Count`` is private
    (tests/engine/test_zero_host_buffers.py fails when it changes). The pool's own tensor is one holder, the
    storage object made to ask is the second.
    """
    return torch._C._storage_Use_Count(buffer.untyped_storage()._cdata) > 2


class HostBufferPool:
    """Buffers by (element count, dtype): a buffer no one else holds is handed out again, else a new one is made.

    FSDP2 asks for the same sizes in the same order every step, so after the first step no buffer is new; the pool
    holds as many buffers of a size as were in use at once.
    """

    def __init__(self):
        self._buffers: Dict[Tuple[int, torch.dtype], List[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        same = self._buffers.setdefault((numel, dtype), [])
        for buffer in same:
            if not _held_elsewhere(buffer):
                return buffer
        buffer = torch.empty(numel, dtype=dtype)
        same.append(buffer)
        return buffer

    def nbytes(self) -> int:
        """Bytes the pool holds (free and given out)."""
        return sum(b.numel() * b.element_size() for same in self._buffers.values() for b in same)


def _comm_classes():
    import torch.distributed as dist

    # FSDP2's interfaces for a collective's memory; torch exports them from no public module yet
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    # the collectives FSDP2 calls by default (named ``*_single`` in newer torch, ``*_tensor`` before), looked up at
    # each call as FSDP2 does, so that whatever wraps torch.distributed's functions sees these calls too
    all_gather = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    reduce_scatter = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"

    class Pooled:
        """A collective's memory from the pool (the part both interfaces share)."""

        def __init__(self, pool: HostBufferPool):
            self.pool = pool

        def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return self.pool.take(int(torch.Size(size).numel()), dtype).view(*size)

    class PooledAllGather(Pooled, AllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            return getattr(dist, all_gather)(output_tensor, input_tensor, group=group, async_op=async_op)

    class PooledReduceScatter(Pooled, ReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            return getattr(dist, reduce_scatter)(output=output_tensor, input=input_tensor, group=group, op=op,
                                                async_op=async_op)

    return PooledAllGather, PooledReduceScatter


def pool_collective_buffers(modules: Sequence[nn.Module]) -> Optional[HostBufferPool]:
    """Give every FSDP2 unit in ``modules`` one shared pool for its all-gather and reduce-scatter buffers; None
    (FSDP2 allocates them itself) with an older torch whose FSDP2 takes no custom collectives."""
    if not all(hasattr(module, "set_custom_all_gather") for module in modules):
        return None
    try:
        pooled_all_gather, pooled_reduce_scatter = _comm_classes()
    except ImportError:
        return None
    pool = HostBufferPool()
    all_gather, reduce_scatter = pooled_all_gather(pool), pooled_reduce_scatter(pool)
    for module in modules:
        module.set_custom_all_gather(all_gather)
        module.set_custom_reduce_scatter(reduce_scatter)
    return pool
