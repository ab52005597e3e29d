"""Writing one checkpoint folder atomically, every rank taking part.

A checkpoint is written into ``.tmp-<name>-<pid>`` and renamed into place once every rank's file
is in it and fsynced, ``meta.json`` (with every file's size and checksum, computed as it is
written) last. A process killed at any instant therefore leaves no folder that looks complete and
is not. What happens once the folder is in place (pointers, retention) is the caller's policy,
run by rank 0 inside the same agreement, so its failure raises on every rank too.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from .._version import __version__
from ..core.global_context import global_context as gpc
from .io import (
    TMP_PREFIX,
    CheckpointWriteError,
    _describe_os_error,
    fsync_dir,
    save_file,
    tensor_bytes,
    to_jsonable,
    to_plain,
    write_json,
)
from .layout import (
    FORMAT,
    FORMAT_VERSION,
    META_FILE,
    NAME_RE,
    SHARDED_DIR,
    SHARED_FILE,
    check_name,
    complete_checkpoints,
    rank_file,
    remove,
)
from .pointers import read_pointer
from .ranks import Ranks
from .sharded import save_sharded, sharded_checksums

USE_GPC_CONFIG = object()  # the default ``config``: the launched run's ``gpc.config``

# run by rank 0 once the folder is in place: (folder, the metrics as recorded in its meta.json)
OnComplete = Callable[[Path, Dict[str, Any]], None]


@dataclass
class FolderWrite:
    """One checkpoint folder being written: where it goes, what goes into it, and who completes it."""

    checkpoint_dir: Path
    ranks: Ranks
    target: Path  # the folder's final name
    tmp: Path  # where it is written until it is complete
    shared_plain: Any  # rank 0's shared state (None on other ranks)
    rank_plain: Any
    metrics: Dict[str, Any]
    epoch: Optional[int]
    step: Optional[int]
    config: Any
    save_best: Optional[Tuple[str, str]]
    on_complete: OnComplete


def write_checkpoint(checkpoint_dir: Path, name: str, shared_state: Optional[Dict[str, Any]],
                     rank_state: Optional[Dict[str, Any]], metrics: Optional[Dict[str, Any]], *,
                     epoch: Optional[int], step: Optional[int], config: Any,
                     sharded_state: Optional[Dict[str, Any]], save_best: Optional[Tuple[str, str]],
                     on_complete: OnComplete) -> Path:
    """Write one checkpoint folder and return it (see ``CheckpointManager.save``). Collective.

    ``save_best`` is recorded in the metadata; ``on_complete`` runs on rank 0 after the rename.
    A failure on any rank raises on every rank and leaves earlier checkpoints as they were.
    """
    job = begin_write(checkpoint_dir, name, shared_state, rank_state, metrics, epoch=epoch, step=step, config=config,
                      save_best=save_best, on_complete=on_complete)
    return complete_write(job, _write_files(job, sharded_state))


def begin_write(checkpoint_dir: Path, name: str, shared_state: Optional[Dict[str, Any]],
                rank_state: Optional[Dict[str, Any]], metrics: Optional[Dict[str, Any]], *,
                epoch: Optional[int], step: Optional[int], config: Any, save_best: Optional[Tuple[str, str]],
                on_complete: OnComplete, stage: Optional[Callable[[Any], Any]] = None) -> FolderWrite:
    """Check and convert the state (and ``stage`` it: an asynchronous save's host copy), make the folder. Collective."""
    check_name(name)
    ranks = Ranks()
    epoch, step = numbers_from(name, epoch, step)
    error: Optional[BaseException] = None
    shared_plain = rank_plain = None
    metrics_plain: Dict[str, Any] = {}
    try:
        rank_plain = to_plain({} if rank_state is None else rank_state, "rank_state")
        if ranks.rank == 0:
            if not isinstance(shared_state, dict):
                raise TypeError(f"shared_state must be a dict, got {type(shared_state).__name__}")
            shared_plain = to_plain(shared_state, "shared_state")
            metrics_plain = {str(k): _metric_value(v) for k, v in (metrics or {}).items()}
            config = to_jsonable(gpc.config if config is USE_GPC_CONFIG else config)
        if stage is not None:
            shared_plain, rank_plain = stage((shared_plain, rank_plain))
    except Exception as e:  # noqa: BLE001 - every rank must reach the collective below
        error = e
    target, tmp = _make_folder(checkpoint_dir, ranks, name, error)
    return FolderWrite(checkpoint_dir, ranks, target, tmp, shared_plain, rank_plain, metrics_plain, epoch, step,
                       config, save_best, on_complete)


def write_rank_files(job: FolderWrite) -> Dict[str, str]:
    """This rank's files into ``job.tmp`` (no collectives); their checksums. Raises ``OSError`` as the disk does."""
    ranks = job.ranks
    if not job.tmp.is_dir():
        raise CheckpointWriteError(f"could not write checkpoint {job.target}: the folder {job.tmp} made by rank 0 is "
                                   f"not visible on rank {ranks.rank}; checkpoint_dir must be on a "
                                   f"filesystem every rank shares")
    sums: Dict[str, str] = {}
    if ranks.rank == 0:
        sums[SHARED_FILE] = save_file(job.shared_plain, job.tmp / SHARED_FILE)
    sums[rank_file(ranks.rank)] = save_file(job.rank_plain, job.tmp / rank_file(ranks.rank))
    return sums


def write_error(job: FolderWrite, e: BaseException) -> BaseException:
    """The error a failed write raises: an ``OSError`` becomes a ``CheckpointWriteError`` naming the checkpoint."""
    if isinstance(e, OSError) and type(e) is not CheckpointWriteError:
        return _write_error(job.checkpoint_dir, job.target, e)
    return e


def agree_written(job: FolderWrite, error: Optional[BaseException], sums: Dict[str, str]) -> Dict[str, str]:
    """Every rank's checksums once every rank wrote its files; else raise on every rank (the folder is removed)."""
    ranks = job.ranks
    return _merged(ranks.agree(error, f"checkpoint {job.target} was not written",
                               lambda: ranks.rank == 0 and remove(job.tmp), payload=sums))


def commit_folder(job: FolderWrite, checksums: Dict[str, str]) -> Optional[BaseException]:
    """Rank 0 completes the written folder: metadata, rename into place, then the caller's policy (no collectives).

    Returns the error that stopped it (the temporary folder is then removed), or None."""
    try:
        meta = _meta(job, checksums)
        _commit(job.checkpoint_dir, job.tmp, job.target, meta)
        job.on_complete(job.target, job.metrics)
    except Exception as e:  # noqa: BLE001 - every rank raises it once the ranks agree
        if job.tmp.exists():
            remove(job.tmp)
        return write_error(job, e)
    return None


def complete_write(job: FolderWrite, checksums: Dict[str, str]) -> Path:
    """Rank 0 completes the folder (``commit_folder``); a failure raises on every rank. Collective."""
    error = commit_folder(job, checksums) if job.ranks.rank == 0 else None
    job.ranks.agree(error, f"checkpoint {job.target} was not completed")
    return job.target


def numbers_from(name: str, epoch: Optional[int], step: Optional[int]) -> Tuple[Optional[int], Optional[int]]:
    """``epoch`` and ``step``, each defaulting to the number in a ``checkpoint_name``-style ``name``."""
    if epoch is None or step is None:
        m = NAME_RE.search(name)
        if m:
            epoch = int(m.group(1)) if epoch is None else epoch
            step = int(m.group(2)) if step is None else step
    return epoch, step


def _metric_value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().float().item() if v.numel() == 1 else to_jsonable(v)
    if hasattr(v, "item") and callable(v.item):  # NumPy scalars
        try:
            return v.item()
        except (TypeError, ValueError):
            pass
    return to_jsonable(v)


def _make_folder(checkpoint_dir: Path, ranks: Ranks, name: str, error: Optional[BaseException]) -> Tuple[Path, Path]:
    """Rank 0 makes the temporary folder (under a free name); every rank gets ``(target, tmp)``. Collective."""
    target = checkpoint_dir / name
    tmp: Optional[Path] = None
    final = name
    if ranks.rank == 0 and error is None:
        try:
            checkpoint_dir.mkdir(parents=True, exist_ok=True)
            final = _free_name(checkpoint_dir, name)
            target = checkpoint_dir / final
            tmp = checkpoint_dir / f"{TMP_PREFIX}{final}-{os.getpid()}"
            if tmp.exists():
                remove(tmp)
            tmp.mkdir()
        except OSError as e:
            error = _write_error(checkpoint_dir, target, e)
    ranks.agree(error, f"checkpoint {target} was not written", lambda: tmp is not None and remove(tmp))
    final, tmp_name = ranks.broadcast((final, None if tmp is None else tmp.name))
    return checkpoint_dir / final, checkpoint_dir / tmp_name


def _write_files(job: FolderWrite, sharded_state: Optional[Dict[str, Any]]) -> Dict[str, str]:
    """Every rank writes its own file(s) into ``job.tmp``; returns every file's checksum (all ranks). Collective."""
    error: Optional[BaseException] = None
    sums: Dict[str, str] = {}
    try:
        sums = write_rank_files(job)
    except Exception as e:  # noqa: BLE001 - every rank must reach the collective below
        error = write_error(job, e)
    checksums = agree_written(job, error, sums)
    if sharded_state is not None:
        sums = {}
        try:
            save_sharded(sharded_state, job.tmp / SHARDED_DIR)
            sums = sharded_checksums(job.tmp, job.ranks.rank, job.ranks.world_size)
        except Exception as e:  # noqa: BLE001 - every rank must reach the collective below
            error = write_error(job, e)
        checksums.update(agree_written(job, error, sums))
    return checksums


def _merged(dicts) -> Dict[str, str]:
    out: Dict[str, str] = {}
    for d in dicts:
        out.update(d or {})
    return out


def _free_name(checkpoint_dir: Path, name: str) -> str:
    final, k = name, 0
    while (checkpoint_dir / final).exists():
        k += 1
        final = f"{name}-v{k}"
    return final


def _write_error(checkpoint_dir: Path, target: Path, e: OSError) -> CheckpointWriteError:
    where = f" ({e.filename})" if getattr(e, "filename", None) and str(e.filename) != str(target) else ""
    last = read_pointer(checkpoint_dir / "last")
    kept = f"; the previous checkpoint ({checkpoint_dir / last}) is untouched" if last else ""
    err = CheckpointWriteError(f"could not write checkpoint {target}{where}: {_describe_os_error(e)}{kept}")
    err.__cause__ = e
    return err


def _file_sizes(tmp: Path, target: Path, world_size: int) -> Dict[str, int]:
    """The size of every file in ``tmp``; every rank's file must be there (a folder every rank shares)."""
    files = {}
    for fname in [SHARED_FILE] + [rank_file(r) for r in range(world_size)]:
        p = tmp / fname
        if not p.is_file():
            raise CheckpointWriteError(f"could not write checkpoint {target}: {fname} is missing from {tmp}; "
                                       f"checkpoint_dir must be on a filesystem every rank shares")
        files[fname] = p.stat().st_size
    if (tmp / SHARDED_DIR).is_dir():
        for p in sorted((tmp / SHARDED_DIR).iterdir()):
            files[f"{SHARDED_DIR}/{p.name}"] = p.stat().st_size
    return files


def _json_metrics(metrics: Dict[str, Any]) -> Dict[str, Any]:
    """The metrics as ``meta.json`` holds them: a NaN (a figure the run has not got) is ``null``, as in the run's
    metrics file, since JSON has no NaN (Python's ``NaN`` token is refused by strict readers, such as jq)."""
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in metrics.items()}


def _meta(job: FolderWrite, checksums: Dict[str, str]) -> Dict[str, Any]:
    """The ``meta.json`` of the folder being written in ``job.tmp``."""
    files = _file_sizes(job.tmp, job.target, job.ranks.world_size)
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "name": job.target.name,
        "seq": 1 + max((int(m.get("seq", 0)) for _, m in complete_checkpoints(job.checkpoint_dir)), default=0),
        "epoch": job.epoch, "step": job.step, "metrics": _json_metrics(job.metrics), "world_size": job.ranks.world_size,
        "created": time.time(), "created_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "version": __version__, "torch_version": torch.__version__,
        "config": None if job.config is None else to_jsonable(job.config),
        "files": files,
        "checksums": {name: checksums[name] for name in files if name in checksums},
        "entries": {str(k): tensor_bytes(v) for k, v in job.shared_plain.items()},
        "save_best": list(job.save_best) if job.save_best else None,
    }


def _commit(checkpoint_dir: Path, tmp: Path, target: Path, meta: Dict[str, Any]) -> None:
    """Write ``meta.json`` last and rename the folder into place, each step fsynced."""
    write_json(tmp / META_FILE, meta)
    fsync_dir(tmp)
    os.rename(tmp, target)
    fsync_dir(checkpoint_dir)
