"""ZeRO through PyTorch's own sharding: stage 1 = ZeroRedundancyOptimizer over DDP,
stages 2 and 3 = FSDP2 (``torch.distributed.fsdp.fully_shard``). No home-made sharding.
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .strategy import DDPStrategy, SingleProcess


def _param_names(model: nn.Module) -> Dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _groups_by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> List[dict]:
    """The optimizer's param groups with parameters replaced by their names (to rebuild after wrapping)."""
    names = _param_names(model)
    groups = []
    for g in optimizer.param_groups:
        group = {k: v for k, v in g.items() if k != "params"}
        group["params"] = [names[id(p)] for p in g["params"]]
        groups.append(group)
    return groups


def _rebuild_groups(model: nn.Module, groups: List[dict]) -> List[dict]:
    params = dict(model.named_parameters())
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [params[n] for n in g["params"]]} for g in groups]


class ZeroStage1Strategy(DDPStrategy):
    """Optimizer state sharded across ranks (``ZeroRedundancyOptimizer``), gradients all-reduced by DDP."""

    name = "ZeRO stage 1 (ZeroRedundancyOptimizer over DDP)"

    def setup(self, model, optimizer):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if optimizer.state:
            raise ValueError("zero stage 1 rebuilds the optimizer; pass one that has not stepped yet")
        groups = optimizer.param_groups
        first = {k: v for k, v in groups[0].items() if k != "params"}
        zero = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=type(optimizer), **first)
        for g in groups[1:]:
            zero.add_param_group(dict(g))
        model, _ = super().setup(model, zero)
        return model, zero

    def optimizer_state_dict(self, model, optimizer) -> dict:
        """The whole optimizer state, gathered from the shards and sent to every rank (a collective)."""
        optimizer.consolidate_state_dict(to=0)
        state = [optimizer.state_dict() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(state, src=0)
        return state[0]


def default_shard_modules(model: nn.Module) -> List[nn.Module]:
    """Sharding units when none are named: the children of the largest ``nn.ModuleList``/``Sequential`` (the
    repeated blocks), else the direct children that hold parameters."""
    best: Optional[Sequence[nn.Module]] = None
    for m in model.modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1:
            if best is None or len(m) > len(best):
                best = m
    units = list(best) if best is not None else list(model.children())
    return [u for u in units if any(True for _ in u.parameters())]


class FSDPStrategy(SingleProcess):
    """FSDP2: gradients and optimizer state sharded (stage 2), parameters too (stage 3)."""

    shards_gradients = True

    def __init__(self, stage: int = 3, shard_modules: Optional[Sequence[str]] = None, offload_optimizer: bool = False,
                 reshard_after_forward: Optional[bool] = None, param_dtype: Optional[torch.dtype] = None):
        self.stage = stage
        self.shard_modules = list(shard_modules) if shard_modules else None
        self.offload = offload_optimizer
        self.reshard = (stage == 3) if reshard_after_forward is None else reshard_after_forward
        self.param_dtype = param_dtype
        self.name = f"ZeRO stage {stage} (FSDP2 fully_shard)"
        self._root: Optional[nn.Module] = None

    def setup(self, model, optimizer):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        groups = _groups_by_name(model, optimizer)
        kwargs = dict(reshard_after_forward=self.reshard,
                      mp_policy=MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32
                                                     if self.param_dtype is not None else None),
                      offload_policy=CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if self.offload else OffloadPolicy())
        if self.shard_modules:
            wanted = set(self.shard_modules)
            units = [m for m in model.modules() if type(m).__name__ in wanted and m is not model]
            found = {type(m).__name__ for m in units}
            missing = wanted - found
            if missing:
                present = sorted({type(m).__name__ for m in model.modules()})
                raise ValueError(f"zero.shard_modules names {sorted(missing)}, which are not module classes of the model; "
                                 f"the model has: {', '.join(present)}")
        else:
            units = default_shard_modules(model)
        for unit in units:
            fully_shard(unit, **kwargs)
        fully_shard(model, **kwargs)
        self._root = model
        optimizer = type(optimizer)(_rebuild_groups(model, groups), **optimizer.defaults)
        return model, optimizer

    @contextlib.contextmanager
    def _no_sync(self, model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def no_sync(self, model):
        return self._no_sync(model)

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

        from ..utils.checkpointing import check_model_state

        check_model_state(model.state_dict(), state, strict)  # DTensors report their global shapes
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=strict))

    def sharded_state_dict(self, model, optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optimizer": optim_state}

    def load_sharded_state_dict(self, model, optimizer, state):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    def optimizer_state_dict(self, model, optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer, options=self._full_options())

    def load_optimizer_state_dict(self, model, optimizer, state):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
