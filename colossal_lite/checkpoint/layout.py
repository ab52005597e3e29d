"""The on-disk layout of a checkpoint directory: names, ``meta.json``, the files it lists, leftovers.

Layout of ``checkpoint_dir``::

    epoch3-step120/          one complete checkpoint
        shared.pt            replicated state (model, optimizer, schedulers, trainer progress), written by rank 0
        rank0.pt, rank1.pt   per-rank state (RNG, data position), one file per rank
        sharded/             torch.distributed.checkpoint shards of a ZeRO stage 2/3 run (``sharded.py``)
        meta.json            epoch, step, metrics, config summary, versions, file sizes and checksums; written last
        save_times.json      the save's own times, added by rank 0 once it is complete (not part of the checkpoint)
    last                     text file holding the name of the newest complete checkpoint (``pointers.py``)
    best                     text file holding the name of the best one (by ``save_best``)
    .tmp-*                   an unfinished write (removed at the next start)

A folder is complete when its ``meta.json`` is there and is ours: it is written last, just before
the folder is renamed into place (``writer.py``).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .io import (
    DEL_PREFIX,
    TMP_PREFIX,
    CheckpointDamagedError,
    CheckpointError,
    CheckpointNotFoundError,
    PathLike,
    atomic_write_text,
)

SHARED_FILE = "shared.pt"
SHARDED_DIR = "sharded"  # torch.distributed.checkpoint files: each rank writes its own shard
META_FILE = "meta.json"
SAVE_TIMES_FILE = "save_times.json"
POINTERS = ("last", "best")
FORMAT = "colossal_lite.checkpoint"
FORMAT_VERSION = 1
NAME_RE = re.compile(r"epoch(-?\d+)-step(-?\d+)")


def rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def checkpoint_name(epoch: int, step: int) -> str:
    """The folder name of the checkpoint taken at ``epoch`` (0-based) after ``step`` optimizer steps."""
    return f"epoch{int(epoch)}-step{int(step)}"


def check_name(name: str) -> str:
    if not isinstance(name, str) or not name or name in POINTERS or name.startswith(".") or name in ("..",) \
            or "/" in name or "\\" in name or name != name.strip():
        raise ValueError(f"checkpoint name {name!r} cannot be used: give a plain folder name that does not start "
                         f"with '.' and is not 'last' or 'best', e.g. {checkpoint_name(3, 120)!r}")
    return name


def refuse_file_of_folder(path) -> None:
    """Raise ``CheckpointError`` when ``path`` is one file of a checkpoint folder (``shared.pt``, a rank's file):
    the folder is read whole, so the error names it to give instead."""
    path = Path(path)
    if path.is_file() and (path.parent / META_FILE).is_file():
        raise CheckpointError(f"{path} is one file of the checkpoint folder {path.parent}, which is read whole: "
                              f"give the folder instead ({str(path.parent)!r})")


def read_meta(folder: PathLike) -> Dict[str, Any]:
    """The ``meta.json`` of a checkpoint folder; ``CheckpointError`` when it is missing or not ours."""
    folder = Path(folder)
    meta_path = folder / META_FILE
    if not folder.is_dir():
        raise CheckpointNotFoundError(f"checkpoint {folder} does not exist")
    if not meta_path.is_file():
        raise CheckpointError(f"{folder} is not a complete checkpoint: it has no {META_FILE} (an interrupted write, "
                              f"or not a colossal_lite checkpoint folder)")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointDamagedError(f"could not read {meta_path}: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path} is not colossal_lite checkpoint metadata")
    return meta


def is_complete(folder: Path) -> Optional[Dict[str, Any]]:
    """The folder's metadata when it is a complete checkpoint, else ``None``."""
    try:
        return read_meta(folder)
    except CheckpointError:
        return None


def complete_checkpoints(checkpoint_dir: Path) -> List[Tuple[Path, Dict[str, Any]]]:
    """``(folder, meta)`` of every complete checkpoint in ``checkpoint_dir``, in the order they were written."""
    if not checkpoint_dir.is_dir():
        return []
    found = []
    for entry in checkpoint_dir.iterdir():
        if entry.name.startswith(".") or entry.name in POINTERS or not entry.is_dir():
            continue
        meta = is_complete(entry)
        if meta is not None:
            found.append((entry, meta))
    found.sort(key=lambda pm: (int(pm[1].get("seq", 0)), pm[1].get("created", 0), pm[0].name))
    return found


def newest_checkpoint(checkpoint_dir: Path) -> Optional[Path]:
    """The newest complete checkpoint in ``checkpoint_dir``, whatever the pointers say; ``None`` if there is none."""
    found = complete_checkpoints(checkpoint_dir)
    return found[-1][0] if found else None


def verify_files(folder: PathLike, meta: Dict[str, Any]) -> None:
    """Check that every file ``meta`` lists is there with the recorded size (checksums are checked as files are read)."""
    folder = Path(folder)
    for fname, size in meta.get("files", {}).items():
        p = folder / fname
        if not p.is_file():
            raise CheckpointDamagedError(f"checkpoint {folder} is damaged: {fname} is missing")
        actual = p.stat().st_size
        if actual != size:
            raise CheckpointDamagedError(f"checkpoint {folder} is damaged: {fname} has {actual} bytes, "
                                         f"{META_FILE} records {size}")


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own leftover from an earlier failed attempt
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists but belongs to someone else
    return True


def remove(path: Path) -> None:
    """Delete ``path`` (a file or a folder) if it can be; a clean-up never raises (a read-only file system)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except OSError:
            pass


def remove_leftovers(checkpoint_dir: PathLike) -> List[Path]:
    """Delete what interrupted writes left in ``checkpoint_dir`` (``.tmp-*``, ``.del-*`` of processes that are gone)."""
    root = Path(checkpoint_dir)
    removed = []
    if not root.is_dir():
        return removed
    for entry in root.iterdir():
        if not entry.name.startswith((TMP_PREFIX, DEL_PREFIX)):
            continue
        m = re.search(r"-(\d+)$", entry.name)
        if m and pid_alive(int(m.group(1))):
            continue  # another live process on this machine is writing it
        remove(entry)
        if not entry.exists():
            removed.append(entry)
    return removed


def write_save_times(folder: PathLike, step: int, epoch: int, time: float, values: Dict[str, float]) -> None:
    """Add a complete checkpoint's own save times to its folder. They are measured once the checkpoint is written,
    so its history cannot hold them; a run resumed from it takes them back (``read_save_times``). Not listed in
    ``meta.json``: the checkpoint is complete and verified without it."""
    atomic_write_text(Path(folder) / SAVE_TIMES_FILE,
                      json.dumps({"step": step, "epoch": epoch, "time": time, "values": values}))


def read_save_times(folder: PathLike) -> Optional[Dict[str, Any]]:
    """``write_save_times``'s record of ``folder``, or None (a save that ended before it was added, an older
    checkpoint, a file that is not one)."""
    try:
        record = json.loads((Path(folder) / SAVE_TIMES_FILE).read_text(encoding="utf-8"))
        values = {str(name): float(value) for name, value in record["values"].items()}
        return {"step": int(record["step"]), "epoch": int(record["epoch"]), "time": float(record["time"]),
                "values": values}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
