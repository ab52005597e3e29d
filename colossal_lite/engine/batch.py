"""A batch on its way into the model: moved to the device, split into (data, label), spread into calls.

Batches are tensors or nested lists, tuples (named too) and dicts of them; ``core.tree`` walks them.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, List, Optional

import torch

from ..core.tree import iter_leaves, map_leaves


def _to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.device == device:
        return tensor
    # from pinned host memory the copy to the GPU runs asynchronously; the stream keeps it ordered
    return tensor.to(device, non_blocking=device.type == "cuda" and tensor.is_pinned())


def move_to_device(obj: Any, device: torch.device) -> Any:
    """Tensors, and tensors inside lists, tuples and dicts, moved to ``device``.

    The usual batch, a ``(data, label)`` pair of tensors already on ``device``, is returned as it is without
    walking it (a walk rebuilds every container, on the path that runs once per micro-batch).
    """
    if type(obj) is tuple and len(obj) == 2:
        data, label = obj
        if type(data) is torch.Tensor and type(label) is torch.Tensor and data.device == device \
                and label.device == device:
            return obj
    return map_leaves(lambda leaf: _to(leaf, device) if isinstance(leaf, torch.Tensor) else leaf, obj)


def first_tensor(obj: Any) -> Optional[torch.Tensor]:
    """The first tensor in ``obj`` (depth first), or None.

    The usual batch, a list or tuple that starts with a tensor, is answered without walking it: the batch size
    is asked for once per micro-batch."""
    if type(obj) in (tuple, list) and obj and type(obj[0]) is torch.Tensor:
        return obj[0]
    return next((leaf for leaf in iter_leaves(obj) if isinstance(leaf, torch.Tensor)), None)


def batch_len(obj: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor."""
    t = first_tensor(obj)
    if t is None or t.dim() == 0:
        raise TypeError(f"cannot split a batch of type {type(obj).__name__} into micro-batches: it holds no tensor "
                        f"with a batch dimension")
    return t.shape[0]


def split_samples(obj: Any, parts: int, n: int) -> List[Any]:
    """``obj`` cut along dim 0 into ``parts`` pieces: every tensor with ``n`` rows is cut, anything else repeated."""
    pieces = map_leaves(lambda leaf: _Pieces(leaf, parts, n), obj)
    return [map_leaves(operator.itemgetter(i), pieces) for i in range(parts)]


def join_samples(pieces: List[Any]) -> Any:
    """The pieces ``split_samples`` made, joined back: tensors with rows concatenated leaf by leaf, other leaves
    (a 0-dim value) the first piece's; one piece is returned as it is."""
    if len(pieces) == 1:
        return pieces[0]
    columns = zip(*(list(iter_leaves(piece)) for piece in pieces))
    joined = iter([torch.cat(column) if isinstance(column[0], torch.Tensor) and column[0].dim() else column[0]
                   for column in map(list, columns)])
    return map_leaves(lambda _: next(joined), pieces[0])


def take_rows(obj: Any, n: int, keep: int) -> Any:
    """``obj`` with its first ``keep`` of ``n`` rows: every tensor of ``n`` rows cut to ``keep``, and every list
    inside it of ``n`` items that are not all such tensors (a ``collate_fn``'s list of variable-length
    sequences, one item per sample) cut to its first ``keep`` items; anything else as it is."""
    def per_sample(x) -> bool:
        return (type(x) is list and x is not obj and len(x) == n
                and not all(isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == n for t in x))

    def cut(leaf):
        if per_sample(leaf):
            return leaf[:keep]
        return leaf[:keep] if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == n else leaf
    return map_leaves(cut, obj, is_leaf=per_sample)


class _Pieces:
    """A leaf cut into its micro-batch pieces (a leaf, not a container, so a walk takes it whole)."""

    def __init__(self, leaf: Any, parts: int, n: int):
        cut = isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == n
        self.pieces = torch.tensor_split(leaf, parts) if cut else [leaf] * parts

    def __getitem__(self, i: int) -> Any:
        return self.pieces[i]


def call_with(fn: Callable, args: Any):
    """Tensor -> fn(t), list/tuple -> fn(*x), dict -> fn(**x)."""
    if isinstance(args, dict):
        return fn(**args)
    if isinstance(args, (list, tuple)):
        return fn(*args)
    return fn(args)


def call_criterion(criterion: Callable, outputs: Any, labels: Any):
    """Legacy argument spreading: outputs and labels as tensors, sequences or dicts. A dict output (a Hugging Face
    ``ModelOutput`` is one) is spread only beside dict labels; beside anything else the criterion gets it whole,
    to pick what it needs: ``criterion(output, labels)``."""
    if type(outputs) is torch.Tensor and type(labels) is torch.Tensor:  # the usual pair: nothing to spread
        return criterion(outputs, labels)
    outs = (outputs,) if not isinstance(outputs, (list, tuple, dict)) else outputs
    labs = (labels,) if not isinstance(labels, (list, tuple, dict)) else labels
    if isinstance(outs, dict):
        return criterion(**outs, **labs) if isinstance(labs, dict) else criterion(outs, *labs)
    if isinstance(labs, dict):
        return criterion(*outs, **labs)
    return criterion(*outs, *labs)
