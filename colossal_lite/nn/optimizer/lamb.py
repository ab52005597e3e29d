"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes").

Per parameter tensor ``p`` with gradient ``g`` at step ``t``::

    m = b1 * m + (1 - b1) * g                    (``grad_averaging=False``: m = b1 * m + g)
    v = b2 * v + (1 - b2) * g * g
    r = (m / c1) / (sqrt(v / c2) + eps)          c1 = 1 - b1**t, c2 = 1 - b2**t with bias_correction, else 1
    u = r + wd * p                               (decoupled decay; ``adam_w_mode=False`` adds wd * p to g instead)
    ratio = ||p|| / ||u||                        (1 when either norm is 0, or with ``adam=True``; at most
                                                  ``max_trust_ratio`` when given)
    p = p - lr * ratio * u

The trust ratio is computed on the device: a step reads nothing back to the host.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.optim import Optimizer


def _check(lr, betas, eps, max_trust_ratio):
    if lr < 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if eps < 0.0:
        raise ValueError(f"Invalid epsilon value: {eps}")
    for i, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
    if max_trust_ratio is not None and max_trust_ratio <= 0:
        raise ValueError(f"max_trust_ratio must be positive or None, got {max_trust_ratio}")


def _trust_ratio(p: torch.Tensor, update: torch.Tensor, max_trust_ratio: Optional[float]) -> torch.Tensor:
    w_norm, u_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(update)
    ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
    return ratio if max_trust_ratio is None else ratio.clamp(max=max_trust_ratio)


def _lamb_update(p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
    beta1, beta2 = group["betas"]
    wd, decoupled = group["weight_decay"], group["adam_w_mode"]
    if len(state) == 0:
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    state["step"] += 1
    if wd != 0 and not decoupled:
        grad = grad.add(p, alpha=wd)
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m.mul_(beta1).add_(grad, alpha=(1 - beta1) if group["grad_averaging"] else 1.0)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    c1, c2 = (1 - beta1 ** state["step"], 1 - beta2 ** state["step"]) if group["bias_correction"] else (1.0, 1.0)
    update = (m / c1).div_((v / c2).sqrt_().add_(group["eps"]))
    if wd != 0 and decoupled:
        update.add_(p, alpha=wd)
    adapt = not group["adam"] and (wd != 0 or group["use_nvlamb"])
    if adapt:
        update.mul_(_trust_ratio(p, update, group["max_trust_ratio"]))
    p.add_(update, alpha=-group["lr"])


class Lamb(Optimizer):
    """LAMB with the legacy ``colossalai.nn.optimizer.Lamb`` signature and defaults.

    Legacy defaults: no bias correction (the paper's v3 has none), decoupled weight decay, a trust ratio on
    every tensor, no clamp. ``adam=True`` fixes the trust ratio at 1 (plain Adam, for comparison).
    ``bias_correction=True`` divides the moments by ``1 - beta**t``; ``max_trust_ratio`` clamps the ratio.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0, adam=False, *,
                 bias_correction: bool = False, max_trust_ratio: Optional[float] = None):
        _check(lr, betas, eps, max_trust_ratio)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adam=bool(adam),
                        bias_correction=bool(bias_correction), max_trust_ratio=max_trust_ratio,
                        grad_averaging=True, adam_w_mode=True, use_nvlamb=True)
        super().__init__(params, defaults)

    @property
    def adam(self) -> bool:
        """Legacy attribute: whether the trust ratio is fixed at 1."""
        return bool(self.defaults["adam"])

    def _clip_factor(self) -> Optional[torch.Tensor]:
        return None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        clip = self._clip_factor()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                grad = p.grad if clip is None else p.grad / clip
                _lamb_update(p, grad, self.state[p], group)
        return loss


class FusedLAMB(Lamb):
    """Legacy ``FusedLAMB`` (apex's LAMB): bias correction, weight decay 0.01 and decoupled by default, the
    gradients divided by ``global_norm / max_grad_norm`` when their global norm exceeds ``max_grad_norm``,
    and the trust ratio used only on tensors with weight decay unless ``use_nvlamb=True``.

    Computed with torch operators (legacy needed its CUDA extension); ``set_grad_none`` is ``zero_grad``'s
    default.
    """

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                 amsgrad=False, adam_w_mode=True, grad_averaging=True, set_grad_none=True, max_grad_norm=1.0,
                 use_nvlamb=False):
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant.")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         bias_correction=bias_correction)
        options = dict(adam_w_mode=bool(adam_w_mode), grad_averaging=bool(grad_averaging),
                       use_nvlamb=bool(use_nvlamb))
        self.defaults.update(options, max_grad_norm=max_grad_norm, set_grad_none=set_grad_none)
        for group in self.param_groups:
            group.update(options)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: Optional[bool] = None):
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def _clip_factor(self) -> Optional[torch.Tensor]:
        """``max(1, global_norm / max_grad_norm)`` over every gradient, on the device (None: no clipping)."""
        max_norm = self.defaults["max_grad_norm"]
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not grads or not max_norm or max_norm <= 0:
            return None
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        return torch.clamp(norm / max_norm, min=1.0)
