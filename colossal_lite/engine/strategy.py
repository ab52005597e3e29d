"""Data-parallel strategies: how the model is wrapped and how gradients meet.

``SingleProcess`` (world size 1), ``DDPStrategy`` (torch DistributedDataParallel),
``AllReduceStrategy`` (bucketed gradient all-reduce in ``engine.step``, the legacy
``DataParallelGradientHandler``), ``HandlerStrategy`` (the config's gradient handlers, built from the
``GRADIENT_HANDLER`` registry, called in ``engine.step``). Each gives ``setup``, ``set_gradient_sync`` (and the
``no_sync`` context built on it), ``reduce_gradients``, ``clip_grad_norm_`` and ``unwrap``.
"""
from __future__ import annotations

import contextlib
import re
from typing import Any, Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint.model_state import load_model_state, unwrap_module
from ..context.hints import py
from ..core.dist import all_reduce_sum_, world_size
from ..registry import GRADIENT_HANDLER


def broadcast_module(module: nn.Module, src: int = 0):
    """Make every rank hold rank ``src``'s parameters and buffers."""
    if world_size() == 1:
        return
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=src)


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip to global ``norm_type`` norm ``max_norm`` (0 = only measure); returns the norm as a plain device
    tensor, no host sync. Sharded (DTensor) gradients give the global norm over all shards."""
    if max_norm > 0:  # torch skips parameters without a gradient (the norm of none is 0)
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None], norm_type=norm_type)
    if type(norm) is torch.Tensor or not hasattr(norm, "full_tensor"):
        return norm
    return norm.full_tensor()  # a DTensor (sharded gradients): the global norm


class SingleProcess:
    name = "single process"
    shards_state = False  # True where each rank holds only a shard of the parameters, gradients and optimizer state
    data_parallel = False  # the ranks train one model on their shares of each batch
    takes_closures = True  # an optimizer's closure (LBFGS) can run through it: each rank steps every parameter

    def setup(self, model: nn.Module, optimizer):
        return model, optimizer

    def set_gradient_sync(self, model: nn.Module, sync: bool) -> None:
        """Whether the coming backward synchronises gradients across ranks; set before the forward, where DDP
        decides it. Strategies that reduce in ``reduce_gradients`` have nothing to decide."""

    def sync_buffers_at_next_forward(self, model: nn.Module) -> None:
        """The next forward brings the ranks' buffers (BatchNorm's statistics) together, where data parallelism
        does so; every rank calls it alike. Strategies that do not sync buffers have nothing to do."""

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module):
        """Forward and backward inside do not synchronise gradients (torch's ``DistributedDataParallel.no_sync``)."""
        self.set_gradient_sync(model, False)
        try:
            yield
        finally:
            self.set_gradient_sync(model, True)

    def reduce_gradients(self, model: nn.Module):
        pass

    def mean_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` averaged over the data-parallel ranks (a collective where they are several: every rank calls
        it); itself where each process trains alone."""
        if not self.data_parallel:
            return value
        return all_reduce_sum_(value.clone()) / world_size()

    def explain(self, model: nn.Module, error: RuntimeError) -> Optional[RuntimeError]:
        """An error of the forward said in the config's words, with the fix; None: leave it as it is."""
        return None

    def clip_grad_norm_(self, parameters, max_norm: float) -> torch.Tensor:
        return clip_grad_norm_(parameters, max_norm)

    @staticmethod
    def unwrap(model: nn.Module) -> nn.Module:
        """The user's module inside torch.compile and DDP wrappers (``unwrap_module``)."""
        return unwrap_module(model)

    # -- state (collectives where the state is sharded: every rank calls them) ----------------
    def model_state_dict(self, model) -> dict:
        return self.unwrap(model).state_dict()

    def load_model_state_dict(self, model, state: dict, strict: bool = True):
        load_model_state(self.unwrap(model), state, strict=strict)

    def optimizer_state_dict(self, model, optimizer) -> dict:
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, model, optimizer, state: dict):
        groups = state.get("param_groups") or []
        if groups and groups[0].get("params") and isinstance(groups[0]["params"][0], str):
            # keyed by parameter name (a merged sharded checkpoint): let torch map names to parameters
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(self.unwrap(model), optimizer, state,
                                     options=StateDictOptions(full_state_dict=True))
            return
        optimizer.load_state_dict(state)


class DDPStrategy(SingleProcess):
    """torch ``DistributedDataParallel`` with the config's ``torch_ddp`` keyword arguments."""

    name = "torch DDP"
    data_parallel = True

    def __init__(self, **ddp_kwargs):
        self.ddp_kwargs = ddp_kwargs
        self._wrapper_forwards: Optional[Any] = None  # watches the DDP module's forward until the first update
        self._wrapper_ran = False

    def setup(self, model, optimizer):
        from torch.nn.parallel import DistributedDataParallel

        device_ids = None
        for p in model.parameters():
            if p.device.type == "cuda":
                device_ids = [p.device.index]
            break
        ddp = DistributedDataParallel(model, device_ids=device_ids, **self.ddp_kwargs)
        self._wrapper_ran = False
        self._wrapper_forwards = ddp.register_forward_pre_hook(self._note_wrapper_forward)
        return ddp, optimizer

    def _note_wrapper_forward(self, module, args) -> None:
        self._wrapper_ran = True

    def reduce_gradients(self, model):
        """DDP reduced the gradients in the backward. At the first update only: they were reduced only if a
        forward went through the DDP module, which a loop calling the module given to ``initialize`` bypasses
        (the ranks would train apart without a word)."""
        if self._wrapper_forwards is None:
            return
        self._wrapper_forwards.remove()
        self._wrapper_forwards = None
        if not self._wrapper_ran:
            raise RuntimeError(
                f"engine.step() on rank {dist.get_rank()}: no forward went through the engine's model since "
                f"initialize, so DDP synchronised no gradient and the ranks would train apart (nothing was updated). "
                f"The loop calls the module given to initialize (model(x)): call engine(x), or engine.model(x)")

    def set_gradient_sync(self, model, sync):
        # what DistributedDataParallel.no_sync() sets; its forward reads it (torch.compile wraps the DDP module)
        getattr(model, "_orig_mod", model).require_backward_grad_sync = sync

    def sync_buffers_at_next_forward(self, model):
        # DDP broadcasts rank 0's buffers at a forward that follows a synced one; a forward without sync clears it
        getattr(model, "_orig_mod", model).require_forward_param_sync = True

    def explain(self, model, error):
        """DDP's "unused parameters" error (raised at the forward after a backward that left a parameter without a
        gradient) names torch's keyword; the user writes the config, so name its line and the parameters."""
        if _UNUSED_PARAMETERS not in str(error):
            return None
        options = {**self.ddp_kwargs, "find_unused_parameters": True}
        unused = _unused_parameter_names(getattr(model, "_orig_mod", model), str(error))
        return RuntimeError(
            f"DDP on rank {dist.get_rank()}: the last backward gave no gradient to "
            f"{'the parameters ' + ', '.join(unused) if unused else 'some parameters'} of the model (they were not "
            f"used to compute the loss), and DDP waits for every parameter's gradient unless told to look for unused "
            f"ones. Fix: write torch_ddp = {py(options)} in the config (or --set torch_ddp.find_unused_parameters=True; "
            f"it costs a walk of the autograd graph per backward), or use those parameters in the loss, or freeze "
            f"them with requires_grad_(False) before initialize")


# The start of the error torch's DDP reducer raises at the forward after a backward that left parameters
# without a gradient.
_UNUSED_PARAMETERS = "Expected to have finished reduction in the prior iteration"


def _unused_parameter_names(ddp: nn.Module, message: str) -> List[str]:
    """The names of the parameters torch's message lists by index ("Parameter indices which did not receive grad
    for rank 0: 2 3"), or none when it lists none. The indices count the parameters DDP reduces, in
    ``named_parameters`` order: those that require a gradient and are not ignored."""
    found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", message)
    if not found or not isinstance(getattr(ddp, "module", None), nn.Module):
        return []
    ignored = getattr(ddp, "parameters_to_ignore", ())
    names = [n for n, p in ddp.module.named_parameters() if p.requires_grad and n not in ignored]
    return [names[int(i)] for i in found.group(1).split() if int(i) < len(names)]


class AllReduceStrategy(SingleProcess):
    """Average gradients over ranks with bucketed all-reduces in ``engine.step`` (no DDP)."""

    name = "gradient all-reduce (DataParallelGradientHandler)"
    data_parallel = True

    def __init__(self, bucket_size_mb: float = 25.0):
        self.bucket_bytes = int(bucket_size_mb * 2**20)

    def reduce_gradients(self, model):
        """Every parameter that trains takes part on every rank, so that all ranks lay out the same buffers: one
        with no gradient here (unused by this rank's batches) adds zeros, and gets the average when another rank
        used it; one no rank used keeps no gradient, as under DDP. Each bucket carries, after the gradients, how
        many ranks used each of its parameters (no collective of its own)."""
        world = dist.get_world_size()
        buckets: dict = {}
        for p in model.parameters():
            if p.requires_grad:
                g = p.grad
                buckets.setdefault((p.dtype if g is None else g.dtype, p.device), []).append(p)
        for same in buckets.values():
            bucket: List[torch.Tensor] = []
            size = 0
            for p in same:
                bucket.append(p)
                size += p.numel() * p.element_size()
                if size >= self.bucket_bytes:
                    self._reduce(bucket, world)
                    bucket, size = [], 0
            if bucket:
                self._reduce(bucket, world)

    @staticmethod
    def _reduce(bucket: List[torch.Tensor], world: int):
        grads = [p.grad for p in bucket]
        used = [g is not None for g in grads]
        like = next(g for g in grads + [bucket[0]] if g is not None)
        parts = [g.reshape(-1) if g is not None else torch.zeros(p.numel(), dtype=like.dtype, device=like.device)
                 for p, g in zip(bucket, grads)]
        every = all(used)  # (the usual case: the flags are a fill on the device, and nothing is read back)
        parts.append(torch.ones(len(bucket), dtype=like.dtype, device=like.device) if every else
                     torch.tensor(used, dtype=like.dtype, device=like.device))
        flat = torch.cat(parts)
        dist.all_reduce(flat)
        users = None if every else flat[-len(bucket):].tolist()
        flat.div_(world)
        offset = 0
        for i, (p, g) in enumerate(zip(bucket, grads)):
            n = p.numel()
            if g is not None:
                g.copy_(flat[offset:offset + n].view_as(g))
            elif users[i]:
                p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n


class HandlerStrategy(SingleProcess):
    """Gradient handlers as the data-parallel part: the config's ``gradient_handler`` entries (``configs``), built
    from the ``GRADIENT_HANDLER`` registry with the model and optimizer as ``setup`` receives them, or handler
    objects built by the user (``handlers``, the legacy ``Engine(gradient_handlers=[...])``). ``reduce_gradients``
    calls each one's ``handle_gradient()`` in order, once per optimizer update on every rank, before clipping.
    No DDP: the handlers are the gradient sync."""

    data_parallel = True

    def __init__(self, configs: Sequence[dict] = (), handlers: Sequence = ()):
        self.configs = [dict(c) for c in configs]
        self.handlers: list = list(handlers)
        names = [str(c["type"]) for c in self.configs] + [type(h).__name__ for h in self.handlers]
        self.name = "gradient handlers (" + ", ".join(names) + ")"

    def setup(self, model, optimizer):
        if self.configs:
            self.handlers = [GRADIENT_HANDLER.build(c, model=model, optimizer=optimizer) for c in self.configs]
        return model, optimizer

    def reduce_gradients(self, model):
        for handler in self.handlers:
            handler.handle_gradient()
