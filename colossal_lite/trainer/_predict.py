"""``Trainer.predict`` over a whole loader: the outputs of every batch, in dataset order, gathered across ranks.

A distributed sampler gives each rank every ``world``-th index of a padded order (the padding repeats the first
indices so all ranks run the same number of batches). Each rank's output rows are paired with the indices its
sampler yields, the rows and indices of all ranks are gathered, and each dataset index keeps its first row, so
the result has one row per sample in index order, the padding's repeats dropped, the same on every rank.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch.utils.data import DataLoader, DistributedSampler

from ..core.dist import all_gather_rows, world_size
from ..core.tree import iter_leaves, map_leaves
from ..engine.batch import call_with, join_samples
from ..utils.data import DataParallelSampler

__all__ = ["is_loader", "predict_loader"]

_INDEXED = (DistributedSampler, DataParallelSampler)


def is_loader(data: Any) -> bool:
    """``data`` is a set of batches rather than one batch of inputs: a DataLoader, any other iterable that is
    not a tensor, list, tuple, dict or string (a generator), or a list whose items are all batches (lists,
    tuples or dicts). A tuple, a dict, a tensor, or a list holding a tensor is one batch of inputs."""
    if isinstance(data, DataLoader):
        return True
    if isinstance(data, (torch.Tensor, tuple, dict, str, bytes)):
        return False
    if isinstance(data, list):
        return len(data) > 0 and all(isinstance(b, (list, tuple, dict)) for b in data)
    return hasattr(data, "__iter__")


def _sampler_of(loader: Any):
    """The loader's distributed sampler (direct, or inside its batch sampler); None when it has none."""
    for sampler in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if isinstance(sampler, _INDEXED):
            return sampler
    return None


def _upcoming(sampler) -> List[int]:
    """The indices the sampler's next iteration yields; read before the loader starts it, since a
    DataParallelSampler moves to its next epoch when iterated."""
    if isinstance(sampler, DataParallelSampler):
        return sampler.upcoming_indices()
    return list(iter(sampler))  # a DistributedSampler's order depends only on its epoch and seed


def _inputs(schedule, batch: Any, device) -> Any:
    """The model's inputs in ``batch``: the schedule's split, as in evaluation ((data, label) pairs, or what
    ``data_process_func`` returns); a bare tensor is taken as the inputs alone. A dict batch goes into the model
    without its ``'labels'``, as a pair's label does not: with them a Hugging Face model adds its loss, a value of
    the batch, not of each sample."""
    if isinstance(batch, torch.Tensor) and schedule.data_process_func is None:
        return schedule.place((batch, None), device)[1]
    _, data, label = schedule.place(batch, device)
    if isinstance(data, dict) and label is not None and data.get("labels") is label:
        data = {key: value for key, value in data.items() if key != "labels"}
    return data


def _concat(outputs: List[Any]) -> Any:
    """The per-batch outputs joined along the first dimension, leaf by leaf (a tensor, or a nest of them)."""
    if not outputs:
        raise ValueError("predict got an empty loader: there are no outputs to return")
    for leaf in (leaf for out in outputs for leaf in iter_leaves(out)):
        if not (isinstance(leaf, torch.Tensor) and leaf.dim() > 0):
            got = "a 0-dim tensor (a value of the whole batch, such as a loss)" if isinstance(leaf, torch.Tensor) \
                else f"a {type(leaf).__name__}"
            raise TypeError("predict over a loader joins the outputs along their first (batch) dimension, so every "
                            f"output must be a tensor with one, or a list/tuple/dict of them; got {got}. Fix: let "
                            "the model return per-sample values only in prediction, or predict each batch on its own "
                            "(trainer.predict(batch))")
    first = [leaf.shape[1:] for leaf in iter_leaves(outputs[0])]
    for index, out in enumerate(outputs):
        shapes = [leaf.shape[1:] for leaf in iter_leaves(out)]
        if shapes != first:
            raise ValueError(f"predict over a loader joins the batches' outputs along the first dimension, but batch "
                             f"{index}'s differ from batch 0's beyond it ({_shapes(shapes)} against {_shapes(first)}): "
                             f"a collate_fn that pads each batch to its own longest sequence does this. Fix: pad every "
                             f"batch to one length, or predict each batch on its own (trainer.predict(batch))")
    return join_samples(outputs)


def _shapes(shapes: List[torch.Size]) -> str:
    return ", ".join(f"(batch, {', '.join(map(str, shape))})" if len(shape) else "(batch,)" for shape in shapes)


def _in_dataset_order(output: Any, indices: List[int]) -> Any:
    """Every rank's rows, gathered, one per dataset index (its first occurrence), in index order."""
    leaves = list(iter_leaves(output))
    rows = leaves[0].shape[0]
    if rows > len(indices):
        raise ValueError(f"the loader gave {rows} rows but its sampler only {len(indices)} indices")
    mine = torch.tensor(indices[:rows], dtype=torch.long, device=leaves[0].device)  # a drop_last loader stops early
    every = torch.cat(all_gather_rows(mine))
    order = torch.argsort(every, stable=True)
    ranked = every[order]
    first = torch.ones_like(ranked, dtype=torch.bool)
    first[1:] = ranked[1:] != ranked[:-1]
    take = order[first]
    joined = iter([torch.cat(all_gather_rows(leaf))[take.to(leaf.device)] for leaf in leaves])
    return map_leaves(lambda _: next(joined), output)


def predict_loader(engine, loader: Any) -> Any:
    """The engine's forward (under its precision) over every batch of ``loader``; call it in eval mode under
    ``torch.no_grad``. With a distributed sampler the result is every rank's, in dataset order; without one,
    each rank returns its own batches' outputs in the loader's order."""
    sampler: Optional[Any] = _sampler_of(loader)
    indices = _upcoming(sampler) if sampler is not None else None
    if sampler is not None:
        # The gathered rows are of one model, rank 0's, as in evaluation: every rank calls this (the gather is a
        # collective), so the first forward can bring its buffers (after EMA's swap each rank holds its own).
        engine.strategy.sync_buffers_at_next_forward(engine.model)
    outputs = [call_with(engine, _inputs(engine.schedule, batch, engine.device)) for batch in loader]
    output = _concat(outputs)
    if indices is None:
        return output
    if world_size() == 1 and len(indices) == len(set(indices)) and indices == sorted(indices):
        return output  # already in dataset order, nothing padded
    return _in_dataset_order(output, indices)
