"""``checkpoint_info``: what a checkpoint holds and whether its files match their records (``ckpt info``)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from .io import (
    CheckpointDamagedError,
    CheckpointError,
    PathLike,
    file_checksum,
    tensor_bytes,
    to_jsonable,
    torch_load,
    verify_checksum,
    verify_records,
)
from .layout import POINTERS, SHARDED_DIR, read_meta, refuse_file_of_folder
from .merged import MERGED_KEY, is_merged, merged_meta
from .pointers import read_pointer, resolve_path
from .sharded import has_sharded_state


def checkpoint_info(path: PathLike) -> Dict[str, Any]:
    """What a checkpoint holds: epoch, step, metrics, config summary, versions and the size of each file and entry.

    ``path`` is a checkpoint folder, a ``last``/``best`` pointer, a checkpoint directory (its ``last``
    is shown), a single-file checkpoint from ``colossal_lite.utils.save_checkpoint`` or a file
    ``ckpt merge`` wrote.
    """
    p = Path(path)
    folder = resolve_path(p)
    refuse_file_of_folder(folder)  # (its entries are parts of the folder's state: a rank's random state, ...)
    if folder.is_file():
        return _file_info(p)
    meta = read_meta(folder)
    files = {entry.relative_to(folder).as_posix(): entry.stat().st_size
             for entry in sorted(folder.rglob("*")) if entry.is_file()}
    pointers = [w for w in POINTERS if read_pointer(folder.parent / w) == folder.name]
    damaged = _damaged_files(folder, meta)
    return {
        "path": str(folder), "kind": "folder", "name": folder.name, "epoch": meta.get("epoch"),
        "step": meta.get("step"), "metrics": meta.get("metrics", {}), "config": meta.get("config"),
        "version": meta.get("version"), "torch_version": meta.get("torch_version"),
        "world_size": meta.get("world_size"), "created_utc": meta.get("created_utc"), "files": files,
        "total_bytes": sum(files.values()), "entries": meta.get("entries", {}), "pointers": pointers,
        "damaged": damaged, "checksums": _checksum_summary(meta, damaged),
        "sharded_bytes": (sum(n for name, n in files.items() if name.startswith(SHARDED_DIR + "/"))
                          if has_sharded_state(folder) else None),
    }


def _file_info(p: Path) -> Dict[str, Any]:
    """``checkpoint_info`` of a single file; a merged one reports the metadata of the folder it was made from."""
    checked = verify_records(p)
    state = torch_load(p, checked)
    if not isinstance(state, dict):
        raise CheckpointError(f"{p} does not hold a checkpoint dict (it holds a {type(state).__name__})")
    lib = state.get("colossal_lite") if isinstance(state.get("colossal_lite"), dict) else {}
    meta = merged_meta(state) if is_merged(state) else {}
    size = p.stat().st_size
    return {
        "path": str(p), "kind": "merged file" if is_merged(state) else "file", "name": p.name,
        "epoch": meta.get("epoch", state.get("epoch")), "step": meta.get("step", state.get("step")),
        "metrics": meta.get("metrics") or {},
        "config": meta.get("config", to_jsonable(state.get("config")) if "config" in state else None),
        "version": meta.get("version", lib.get("version")),
        "torch_version": meta.get("torch_version", lib.get("torch_version")),
        "world_size": meta.get("world_size"), "created_utc": meta.get("created_utc"),
        "merged_from": state[MERGED_KEY].get("from") if is_merged(state) else None,
        "files": {p.name: size}, "total_bytes": size,
        "entries": {str(k): tensor_bytes(v) for k, v in state.items() if k not in ("colossal_lite", MERGED_KEY)},
        "pointers": [], "damaged": {},
        "checksums": ("every record matches the CRC-32 recorded in the file" if checked else
                      "none recorded in the file (an older torch format, or CRC-32 turned off when it was written)"),
    }


def _damaged_files(folder: Path, meta: Dict[str, Any]) -> Dict[str, str]:
    """``{file: why}`` for each file ``meta`` lists that is missing or differs from its recorded size or checksum."""
    sums = meta.get("checksums") or {}
    damaged = {}
    for name, size in meta.get("files", {}).items():
        p = folder / name
        if not p.is_file():
            damaged[name] = "missing"
        elif p.stat().st_size != size:
            damaged[name] = f"{p.stat().st_size} bytes, {size} recorded"
        elif name in sums:
            try:
                verify_checksum(p, sums[name])
            except CheckpointDamagedError:
                damaged[name] = f"checksum {file_checksum(p)}, {sums[name]} recorded"
    return damaged


def _checksum_summary(meta: Dict[str, Any], damaged: Dict[str, str]) -> str:
    """One line for ``ckpt info``: whether the files match what ``meta.json`` records."""
    files, sums = meta.get("files", {}), meta.get("checksums") or {}
    if damaged:
        return "DAMAGED: " + "; ".join(f"{name} ({why})" for name, why in damaged.items())
    if not sums:
        return f"none recorded (an older checkpoint); the sizes of all {len(files)} files match"
    by_size = len(files) - len(sums)
    return f"all {len(files)} files match" + (f" ({by_size} by size only)" if by_size else "")
