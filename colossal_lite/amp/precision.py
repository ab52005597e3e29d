"""Precision plugins: one class per mode, one interface.

``setup`` adapts model and optimizer once; ``autocast`` wraps forward and loss;
``backward`` scales; ``unscale_`` makes gradients true-valued before clipping (once per
update); ``step`` runs (or, on fp16 overflow, skips) the optimizer step; ``state_dict``
holds the loss scaler. fp16 loss-scaling modes read one flag from the device per update
(as torch's GradScaler does); fp32 and bf16 never synchronise.
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ..context.config import ConfigException
from ..context.defaults import NAIVE_AMP_OPTIONS, TORCH_AMP_OPTIONS
from ..context.validation import normalize_amp_mode
from ..core.dist import is_rank_0, log_rank_0
from ..core.tree import map_leaves
from .amp_type import AMP_TYPE

_TORCH = TORCH_AMP_OPTIONS  # the defaults of each mode's options, written once in context/defaults.py
_NAIVE = NAIVE_AMP_OPTIONS

NULL_CONTEXT = contextlib.nullcontext()  # reusable; no allocation per step


def _device_type(model: nn.Module) -> str:
    for p in model.parameters():
        return p.device.type
    return "cpu"


def _optimizer_params(optimizer) -> List[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def in_model_order(model: nn.Module, params: List[torch.Tensor], key=None) -> List[torch.Tensor]:
    """``params`` sorted as ``model.parameters()`` yields them (those not in the model last, in their order).

    A global norm is a sum over the parameters, and a float sum depends on its order: clipping in the model's
    order gives the clip factor of ``clip_grad_norm_(model.parameters())`` to the last bit, whatever the
    optimizer's param groups (decay / no-decay groups list the parameters in another order).
    """
    index = {id(p): i for i, p in enumerate(model.parameters())}
    key = key or (lambda p: p)
    return sorted(params, key=lambda p: index.get(id(key(p)), len(index)))


class FP32Precision:
    """Plain fp32: no autocast, no scaling."""

    mode: Optional[AMP_TYPE] = None
    name = "fp32"
    compute_dtype: Optional[torch.dtype] = None  # what FSDP2 should gather parameters in
    shards_state = False  # set by initialize when each rank holds only a shard of the gradients

    def setup(self, model: nn.Module, optimizer) -> Tuple[nn.Module, object]:
        return model, optimizer

    def autocast(self):
        return NULL_CONTEXT

    def backward(self, loss: torch.Tensor, weight: Optional[torch.Tensor] = None):
        """Back-propagate ``weight * loss``: backward starts from ``weight`` (a 0-dim tensor; None: 1), which
        gives the gradients of the product without computing it."""
        loss.backward(weight)

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor):
        torch.autograd.backward(tensors=tensor, grad_tensors=grad)

    def unscale_(self, optimizer):
        pass

    def step(self, optimizer):
        optimizer.step()

    def zero_grad(self, model: nn.Module, optimizer, set_to_none: bool = True):
        optimizer.zero_grad(set_to_none=set_to_none)

    def master_params(self, model: nn.Module, optimizer) -> List[torch.Tensor]:
        """The tensors whose gradients the optimizer applies (what clipping must see), in the model's order."""
        return in_model_order(model, _optimizer_params(optimizer))

    @property
    def loss_scale(self) -> Optional[float]:
        return None

    def state_dict(self) -> Dict:
        return {}

    def load_state_dict(self, state: Dict):
        _scaler_state_of_this_mode(state, None, "")  # (one of an fp16 mode is left, with a warning)


class BF16Precision(FP32Precision):
    """bf16 autocast over fp32 weights; bf16 has fp32's range, so no loss scaling."""

    mode = AMP_TYPE.BF16
    name = "bf16"
    compute_dtype = torch.bfloat16

    def __init__(self, device_type: str = "cpu"):
        self.device_type = device_type

    def setup(self, model, optimizer):
        self.device_type = _device_type(model)
        return model, optimizer

    def autocast(self):
        return torch.autocast(self.device_type, dtype=torch.bfloat16)


class TorchAMPPrecision(FP32Precision):
    """fp16 autocast with ``torch.amp.GradScaler`` (skips overflowing steps, backs the scale off)."""

    mode = AMP_TYPE.TORCH
    name = "torch_amp"
    compute_dtype = torch.float16

    def __init__(self, init_scale: float = _TORCH["init_scale"], growth_factor: float = _TORCH["growth_factor"],
                 backoff_factor: float = _TORCH["backoff_factor"], growth_interval: int = _TORCH["growth_interval"],
                 enabled: bool = _TORCH["enabled"]):
        self.options = dict(init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                            growth_interval=growth_interval, enabled=enabled)
        self.device_type = "cpu"
        self.scaler: Optional[torch.amp.GradScaler] = None
        self._unscaled = False

    def setup(self, model, optimizer):
        self.device_type = _device_type(model)
        if self.shards_state:  # the overflow flag must be agreed by all ranks holding shards
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(self.device_type, **self.options)
        else:
            self.scaler = torch.amp.GradScaler(self.device_type, **self.options)
        return model, optimizer

    def autocast(self):
        return torch.autocast(self.device_type, dtype=torch.float16, enabled=self.options["enabled"])

    @property
    def skips_nonfinite_steps(self) -> bool:
        """The loss scaler skips an update whose gradients hold inf/nan (so the engine's loss guard stands aside)."""
        return bool(self.options["enabled"])

    def backward(self, loss, weight=None):
        self.scaler.scale(loss).backward(weight)

    def backward_by_grad(self, tensor, grad):
        torch.autograd.backward(tensors=tensor, grad_tensors=self.scaler.scale(grad))

    def unscale_(self, optimizer):
        if not self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled = True

    def step(self, optimizer):
        self.scaler.step(optimizer)  # skipped when unscale found inf/nan
        self.scaler.update()
        self._unscaled = False

    @property
    def loss_scale(self):
        return self.scaler.get_scale() if self.scaler is not None else None

    def state_dict(self):
        return {"mode": "torch", "scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state):
        if self.scaler is not None and _scaler_state_of_this_mode(state, "torch", "init_scale"):
            self.scaler.load_state_dict(state["scaler"])


class DynamicGradScaler:
    """Loss scale for naive fp16, as legacy Colossal-AI's: the first ``hysteresis - 1`` overflows are tolerated,
    then every overflow backs the scale off until the scale grows again (after ``growth_interval`` good steps in
    a row, which also restores the tolerance)."""

    def __init__(self, initial_scale: float = _NAIVE["initial_scale"], growth_factor: float = _NAIVE["growth_factor"],
                 backoff_factor: float = _NAIVE["backoff_factor"], growth_interval: int = _NAIVE["growth_interval"],
                 min_scale: Optional[float] = _NAIVE["min_scale"], max_scale: Optional[float] = _NAIVE["max_scale"],
                 hysteresis: int = _NAIVE["hysteresis"], dynamic: bool = _NAIVE["dynamic_grad_scale"]):
        self.scale = float(initial_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.min_scale, self.max_scale, self.dynamic = min_scale, max_scale, dynamic
        self._good_steps = 0
        self._hysteresis_left = hysteresis

    def update(self, overflow: bool):
        if not self.dynamic:
            return
        if overflow:
            self._good_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale *= self.backoff_factor
                if self.min_scale is not None:
                    self.scale = max(self.scale, self.min_scale)
        else:
            self._good_steps += 1
            if self._good_steps >= self.growth_interval:
                self._good_steps = 0
                self._hysteresis_left = self.hysteresis
                self.scale *= self.growth_factor
                if self.max_scale is not None:
                    self.scale = min(self.scale, self.max_scale)

    def state_dict(self):
        return {"scale": self.scale, "good_steps": self._good_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state):
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])


def _saved_mode(state: Dict) -> Optional[str]:
    """The fp16 mode ('torch' or 'naive') a precision state was saved under; None for an empty one (fp32, bf16).
    States saved before the mode was written say it by their keys."""
    if not state:
        return None
    if "mode" in state:
        return state["mode"]
    return "naive" if "master_params" in state or "good_steps" in state.get("scaler", {}) else "torch"


def _scaler_state_of_this_mode(state: Dict, mode: Optional[str], initial_option: str) -> bool:
    """Whether ``state`` holds this fp16 mode's loss scaler. One saved under the other mode (a run resumed with
    another ``fp16.mode``) has other fields: it is left, with a warning, and the scale starts from the config's."""
    saved = _saved_mode(state)
    if saved is None or saved == mode:
        return saved is not None
    if is_rank_0():
        masters = (" (and the weights are the model's fp16 ones: NAIVE's fp32 masters are not carried over)"
                   if saved == "naive" else "")
        now = (f"uses {mode.upper()}: its loss scale starts from fp16.{initial_option} in the config" if mode else
               "has no loss scaler (fp32 or bf16): it is left")
        warnings.warn(f"the checkpoint's loss scaler was saved under fp16 mode {saved.upper()} and this run "
                      f"{now}{masters}", stacklevel=4)
    return False


def _cast_floats(obj, dtype):
    """``obj`` with its floating-point tensors (inside lists, tuples and dicts too) cast to ``dtype``."""
    return map_leaves(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                      and t.dtype != dtype else t, obj)


class _LoadIntoMasters:
    """A ``load_state_dict`` pre-hook of a module under naive fp16: the values loaded into its own parameters go
    into their fp32 masters as well (exactly, when the state holds fp32). A value of another shape is left to the
    error torch's load raises.

    A deep copy of the model (EMA's average) gets this same hook, not a copy of the masters it holds: called for
    the copy, which is another module, it does nothing."""

    def __init__(self, module: nn.Module, masters: Dict[str, torch.Tensor]):
        self.module = weakref.ref(module)
        self.masters = masters

    def __deepcopy__(self, memo):
        return self

    def __call__(self, module, state_dict, prefix, *_) -> None:
        if module is not self.module():
            return
        with torch.no_grad():
            for name, master in self.masters.items():
                value = state_dict.get(prefix + name)
                if isinstance(value, torch.Tensor) and value.shape == master.shape:
                    master.copy_(value)


class NaiveAMPPrecision(FP32Precision):
    """fp16 weights and activations, fp32 master weights in the optimizer, dynamic loss scale; fp32 outputs."""

    mode = AMP_TYPE.NAIVE
    name = "naive_amp"
    skips_nonfinite_steps = True  # an overflow (inf/nan gradient) skips the update and backs the scale off

    def __init__(self, initial_scale: float = _NAIVE["initial_scale"], growth_factor: float = _NAIVE["growth_factor"],
                 backoff_factor: float = _NAIVE["backoff_factor"], growth_interval: int = _NAIVE["growth_interval"],
                 hysteresis: int = _NAIVE["hysteresis"], min_scale: Optional[float] = _NAIVE["min_scale"],
                 max_scale: Optional[float] = _NAIVE["max_scale"], dynamic_grad_scale: bool = _NAIVE["dynamic_grad_scale"],
                 verbose: bool = _NAIVE["verbose"], log_num_zeros_in_grad: bool = _NAIVE["log_num_zeros_in_grad"]):
        self.log_num_zeros_in_grad = log_num_zeros_in_grad
        self.verbose = verbose  # rank 0 logs each change of the loss scale, as legacy's scaler did
        self.scaler = DynamicGradScaler(initial_scale, growth_factor, backoff_factor, growth_interval, min_scale,
                                        max_scale, hysteresis, dynamic=dynamic_grad_scale)
        self._pairs: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (fp16 model param, fp32 master)
        self._scale_tensor: Optional[torch.Tensor] = None
        self._found_inf: Optional[torch.Tensor] = None
        self._unscaled = False

    def setup(self, model, optimizer):
        model.half()
        model.register_forward_pre_hook(lambda m, args, kwargs: (_cast_floats(args, torch.float16),
                                                                _cast_floats(kwargs, torch.float16)), with_kwargs=True)
        model.register_forward_hook(lambda m, args, out: _cast_floats(out, torch.float32))
        for group in optimizer.param_groups:
            masters = []
            for p in group["params"]:
                master = p.detach().clone().float().requires_grad_(p.requires_grad)
                self._pairs.append((p, master))
                masters.append(master)
            group["params"] = masters
        device = self._pairs[0][0].device if self._pairs else torch.device("cpu")
        self._found_inf = torch.zeros(1, device=device)
        # Weights loaded into the model later (a checkpoint's, pretrained ones) must reach the masters too: each
        # update copies the masters over the model, which would put the weights from before the load back.
        master_of = {id(p): master for p, master in self._pairs}
        for module in model.modules():
            own = {name: master_of[id(p)] for name, p in module.named_parameters(recurse=False) if id(p) in master_of}
            if own:
                module.register_load_state_dict_pre_hook(_LoadIntoMasters(module, own))
        return model, optimizer

    def _scale(self, like: torch.Tensor) -> torch.Tensor:
        t = self._scale_tensor
        if t is None or t.device != like.device or self._scale_value != self.scaler.scale:
            self._scale_value = self.scaler.scale
            t = self._scale_tensor = torch.full((), self.scaler.scale, dtype=torch.float32, device=like.device)
        return t

    def backward(self, loss, weight=None):
        (loss.float() * self._scale(loss)).backward(None if weight is None else weight.float())

    def backward_by_grad(self, tensor, grad):
        torch.autograd.backward(tensors=tensor, grad_tensors=grad * self._scale(grad).to(grad.dtype))

    def unscale_(self, optimizer):
        """Copy fp16 grads into fp32 master grads, divide by the scale, flag inf/nan."""
        if self._unscaled:
            return
        self._found_inf.zero_()
        grads = []
        for p, master in self._pairs:
            if p.grad is None:
                master.grad = None
                continue
            master.grad = p.grad.float()
            grads.append(master.grad)
        if grads:
            inv = (1.0 / self._scale(grads[0])).to(grads[0].device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, self._found_inf, inv)
        self._unscaled = True

    def step(self, optimizer):
        self.unscale_(optimizer)
        overflow = bool(self._found_inf.item())  # the one device read per update in this mode
        if self.log_num_zeros_in_grad and not overflow and is_rank_0():
            self._log_zeros_in_grad()  # before the update, so the line names the scale these gradients had
        scale = self.scaler.scale
        self.scaler.update(overflow)
        if self.verbose and self.scaler.scale != scale:
            # the scale is a host float, so this costs no device read
            why = "an overflow (update skipped)" if overflow else f"{self.scaler.growth_interval} updates without overflow"
            log_rank_0(None, f"naive fp16: loss scale {scale:.10g} -> {self.scaler.scale:.10g} after {why}")
        if not overflow:
            optimizer.step()
            with torch.no_grad():
                for p, master in self._pairs:
                    p.copy_(master)
        self._unscaled = False
        return not overflow  # (the legacy optimizer wrapper reports it; the engine reads its own count)

    def _log_zeros_in_grad(self):
        """The legacy ``log_num_zeros_in_grad`` line: zero elements of the unscaled fp32 gradients about to be
        applied (the gradients are already reduced, so rank 0's count is every rank's). A zero count that grows
        shows dead units or an underflowing loss scale. Costs one device read, so only when asked."""
        grads = [m.grad for _, m in self._pairs if m.grad is not None]
        if not grads:
            return
        zeros = int(torch.stack([(g == 0).sum() for g in grads]).sum().item())
        total = sum(g.numel() for g in grads)
        log_rank_0(None, f"naive fp16: {zeros} of {total} gradient elements are zero (loss scale {self.scaler.scale:g})")

    def zero_grad(self, model, optimizer, set_to_none=True):
        optimizer.zero_grad(set_to_none=set_to_none)
        model.zero_grad(set_to_none=set_to_none)

    def master_params(self, model, optimizer):
        """The fp32 masters, ordered as their fp16 parameters are in the model."""
        model_param = {id(master): p for p, master in self._pairs}
        return in_model_order(model, _optimizer_params(optimizer), key=lambda m: model_param.get(id(m), m))

    @property
    def loss_scale(self):
        return self.scaler.scale

    def state_dict(self):
        return {"mode": "naive", "scaler": self.scaler.state_dict(),
                "master_params": [m.detach().clone() for _, m in self._pairs]}

    def load_state_dict(self, state):
        if not _scaler_state_of_this_mode(state, "naive", "initial_scale"):
            return  # (the masters came with the model's weights: ``_LoadIntoMasters``)
        self.scaler.load_state_dict(state["scaler"])
        masters = state.get("master_params")
        if masters is not None:
            if len(masters) != len(self._pairs):
                raise ValueError(f"naive fp16 state has {len(masters)} master weights, the optimizer has {len(self._pairs)}")
            with torch.no_grad():
                for (p, master), saved in zip(self._pairs, masters):
                    master.copy_(saved)
                    p.copy_(saved)


def build_precision(fp16_config) -> FP32Precision:
    """The precision plugin for a config's ``fp16`` entry (None or mode None -> fp32)."""
    if not fp16_config:
        return FP32Precision()
    options = {k: v for k, v in dict(fp16_config).items() if k != "mode"}
    mode = normalize_amp_mode(fp16_config.get("mode"))
    if mode is None:
        return FP32Precision()
    cls = {AMP_TYPE.TORCH: TorchAMPPrecision, AMP_TYPE.BF16: BF16Precision, AMP_TYPE.NAIVE: NaiveAMPPrecision}.get(mode)
    if cls is None:
        raise ConfigException(f"fp16 mode {mode} is not supported; use AMP_TYPE.TORCH, BF16 or NAIVE")
    return cls(**options)
