"""Walking nested containers (a batch, a model's output, a state dict): one definition of what a container is.

Lists, tuples (named ones too) and dicts, subclasses included, are containers; anything else is a leaf.
``map_leaves`` rebuilds each container as its own type, so a named tuple or a dict subclass comes back as
one. Unlike ``torch.utils._pytree``, which takes an unregistered subclass (a model output that subclasses
``OrderedDict``) for a leaf, a subclass is walked like its base here.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

__all__ = ["map_leaves", "iter_leaves"]


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
