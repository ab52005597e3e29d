"""Walking nested containers (a batch, a model's output, a state dict): one definition of what a container is.

Lists, tuples (named ones too) and dicts, subclasses included, are containers; anything else is a leaf.
``map_leaves`` rebuilds each container as its own type, so a named tuple or a dict subclass comes back as
one. Unlike ``torch.utils._pytree``, which takes an unregistered subclass (a model output that subclasses
``OrderedDict``) for a leaf, a subclass is walked like its base here.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import torch

__all__ = ["map_leaves", "iter_leaves", "clone_tensors"]


def map_leaves(fn: Callable[[Any], Any], obj: Any, is_leaf: Optional[Callable[[Any], bool]] = None) -> Any:
    """``obj`` with ``fn`` applied to every leaf; ``is_leaf(x)`` True takes a container ``x`` whole, as a leaf."""
    if is_leaf is not None and is_leaf(obj):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        mapped = [map_leaves(fn, o, is_leaf) for o in obj]
        return type(obj)(*mapped) if hasattr(obj, "_fields") else type(obj)(mapped)
    if isinstance(obj, dict):
        return type(obj)((k, map_leaves(fn, v, is_leaf)) for k, v in obj.items())
    return fn(obj)


def iter_leaves(obj: Any) -> Iterator[Any]:
    """Every leaf of ``obj``, depth first in container order (a set's items count as leaves too)."""
    if isinstance(obj, dict):
        for v in obj.values():
            yield from iter_leaves(v)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            yield from iter_leaves(v)
    else:
        yield obj


def clone_tensors(obj: Any) -> Any:
    """``obj`` with every tensor copied into storage of its own. A checkpoint's tensors are views of the file's
    memory map (``checkpoint.io.load_file``); state that lives on after the load, such as an optimizer's (torch's
    ``load_state_dict`` keeps a tensor that has the parameter's device and dtype already), would keep the file
    mapped, and on the disk after retention deletes it, for the rest of the run."""
    return map_leaves(lambda leaf: leaf.clone() if isinstance(leaf, torch.Tensor) else leaf, obj)
