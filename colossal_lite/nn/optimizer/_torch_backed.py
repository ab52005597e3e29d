"""The legacy fused and CPU optimizers, mapped onto torch's own SGD and Adam.

Legacy Colossal-AI shipped CUDA/C++ kernels for these (``FusedSGD``, ``FusedAdam``, ``HybridAdam``,
``CPUAdam``); torch now has multi-tensor (``foreach``) and fused kernels of the same algorithms, so each
class here is the torch optimizer with the legacy constructor signature. The kernel is torch's: ``fused``
on CUDA (all parameters there), otherwise torch's own default (``foreach`` on accelerators, a loop on
the CPU); ``fused=``/``foreach=`` may be given to choose. Each is a real ``torch.optim.Optimizer``
subclass, so LR schedulers, ZeRO (which rebuilds the class from ``defaults``) and checkpoints work.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch.optim.optimizer import required


def _unhooked_step(cls):
    """``cls.step`` without the wrapper torch adds when an instance of ``cls`` itself is built: that wrapper
    runs the step hooks, and a subclass's own (wrapped) step already ran them, so calling the wrapped parent
    step would run every hook twice (and count each update twice)."""
    step = cls.step
    return getattr(step, "__wrapped__", step) if getattr(step, "hooked", False) else step


def _params_list(params) -> list:
    """The parameters (or group dicts) as a list that can be read twice: once to pick the kernel, once by torch."""
    if isinstance(params, torch.Tensor):
        return [params]
    items = []
    for item in params:
        if isinstance(item, dict):
            group = item["params"]
            item = {**item, "params": [group] if isinstance(group, torch.Tensor) else list(group)}
        items.append(item)
    return items


def _all_on_cuda(params: list) -> bool:
    tensors = [p for item in params for p in (item["params"] if isinstance(item, dict) else [item])]
    return bool(tensors) and all(isinstance(t, torch.Tensor) and t.is_cuda and t.is_floating_point()
                                 for t in tensors)


def _kernel(params: list, fused: Optional[bool], foreach: Optional[bool]) -> dict:
    """torch's fused kernel when every parameter is on CUDA (unless the caller chose), else torch's default."""
    if fused is None and foreach is None and _all_on_cuda(params):
        fused = True
    return dict(fused=fused, foreach=foreach)


class _DecoupledDecay:
    """Weight decay applied to the weights directly (``p *= 1 - lr * wd``) rather than added to the gradient,
    for the groups whose ``decoupled_key`` is true; the wrapped torch step then runs with no weight decay.

    This is the update torch's AdamW makes (it multiplies the weights the same way before its Adam step), and
    the one legacy FusedSGD made with ``wd_after_momentum=True`` (the decay joins the step after momentum)."""

    decoupled_key = ""
    _torch_step = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        held = []
        for group in self.param_groups:
            wd = group["weight_decay"]
            if group.get(self.decoupled_key) and wd != 0:
                params = [p for p in group["params"] if p.grad is not None]
                if params:
                    torch._foreach_mul_(params, 1.0 - group["lr"] * wd)
                held.append((group, wd))
                group["weight_decay"] = 0.0
        try:
            self._torch_step()
        finally:
            for group, wd in held:
                group["weight_decay"] = wd
        return loss


def _remember(optimizer: torch.optim.Optimizer, **options) -> None:
    """Keep legacy options in ``defaults`` and in every group: a group added later, a ZeRO shard (rebuilt from
    ``defaults``) and a loaded ``state_dict`` all carry them."""
    optimizer.defaults.update(options)
    for group in optimizer.param_groups:
        for key, value in options.items():
            group.setdefault(key, value)


class FusedSGD(_DecoupledDecay, torch.optim.SGD):
    """Legacy ``FusedSGD``: ``torch.optim.SGD`` (momentum ``v = m * v + g``, ``p -= lr * v``, as legacy).

    ``wd_after_momentum=True`` adds the weight decay to the update after momentum instead of to the gradient
    before it (apex's option); the default is torch's (and legacy's) L2 on the gradient.
    """

    decoupled_key = "wd_after_momentum"

    def __init__(self, params, lr=required, momentum=0, dampening=0, weight_decay=0, nesterov=False,
                 wd_after_momentum=False, *, fused: Optional[bool] = None, foreach: Optional[bool] = None):
        if lr is required:
            raise TypeError("FusedSGD needs a learning rate: FusedSGD(params, lr=0.1)")
        params = _params_list(params)
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                         nesterov=nesterov, **_kernel(params, fused, foreach))
        _remember(self, wd_after_momentum=bool(wd_after_momentum))

    def _torch_step(self):
        _unhooked_step(torch.optim.SGD)(self)


class _LegacyAdam(_DecoupledDecay, torch.optim.Adam):
    """``torch.optim.Adam``; ``adamw_mode=True`` (the legacy default) makes it AdamW (decoupled weight decay),
    ``adamw_mode=False`` is Adam with L2 weight decay on the gradient."""

    decoupled_key = "adamw_mode"

    def __init__(self, params: Iterable, lr: float, bias_correction: bool, betas, eps: float, weight_decay: float,
                 adamw_mode: bool, amsgrad: bool, fused: Optional[bool], foreach: Optional[bool]):
        if not bias_correction:
            raise ValueError(f"{type(self).__name__}(bias_correction=False) is not supported: torch's Adam always "
                             "corrects the moments' bias; leave bias_correction=True")
        params = _params_list(params)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         **_kernel(params, fused, foreach))
        _remember(self, adamw_mode=bool(adamw_mode), bias_correction=True)

    def _torch_step(self):
        _unhooked_step(torch.optim.Adam)(self)


class FusedAdam(_LegacyAdam):
    """Legacy ``FusedAdam`` (note its argument order: ``adamw_mode`` before ``weight_decay``).

    ``set_grad_none`` is the default of ``zero_grad(set_to_none=...)``."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adamw_mode=True,
                 weight_decay=0.0, amsgrad=False, set_grad_none=True, *, fused: Optional[bool] = None,
                 foreach: Optional[bool] = None):
        super().__init__(params, lr, bias_correction, betas, eps, weight_decay, adamw_mode, amsgrad, fused, foreach)
        self.set_grad_none = set_grad_none
        self.defaults["set_grad_none"] = set_grad_none

    def zero_grad(self, set_to_none: Optional[bool] = None):
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)


def _refuse_nvme(cls_name: str, nvme_offload_fraction: float) -> None:
    if nvme_offload_fraction:
        raise ValueError(f"{cls_name}(nvme_offload_fraction={nvme_offload_fraction}): offloading optimizer states "
                         "to NVMe is not supported; leave it at 0.0 (ZeRO's offload_optimizer keeps them in host memory)")


class CPUAdam(_LegacyAdam):
    """Legacy ``CPUAdam``: Adam/AdamW that updates each parameter where it lives (CPU or GPU).

    Legacy used a SIMD C++ kernel for CPU parameters; torch's own kernels do that work here. NVMe offload
    of the optimizer states is refused (``nvme_offload_fraction`` must stay 0); ``simd_log`` is accepted and
    has nothing to report."""

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 adamw_mode=True, nvme_offload_fraction: float = 0.0, nvme_offload_dir: Optional[str] = None,
                 simd_log: bool = False, *, amsgrad: bool = False, fused: Optional[bool] = None,
                 foreach: Optional[bool] = None):
        _refuse_nvme(type(self).__name__, nvme_offload_fraction)
        super().__init__(model_params, lr, bias_correction, betas, eps, weight_decay, adamw_mode, amsgrad, fused,
                         foreach)


class HybridAdam(CPUAdam):
    """Legacy ``HybridAdam``: CPUAdam for CPU parameters and FusedAdam for GPU ones, in one optimizer.

    torch picks its kernel per device and dtype group inside one step, which is that hybrid."""
