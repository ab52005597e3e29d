"""LARS (You et al. 2017, "Large Batch Training of Convolutional Networks").

Per parameter tensor ``p`` with gradient ``g``::

    d = g + wd * p
    ratio = eeta * ||p|| / (||g|| + wd * ||p|| + epsilon)     (1 when ||p|| or ||g|| is 0; clamped to
                                                              [0, max_trust_ratio]; 1 for groups with lars=False)
    v = d                       on the first step, then  v = momentum * v + d      (when momentum != 0)
    p = p - lr * ratio * v      (without momentum: p = p - lr * ratio * d)

This is the formulation of the legacy ``colossalai.nn.optimizer.Lars`` (from the authors' LARS-ImageNet
code): the layer-wise ratio scales the step taken along the momentum buffer, so the buffer holds gradients
and a learning-rate schedule acts at once. Two silent deviations of that code are not kept: it clamped every
gradient element to [-10, 10] (not part of the algorithm), and it dropped the weight decay of groups with
``lars=False``. The ratio stays on the device: a step reads nothing back to the host.
"""
from __future__ import annotations

import torch
from torch.optim import Optimizer


class Lars(Optimizer):
    """LARS with the legacy signature: ``Lars(params, lr=1e-3, momentum=0, eeta=1e-3, weight_decay=0,
    epsilon=0.0)``; ``max_trust_ratio`` (legacy's fixed 50) bounds the layer-wise ratio. A param group with
    ``lars=False`` takes plain momentum SGD steps (e.g. for biases and normalisation weights)."""

    def __init__(self, params, lr=1e-3, momentum=0, eeta=1e-3, weight_decay=0, epsilon=0.0, *,
                 max_trust_ratio: float = 50.0):
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if eeta <= 0 or eeta > 1:
            raise ValueError(f"Invalid eeta value: {eeta}")
        if epsilon < 0:
            raise ValueError(f"Invalid epsilon value: {epsilon}")
        defaults = dict(lr=lr, momentum=momentum, eeta=eeta, weight_decay=weight_decay, epsilon=epsilon, lars=True,
                        max_trust_ratio=max_trust_ratio)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, p.grad, group)
        return loss

    def _update(self, p: torch.Tensor, grad: torch.Tensor, group: dict) -> None:
        wd, momentum = group["weight_decay"], group["momentum"]
        d = grad.add(p, alpha=wd) if wd != 0 else grad
        if momentum != 0:
            state = self.state[p]
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = d.detach().clone()
            else:
                buf.mul_(momentum).add_(d)
            d = buf
        if group["lars"]:
            w_norm, g_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(grad)
            ratio = torch.where((w_norm > 0) & (g_norm > 0),
                                group["eeta"] * w_norm / (g_norm + wd * w_norm + group["epsilon"]),
                                torch.ones_like(w_norm)).clamp_(0.0, group["max_trust_ratio"])
            d = d * ratio
        p.add_(d, alpha=-group["lr"])
