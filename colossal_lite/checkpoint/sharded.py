"""Sharded (ZeRO stage 2/3) state in a checkpoint folder's ``sharded/``: torch.distributed.checkpoint files.

Each rank writes its own shard with ``torch.distributed.checkpoint`` (DCP). DCP writes its files
itself, so their checksums are taken by reading them back, each file by one rank.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Set

from .io import (
    CheckpointDamagedError,
    CheckpointError,
    CheckpointNotFoundError,
    PathLike,
    file_checksum,
    fsync_dir,
    load_file,
    verify_checksum,
)
from .layout import SHARDED_DIR, SHARED_FILE, read_meta, verify_files
from .ranks import Ranks
from .sharded_read import checking_reader

OPTIMIZER_STATE_PREFIX = "optimizer.state."  # DCP's flattened names of the optimizer's per-parameter state


def sharded_share(names: List[str], rank: int, world_size: int) -> List[str]:
    """This rank's share of the sharded files ``names`` (each file is checksummed by one rank)."""
    return [n for n in sorted(names) if n.startswith(SHARDED_DIR + "/")][rank::world_size]


def sharded_checksums(folder: Path, rank: int, world_size: int) -> Dict[str, str]:
    """Checksums of this rank's share of the files torch.distributed.checkpoint wrote into ``folder/sharded``.

    DCP writes its files itself, so they are read back once (from the page cache, just after
    the write) and the ranks split the reading.
    """
    names = [f"{SHARDED_DIR}/{p.name}" for p in (folder / SHARDED_DIR).iterdir() if p.is_file()]
    return {n: file_checksum(folder / n) for n in sharded_share(names, rank, world_size)}


def sharded_sums(meta: Dict[str, Any]) -> Dict[str, str]:
    """``{file name inside sharded/: checksum}`` as ``meta`` records them."""
    prefix = SHARDED_DIR + "/"
    return {name[len(prefix):]: value for name, value in (meta.get("checksums") or {}).items()
            if name.startswith(prefix)}


def verify_sharded(folder: PathLike, meta: Dict[str, Any]) -> None:
    """Compare every sharded file with the checksum ``meta`` records (a reader in one process; ``load_sharded``
    checks what it reads as it reads it)."""
    for name, value in sorted(sharded_sums(meta).items()):
        verify_checksum(Path(folder) / SHARDED_DIR / name, value)


def lowest_rank_planner():
    """torch.distributed.checkpoint's planner, with a tensor every rank holds (not a DTensor: the BatchNorm statistics
    that ZeRO 2/3 leave unsynced) saved from rank 0. Its default spreads such tensors over the ranks one by one,
    so a layer's running mean could come from one rank and its running variance from another."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    return DefaultSavePlanner(dedup_save_to_lowest_rank=True)


def save_sharded(state: Dict[str, Any], folder: Path) -> None:
    """Every rank writes its shard of ``state`` (DTensors) with torch.distributed.checkpoint, then fsyncs."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder), sync_files=True), planner=lowest_rank_planner())
    if folder.is_dir():
        fsync_dir(folder)


def load_sharded(path: PathLike, state: Dict[str, Any]) -> Dict[str, Any]:
    """Fill ``state`` (this run's DTensor layout, any number of ranks) from ``path/sharded`` in place. Collective.

    Every byte is compared with the checksums ``meta.json`` records as DCP reads it (``sharded_read.py``):
    the ranks share what they read, so each byte is read once. A damaged file raises ``CheckpointDamagedError`` naming
    it on every rank, after ``state`` was filled (so the run must not go on with it)."""
    import torch.distributed.checkpoint as dcp

    folder = Path(path) / SHARDED_DIR
    if not folder.is_dir():
        raise CheckpointNotFoundError(f"checkpoint {path} has no sharded state ({folder} is missing): it was not "
                                      f"written by a zero stage 2/3 run; load it with zero stage 0/1, or merge it")
    reader, ranks = checking_reader(folder, sharded_sums(read_meta(path))), Ranks()
    error: Optional[BaseException] = None
    read = {}
    try:
        dcp.load(state, storage_reader=reader)
        read = reader.fs.pieces_read()
    except Exception as e:  # noqa: BLE001 - every rank must reach the agreements below
        error = reader.fs.damaged or e
    failed, every_rank = ranks.failures(error, read)
    if not failed:
        try:
            reader.fs.verify(folder, every_rank, ranks.rank)
        except Exception as e:  # noqa: BLE001 - every rank must reach the agreement below
            error = reader.fs.damaged or e
    _agree_loaded(ranks, error, path)
    return state


def _agree_loaded(ranks: Ranks, error: Optional[BaseException], path: PathLike) -> None:
    """Raise on every rank when one failed; a damaged file is named on every rank (DCP rewraps the error it met)."""
    failed, _ = ranks.failures(error)
    if not failed:
        return
    if isinstance(error, CheckpointDamagedError):
        raise error
    for rank, (kind, message) in failed:
        if kind == CheckpointDamagedError.__name__:
            raise CheckpointDamagedError(f"{message} (reported by rank {rank})")
    if error is not None:
        raise error
    rank, (kind, message) = failed[0]
    raise CheckpointError(f"could not load the sharded state of {path}: rank {rank} failed: {kind}: {message}")


def has_sharded_state(path: PathLike) -> bool:
    return (Path(path) / SHARDED_DIR).is_dir()


def optimizer_state_keys(path: PathLike) -> Set[str]:
    """The keys of the optimizer state ``path/sharded`` holds (``optimizer.state.<parameter>.<name>``: Adam's step
    and moments). A parameter that never had a gradient (unused in the forward), or every parameter before the first
    applied update (its first steps skipped: an fp16 overflow, ``nonfinite_loss='skip'``), has none. Read from DCP's
    metadata, checked against ``meta.json``. A collective: every rank reads it, and all raise if one could not."""
    folder = Path(path) / SHARDED_DIR
    keys: List[str] = []
    error: Optional[BaseException] = None
    try:
        reader = checking_reader(folder, sharded_sums(read_meta(path)))
        keys = list(reader.read_metadata().state_dict_metadata)
    except Exception as e:  # noqa: BLE001 - every rank must reach the agreement below
        error = e
    Ranks().agree(error, f"read the sharded state's metadata of {path}", fallback=CheckpointError)
    return {key for key in keys if key.startswith(OPTIMIZER_STATE_PREFIX)}


def merge_sharded(path: PathLike) -> Dict[str, Any]:
    """The full (unsharded) state of ``path/sharded`` in this one process, as plain tensors."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = Path(path) / SHARDED_DIR
    if not folder.is_dir():
        raise CheckpointNotFoundError(f"{path} has no sharded state to merge ({folder} is missing): it was not written "
                                      f"by a zero stage 2/3 run, and its {SHARED_FILE} already holds the whole model "
                                      f"and optimizer; resume from the folder itself")
    meta = read_meta(path)
    verify_files(path, meta)
    verify_sharded(path, meta)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "merged.pt"
        dcp_to_torch_save(str(folder), str(out))
        return load_file(out)
