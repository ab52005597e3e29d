"""Reading a checkpoint in one process (no collectives), every file verified before it is unpickled.

``read_checkpoint`` reads a folder or a file ``ckpt merge`` wrote; ``load_shared`` only the
replicated state; ``merge_checkpoint`` makes the content of that one file (see ``merged.py``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

from .io import CheckpointError, PathLike, load_file, load_single_file
from .layout import SHARDED_DIR, SHARED_FILE, rank_file, read_meta, refuse_file_of_folder, verify_files
from .merged import merged_state, split_merged, warn_no_rank_state, warn_other_world
from .pointers import is_single_file, resolve_path
from .sharded import merge_sharded, verify_sharded


def read_checkpoint(path: PathLike, rank: int = 0, world_size: Optional[int] = None
                    ) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
    """Read a checkpoint in this process only (no collectives): ``(shared_state, rank_state of rank)``.

    ``path`` is a checkpoint folder or a file ``ckpt merge`` wrote. Every file read is first compared
    with the checksum ``meta.json`` records (``CheckpointDamagedError`` naming the file). The sharded
    files are checked by size here, and by checksum as ``load_sharded`` reads them (each byte read
    once), or here, all of them, when ``world_size`` is None (one process reading the whole checkpoint).
    Checkpoints written before checksums were recorded are checked by size. A merged file is checked
    against the CRC-32 of each record of its zip archive.
    """
    path = Path(path)
    refuse_file_of_folder(path)
    if path.is_file():
        return split_merged(load_single_file(path), path, rank, world_size)
    meta = read_meta(path)
    verify_files(path, meta)
    sums = meta.get("checksums") or {}
    warn_other_world(path, meta.get("world_size"), rank, world_size)
    shared = load_file(path / SHARED_FILE, sums.get(SHARED_FILE))
    rank_path = path / rank_file(rank)
    if rank_path.is_file():
        rank_state = load_file(rank_path, sums.get(rank_file(rank)))
    else:
        rank_state = None
        warn_no_rank_state(path, meta.get("world_size"), rank)
    if world_size is None:
        verify_sharded(path, meta)
    return shared, rank_state


def load_shared(folder: PathLike) -> Dict[str, Any]:
    """The verified ``shared.pt`` of a checkpoint folder (one process, no collectives)."""
    folder = Path(folder)
    meta = read_meta(folder)
    verify_files(folder, meta)
    return load_file(folder / SHARED_FILE, (meta.get("checksums") or {}).get(SHARED_FILE))


def merge_checkpoint(path: PathLike) -> Dict[str, Any]:
    """The content of one file that holds the whole checkpoint ``path`` names (see ``merged.py``); every file verified.

    ``path`` is a checkpoint folder written by a ZeRO stage 2/3 run, a pointer or a checkpoint directory.
    """
    if is_single_file(path):
        raise CheckpointError(f"{path} is already a single file: ckpt merge reads a checkpoint folder written by a "
                              f"zero stage 2/3 run (one with a {SHARDED_DIR}/ folder)")
    folder = resolve_path(path)
    meta = read_meta(folder)
    full = merge_sharded(folder)  # verifies every file and every shard first
    sums = meta.get("checksums") or {}
    shared = load_file(folder / SHARED_FILE, sums.get(SHARED_FILE))
    ranks = [load_file(folder / rank_file(r), sums.get(rank_file(r))) for r in range(int(meta.get("world_size") or 0))]
    return merged_state(shared, full, ranks, meta, folder)


def model_state_from(shared: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """The model weights inside a checkpoint's shared state: ``shared['model']`` or ``shared['engine']['model']``."""
    for candidate in (shared.get("model"), (shared.get("engine") or {}).get("model")
                      if isinstance(shared.get("engine"), dict) else None):
        if isinstance(candidate, dict) and candidate and all(isinstance(v, torch.Tensor) for v in candidate.values()):
            return candidate
    raise CheckpointError(f"no model weights found in this checkpoint: expected a dict of tensors under 'model' or "
                          f"'engine' -> 'model', found top-level keys {sorted(map(str, shared))}")
