"""``HostStage``: a copy of a checkpoint's state off the training path, for a write that runs in the background.

Training goes on changing its tensors in place and its containers (an optimizer's ``param_groups``,
a scheduler's counters) while an asynchronous save writes, so the state is copied whole: every
tensor into host memory (pinned when it comes from a GPU, so the copy runs at the bus's speed),
every container rebuilt, plain values shared (they cannot change). The host buffers are kept and
refilled at the next save when the tensors have the same shapes, since a fresh allocation of a
large buffer costs a page fault for every page, which is most of the copy's cost on the CPU.
"""
from __future__ import annotations

import collections
import copy
from typing import Any, Dict, List

import torch

__all__ = ["HostStage"]


class HostStage:
    """Copies a tree of tensors and plain values (``to_plain``'s output) into host buffers it keeps for reuse.

    ``copy(tree)`` returns the copy once every tensor is in host memory: a GPU copy is waited for,
    so training may change the originals as soon as it returns. The copy of one call is valid
    until the next call (its buffers are refilled then); the caller writes it out before.
    """

    def __init__(self):
        self._buffers: List[torch.Tensor] = []
        self._next = 0
        self._memo: Dict[int, torch.Tensor] = {}
        self._from_gpu = False

    def release(self) -> None:
        """Let the host buffers go (the state is copied into new ones at the next ``copy``)."""
        self._buffers = []

    def copy(self, tree: Any) -> Any:
        self._next, self._memo, self._from_gpu = 0, {}, False
        try:
            out = self._copy(tree)
        finally:
            self._memo = {}
        if self._from_gpu:
            torch.cuda.synchronize()  # the non-blocking copies have landed: training may change the originals
        del self._buffers[self._next:]  # buffers of tensors the state no longer has
        return out

    def _copy(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj)
        if isinstance(obj, dict):
            out = collections.OrderedDict() if isinstance(obj, collections.OrderedDict) else {}
            for k, v in obj.items():
                out[k] = self._copy(v)
            meta = getattr(obj, "_metadata", None)  # a module state_dict's version numbers, saved with it
            if meta is not None:
                out._metadata = copy.deepcopy(meta)
            return out
        if isinstance(obj, (list, tuple, set)):
            items = [self._copy(v) for v in obj]
            return items if isinstance(obj, list) else tuple(items) if isinstance(obj, tuple) else set(items)
        if isinstance(obj, bytearray):
            return bytearray(obj)
        return obj  # immutable plain values

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        key = id(t)
        seen = self._memo.get(key)
        if seen is not None:
            return seen  # one tensor stored twice (tied weights) stays one tensor in the file
        t = t.detach()
        if type(t) is not torch.Tensor or t.layout is not torch.strided or t.is_quantized or t.is_meta:
            out = t.to("cpu", copy=True)  # a subclass (DTensor), sparse or quantized: a plain copy of its own kind
        else:
            out = self._buffer_for(t)
            out.copy_(t, non_blocking=out.is_pinned())
            self._from_gpu = self._from_gpu or t.device.type == "cuda"
        self._memo[key] = out
        return out

    def _buffer_for(self, t: torch.Tensor) -> torch.Tensor:
        """The kept buffer at this position when it fits ``t``, else a new one (pinned for a GPU tensor)."""
        i, self._next = self._next, self._next + 1
        pinned = t.device.type == "cuda"
        if i < len(self._buffers):
            b = self._buffers[i]
            if b.shape == t.shape and b.dtype == t.dtype and b.stride() == t.stride() and b.is_pinned() == pinned:
                return b
        b = torch.empty_like(t, device="cpu", pin_memory=pinned)
        if b.stride() != t.stride():
            b = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)
        if i < len(self._buffers):
            self._buffers[i] = b
        else:
            self._buffers.append(b)
        return b
