"""Which modules become FSDP2 units: the policy a user of ``fully_shard`` writes by hand.

One unit per repeated block (transformer layers, ResNet blocks), then the root, as torchtitan and the FSDP2
tutorials shard: each unit is one all-gather and one reduce-scatter per step, so units are few and large.
Under bf16/fp16 the layers that keep running statistics (BatchNorm) are grouped into one full-precision unit:
``batch_norm`` refuses low-precision weights next to its fp32 statistics, and one group costs one extra
all-gather per step where a unit per layer costs one per layer. LayerNorm, GroupNorm and RMSNorm stay in their
block's unit, gathered in the low precision like every other weight (their sharded master copy stays fp32), as
the hand-written FSDP2 loop gathers them.
"""
from __future__ import annotations

from collections import Counter
from typing import List, Optional, Sequence

from torch import nn

CONTAINERS = (nn.ModuleList, nn.Sequential)
# layers whose functional form reads fp32 buffers (running statistics) next to the weights FSDP2 would cast
STATISTICS_NORMS = (nn.modules.batchnorm._NormBase,)


def _holds_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _outermost(modules: List[nn.Module]) -> List[nn.Module]:
    """The modules not inside another of them (a nested unit would add collectives, not save memory)."""
    inner = {id(sub) for m in modules for sub in m.modules() if sub is not m}
    return [m for m in modules if id(m) not in inner]


def named_classes(model: nn.Module, names: Sequence[str]) -> List[nn.Module]:
    """The modules of ``model`` whose class name is in ``names`` (the config's ``zero.shard_modules``)."""
    wanted = set(names)
    units = [m for m in model.modules() if type(m).__name__ in wanted and m is not model]
    missing = wanted - {type(m).__name__ for m in units}
    if missing:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(f"zero.shard_modules names {sorted(missing)}, which are not module classes of the model; "
                         f"the model has: {', '.join(present)}")
    return _outermost(units)


def no_split_classes(model: nn.Module) -> Optional[List[str]]:
    """A Hugging Face model's own block classes (``PreTrainedModel._no_split_modules``), found on the model or a
    module inside it (a user's wrapper); None when there is none."""
    for m in model.modules():
        names = getattr(type(m), "_no_split_modules", None)
        if isinstance(names, (list, tuple, set)) and names:
            present = {type(sub).__name__ for sub in model.modules()}
            found = [n for n in names if n in present]
            if found:
                return found
    return None


def repeated_blocks(model: nn.Module) -> List[nn.Module]:
    """Children of a ``ModuleList``/``Sequential`` that are blocks (they hold layers, not only parameters) of a
    class that occurs at least twice: a transformer's layers, a torchvision ResNet's BasicBlocks/Bottlenecks."""
    candidates = [child for m in model.modules() if isinstance(m, CONTAINERS) for child in m.children()
                  if not isinstance(child, CONTAINERS) and any(True for _ in child.children())
                  and _holds_parameters(child)]
    counts = Counter(type(c) for c in candidates)
    return _outermost([c for c in candidates if counts[type(c)] > 1])


def fallback_units(model: nn.Module) -> List[nn.Module]:
    """Without repeated blocks: the children of the largest ``ModuleList``/``Sequential``, else the direct
    children, that hold parameters (parameters still sharded per piece at stage 3)."""
    best: Optional[Sequence[nn.Module]] = None
    for m in model.modules():
        if isinstance(m, CONTAINERS) and len(m) > 1 and (best is None or len(m) > len(best)):
            best = m
    units = list(best) if best is not None else list(model.children())
    return [u for u in units if _holds_parameters(u)]


def block_units(model: nn.Module, names: Optional[Sequence[str]] = None) -> List[nn.Module]:
    """The sharding units, in order of preference: the classes the config names, a Hugging Face model's
    ``_no_split_modules``, the repeated blocks, else ``fallback_units``."""
    if names:
        return named_classes(model, names)
    hf = no_split_classes(model)
    if hf:
        return named_classes(model, hf)
    return repeated_blocks(model) or fallback_units(model)


def statistics_norms(model: nn.Module) -> List[nn.Module]:
    """The BatchNorm-like layers with parameters: one full-precision unit under bf16/fp16."""
    return [m for m in model.modules() if isinstance(m, STATISTICS_NORMS) and m is not model
            and any(True for _ in m.parameters(recurse=False))]
