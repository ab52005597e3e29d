"""ZeRO through PyTorch's own sharding: stage 1 = ZeroRedundancyOptimizer over DDP,
stages 2 and 3 = FSDP2 (``torch.distributed.fsdp.fully_shard``). No home-made sharding.
"""
from __future__ import annotations

import contextlib
import ctypes
import inspect
import os
import platform
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint.model_state import check_model_state
from ..core.dist import broadcast_object, is_rank_0
from .fsdp_units import block_units, statistics_norms
from .host_buffers import HostBufferPool, pool_collective_buffers
from .strategy import DDPStrategy, SingleProcess

# glibc mallopt parameters (malloc.h) and the size from which freed host memory goes straight back to the system
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
LARGE_ALLOCATION_BYTES = 1 << 20
_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_malloc_tuned = False


def return_large_frees_to_the_system() -> bool:
    """Make glibc map host allocations of ``LARGE_ALLOCATION_BYTES`` or more on their own and unmap them when freed.

    On the CPU, ZeRO stages 2 and 3 allocate and free large buffers of many sizes in every step (FSDP2: each unit's
    gathered parameters, the collectives' inputs and outputs, the unsharded gradients) between long-lived ones
    (sharded gradients, optimizer state). glibc's default raises
    its mmap threshold to the largest block freed so far, so these buffers come from the heap, whose holes (pinned
    by small allocations) are not returned: resident memory grows step after step and its peak ends above DDP's.
    A fixed threshold keeps the peak at the live tensors, at the price of fresh pages (page faults) for those
    buffers in every step, paid by every buffer of that size (a convolution network's too). The heap that grows is
    the main thread's (the collectives' threads keep small arenas of their own, so capping the arenas changes
    nothing), and handing its free pages back after the step (``malloc_trim``) does not lower the peak, which is
    reached inside the step. A fixed trim threshold alone also fixes the mmap threshold, at glibc's small
    starting value. Process-wide and once; nothing is changed when the user set glibc's own variables for it
    (their choice wins), or on another C library. Returns True when the setting is in force.
    """
    global _malloc_tuned
    if _malloc_tuned:
        return True
    if any(v in os.environ for v in _MALLOC_ENV) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)  # the process's own symbols, glibc's among them: no search for the library's file
    ok = libc.mallopt(_M_MMAP_THRESHOLD, LARGE_ALLOCATION_BYTES) == 1
    # the trim threshold is fixed too: glibc had raised it along with the mmap threshold (to twice that)
    ok = libc.mallopt(_M_TRIM_THRESHOLD, 2 * LARGE_ALLOCATION_BYTES) == 1 and ok
    _malloc_tuned = ok
    return ok


def ranks_mesh(model: nn.Module):
    """All ranks as a one-dimensional device mesh of the model's device type. Without one, FSDP2 builds a mesh for
    the machine's accelerator and moves the parameters there: a run launched with ``device='cpu'`` on a machine
    with GPUs would have every rank's model put on the first GPU while the engine feeds it host tensors."""
    from torch.distributed.device_mesh import init_device_mesh

    device_type = next((p.device.type for p in model.parameters()), "cpu")
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _on_cpu(model: nn.Module) -> bool:
    """True when training runs in host memory (with a GPU, the per-step buffers are device memory)."""
    return any(p.device.type == "cpu" for p in model.parameters())


def _require_unstepped(optimizer: torch.optim.Optimizer, stage: int):
    """ZeRO re-points the optimizer at sharded parameters; state it already holds would belong to the old ones."""
    if any(state for state in optimizer.state.values()):
        raise ValueError(f"zero stage {stage}: the optimizer passed to initialize() has already taken a step, so it "
                         f"holds state (e.g. momentum) for the unsharded parameters. Fix: pass an optimizer that has "
                         f"not stepped yet, and load a checkpoint after initialize() to resume")


@contextlib.contextmanager
def _read_as_it_is(optimizer: torch.optim.Optimizer):
    """Around torch's state-dict reads of ``optimizer``: they make the state of an optimizer that has none and no
    gradients by stepping it at learning rate 0, which changes what is read (Adam's step count one ahead of the
    updates applied, and the engine's update count, kept by a step hook). An optimizer that has taken no step is
    read as it is, its groups and no per-parameter state: one parameter holds a zero gradient for the read, which
    is what tells torch that the optimizer has been stepped before."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if optimizer.state or not params or any(p.grad is not None for p in params):
        yield
        return
    params[0].grad = torch.zeros_like(params[0])
    try:
        yield
    finally:
        params[0].grad = None


def _group_param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> List[List[str]]:
    """Each param group's parameters by name in ``model`` (names survive sharding; tensors do not)."""
    names = {id(p): n for n, p in model.named_parameters()}
    missing = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in names]
    if missing:
        raise ValueError(f"zero: {len(missing)} of the optimizer's parameters are not parameters of the model; "
                         f"build the optimizer from model.parameters()")
    return [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def _point_groups_at(model: nn.Module, optimizer: torch.optim.Optimizer, group_names: List[List[str]]):
    """Swap the parameters in the optimizer's own param groups for the model's (now sharded) ones of the same names.

    The optimizer object, its group dicts and their hyper-parameters stay, so an LR scheduler built on it before
    ``initialize`` keeps driving it, and the unsharded parameters are no longer referenced (their memory is freed).
    """
    params = dict(model.named_parameters())
    for group, names in zip(optimizer.param_groups, group_names):
        group["params"] = [params[n] for n in names]
    optimizer.state.clear()  # no entries are kept for the replaced tensors (all empty: nothing has stepped)


def _constructor_defaults(optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's constructor arguments (``defaults``), without keys its constructor does not take."""
    params = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in params}


class ZeroStage1Strategy(DDPStrategy):
    """Optimizer state sharded across ranks (``ZeroRedundancyOptimizer``), gradients all-reduced by DDP."""

    name = "ZeRO stage 1 (ZeroRedundancyOptimizer over DDP)"
    takes_closures = False

    def __init__(self, **ddp_kwargs):
        # gradients as views of DDP's all-reduce buckets: one copy of the gradients per rank instead of two
        super().__init__(**{"gradient_as_bucket_view": True, **ddp_kwargs})

    def setup(self, model, optimizer):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        # No allocator setting for stage 1 (stages 2 and 3 make one): its gradients live in DDP's buckets from step
        # to step, so no gradient-sized buffers are freed between long-lived ones, and under glibc's own thresholds
        # its peak memory stays below its target and flat (benchmarks/RESULTS.md), without the setting's cost.
        _require_unstepped(optimizer, 1)
        # Built over the user's own group dicts (with their per-group hyper-parameters and scheduler keys such as
        # initial_lr), and sharing their list: an LR scheduler on the user's optimizer writes the LRs that the ZeRO
        # optimizer copies into its shard's optimizer at every step.
        zero = ZeroRedundancyOptimizer(optimizer.param_groups, optimizer_class=type(optimizer),
                                       **_constructor_defaults(optimizer))
        zero.param_groups = optimizer.param_groups
        if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
            # torch's scheduler warns "lr_scheduler.step() before optimizer.step()" when the optimizer it was built
            # on never steps itself; here the ZeRO optimizer steps for it
            optimizer._opt_called = True
        model, _ = super().setup(model, zero)
        return model, zero

    def optimizer_state_dict(self, model, optimizer) -> dict:
        """The whole optimizer state, gathered from the shards and sent to every rank (a collective)."""
        optimizer.consolidate_state_dict(to=0)
        if any(p.device.type == "cuda" for p in model.parameters()):
            # torch copies each shard to the host with non_blocking=True and does not wait: the copies must have
            # landed before the state is pickled
            torch.cuda.synchronize()
        return broadcast_object(optimizer.state_dict() if is_rank_0() else None)

    def load_optimizer_state_dict(self, model, optimizer, state: dict):
        """The whole state into the ZeRO optimizer (each rank keeps its shard's), the user's group dicts still the
        ones it reads: torch's ``load_state_dict`` puts new group dicts in place, which an LR scheduler on the user's
        optimizer no longer writes (the learning rate stayed at the checkpoint's from the resume on)."""
        shared = optimizer.param_groups
        super().load_optimizer_state_dict(model, optimizer, state)
        for mine, loaded in zip(shared, optimizer.param_groups):
            mine.update({key: value for key, value in loaded.items() if key != "params"})
        optimizer.param_groups = shared


class FSDPStrategy(SingleProcess):
    """FSDP2: gradients and optimizer state sharded (stage 2), parameters too (stage 3)."""

    shards_state = True
    data_parallel = True
    takes_closures = False

    def __init__(self, stage: int = 3, shard_modules: Optional[Sequence[str]] = None, offload_optimizer: bool = False,
                 reshard_after_forward: Optional[bool] = None, param_dtype: Optional[torch.dtype] = None):
        self.stage = stage
        self.shard_modules = list(shard_modules) if shard_modules else None
        self.offload = offload_optimizer
        # stage 3 frees each unit's gathered parameters after its forward and gathers them again for its backward
        # (parameter memory of one unit at a time); stage 2 keeps them to the backward, one all-gather per unit
        self.reshard = (stage == 3) if reshard_after_forward is None else reshard_after_forward
        self.param_dtype = param_dtype
        self.name = f"ZeRO stage {stage} (FSDP2 fully_shard)"
        self._root: Optional[nn.Module] = None
        self._mesh = None  # the ranks, on the model's device type (FSDP2's default is the machine's accelerator)
        self.host_buffers: Optional[HostBufferPool] = None  # stage 3 on the CPU: the collectives' buffers, kept
        self._sync = True  # FSDP2's own default: gradients are reduce-scattered in every backward

    def setup(self, model, optimizer):
        from torch.distributed.fsdp import fully_shard

        _require_unstepped(optimizer, self.stage)
        on_cpu = _on_cpu(model)
        if on_cpu:
            return_large_frees_to_the_system()
        group_names = _group_param_names(model, optimizer)
        self._mesh = ranks_mesh(model)
        units = block_units(model, self.shard_modules)
        norms = statistics_norms(model) if self.param_dtype is not None else []
        if norms:  # one full-precision unit for all of them, sharded first so the blocks leave their parameters
            fully_shard(norms, **self._shard_options(None))
            units = [u for u in units if not any(u is n for n in norms)]
        for unit in units:
            fully_shard(unit, **self._shard_options(self.param_dtype))
        fully_shard(model, **self._shard_options(self.param_dtype))
        if on_cpu and self.reshard is True:
            # Stage 3 only (each unit resharded after its forward): there the kept buffers cost little peak memory
            # and save the most fresh pages. Under stage 2 they raised the peak to the edge of its target
            # (benchmarks/RESULTS.md). With a GPU the buffers come from torch's own caching allocator.
            self.host_buffers = pool_collective_buffers(norms[:1] + units + [model])
        self._root = model
        _point_groups_at(model, optimizer, group_names)
        return model, optimizer

    def _shard_options(self, param_dtype: Optional[torch.dtype]) -> dict:
        """``fully_shard`` keyword arguments: parameters gathered in ``param_dtype`` (None: as stored, fp32),
        gradients always reduced in fp32."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        reduce_dtype = torch.float32 if param_dtype is not None else None
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if self.offload else OffloadPolicy()
        return dict(mesh=self._mesh, reshard_after_forward=self.reshard, offload_policy=offload,
                    mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype))

    def set_gradient_sync(self, model, sync):
        # FSDP2 reads the flag in its post-backward hooks; setting it walks every module, so only on a change
        if sync != self._sync:
            self.unwrap(model).set_requires_gradient_sync(sync)
            self._sync = sync

    def sync_buffers_at_next_forward(self, model):
        # FSDP2 leaves each rank its own buffers (BatchNorm's statistics, updated from its own batches); an
        # evaluation is of rank 0's model, whose buffers the checkpoints keep: they are brought now (buffers are
        # not sharded, and every rank calls this alike)
        with torch.no_grad():
            for buffer in self.unwrap(model).buffers():
                dist.broadcast(buffer, src=0)

    @staticmethod
    def unwrap(model):
        inner = getattr(model, "_orig_mod", None)  # torch.compile around the FSDP2 module
        return inner if isinstance(inner, nn.Module) else model

    @staticmethod
    def _full_options():
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, cpu_offload=False)

    def model_state_dict(self, model) -> dict:
        """The full (unsharded) model state on every rank (a collective)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {k: v.detach().clone() for k, v in get_model_state_dict(model, options=self._full_options()).items()}

    def load_model_state_dict(self, model, state, strict=True):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        check_model_state(model.state_dict(), state, strict)  # DTensors report their global shapes
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=strict))

    def sharded_state_dict(self, model, optimizer, as_it_is: bool = False) -> dict:
        """This rank's shards of the model and optimizer state, also the template a checkpoint is loaded into: an
        optimizer without state gets it made (torch steps it at learning rate 0), for the checkpoint's to fill.
        ``as_it_is`` (what a save reads): the optimizer is read as it is, never stepped."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        with _read_as_it_is(optimizer) if as_it_is else contextlib.nullcontext():
            model_state, optim_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optimizer": optim_state}

    def load_sharded_state_dict(self, model, optimizer, state):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        set_model_state_dict(model, state["model"])
        # a parameter the saved optimizer held no state for (one unused in the forward, or every one before the
        # first applied update) is loaded without state, as it was saved; the model's keys stay checked
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=StateDictOptions(strict=False))

    def optimizer_state_dict(self, model, optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        with _read_as_it_is(optimizer):
            return get_optimizer_state_dict(model, optimizer, options=self._full_options())

    def load_optimizer_state_dict(self, model, optimizer, state):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        try:  # (strict=False: a parameter without saved state stays without, as in load_sharded_state_dict)
            set_optimizer_state_dict(model, optimizer, state,
                                     options=StateDictOptions(full_state_dict=True, strict=False))
        except KeyError as error:  # torch matches the saved groups' keys to this optimizer's, and names only the key
            key = str(error.args[0]) if error.args else ""
            missing = key.rsplit(".", 1)[-1]
            hint = (" (an LR scheduler adds it to the optimizer's groups: build the scheduler before loading, as the "
                    "run that saved it did)" if missing == "initial_lr" else "")
            raise KeyError(f"the saved optimizer state has the parameter-group key {missing!r}, which this optimizer's "
                           f"groups lack{hint}") from error
        # torch's loader keeps the state it made (stepping at learning rate 0) for a parameter the saved state has
        # none for: it goes, as it was saved
        saved = set(state.get("state") or {})
        if all(isinstance(name, str) for name in saved):  # (keyed by parameter name, as torch's full state dict is)
            for name, param in self.unwrap(model).named_parameters():
                if name not in saved:
                    optimizer.state.pop(param, None)
