"""``CheckpointModule``: the legacy base module that recomputes its activations in backward."""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def _to(obj, device: torch.device):
    # asynchronous only towards an accelerator: a copy into unpinned host memory must be complete when it returns
    return obj.to(device, non_blocking=device.type != "cpu") if isinstance(obj, torch.Tensor) else obj


class CheckpointModule(nn.Module):
    """Subclasses write ``_forward``; ``forward`` runs it under activation checkpointing while training.

    ``checkpoint=True`` and the module training (with autograd on): ``_forward`` runs under torch's
    non-reentrant ``torch.utils.checkpoint.checkpoint``, so only the inputs are kept and the activations are
    recomputed in backward (same outputs and gradients, less memory). In eval mode, under ``torch.no_grad``
    or with ``checkpoint=False`` it calls ``_forward`` directly.

    ``offload=True`` keeps in host memory what backward needs from this module: with checkpointing, the
    inputs that checkpointing keeps (copied to the CPU, back to their device when recomputing); without it,
    the saved activations (``torch.autograd.graph.save_on_cpu``). For a module on the CPU this changes
    nothing: its tensors are in host memory already.
    """

    def __init__(self, checkpoint: bool = True, offload: bool = False):
        super().__init__()
        self.checkpoint = checkpoint
        self._offload = offload

    def _forward(self, *args, **kwargs):
        raise NotImplementedError("CheckpointModule should implement _forward method instead of origin forward")

    def forward(self, *args, **kwargs):
        if not (self.training and torch.is_grad_enabled()):
            return self._forward(*args, **kwargs)
        if not self.checkpoint:
            if not self._offload:
                return self._forward(*args, **kwargs)
            with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
                return self._forward(*args, **kwargs)
        if self._offload:
            return self._checkpoint_offloaded(args, kwargs)
        return checkpoint(self._forward, *args, use_reentrant=False, **kwargs)

    def _checkpoint_offloaded(self, args, kwargs):
        """The checkpoint's inputs held on the CPU; each goes back to its own device inside the recomputed
        function (autograd carries the gradient across both copies).

        torch saves and restores the random state of the devices of the tensors the checkpoint is given, so that
        the recomputation draws what the forward drew (dropout's mask): with the inputs on the CPU it would see
        no accelerator. An empty tensor on each of the inputs' devices goes in with them (``run`` leaves them)."""
        devices = [a.device if isinstance(a, torch.Tensor) else None for a in args]
        kw_devices = {k: v.device if isinstance(v, torch.Tensor) else None for k, v in kwargs.items()}
        anchors = tuple(torch.empty(0, device=d) for d in dict.fromkeys([*devices, *kw_devices.values()])
                        if d is not None and d.type != "cpu")

        def run(*inputs, **host_kwargs):
            moved = [_to(a, d) for a, d in zip(inputs[len(anchors):], devices)]
            return self._forward(*moved, **{k: _to(v, kw_devices[k]) for k, v in host_kwargs.items()})

        cpu = torch.device("cpu")
        return checkpoint(run, *anchors, *[_to(a, cpu) for a in args], use_reentrant=False,
                          **{k: _to(v, cpu) for k, v in kwargs.items()})
