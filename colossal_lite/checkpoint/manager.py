"""``CheckpointManager``: one folder per checkpoint, written atomically by every rank, with ``last``/``best`` pointers.

Layout of ``checkpoint_dir``::

    epoch3-step120/          one complete checkpoint
        shared.pt            replicated state (model, optimizer, schedulers, trainer progress), written by rank 0
        rank0.pt, rank1.pt   per-rank state (RNG, data position), one file per rank
        meta.json            epoch, step, metrics, config summary, versions, file sizes and checksums; written last
    last                     text file holding the name of the newest complete checkpoint
    best                     text file holding the name of the best one (by ``save_best``)
    .tmp-*                   an unfinished write (removed at the next start)

A checkpoint is written into ``.tmp-<name>-<pid>`` and renamed into place once every rank's file
is in it and fsynced; the pointers move after that. A process killed at any instant therefore
leaves ``last`` naming a complete checkpoint. Every file's checksum, computed as it is written, is
verified before the file is read back, so a damaged file is never resumed from. A ZeRO stage 2/3
checkpoint (with ``sharded/``) can be merged into one file (``merge_checkpoint``, ``merged.py``)
that is read wherever a folder is.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .._version import __version__
from ..core import dist as cl_dist
from ..core.global_context import global_context as gpc
from .io import (
    DEL_PREFIX,
    TMP_PREFIX,
    CheckpointDamagedError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    PathLike,
    UnsafeCheckpointError,
    _describe_os_error,
    atomic_write_text,
    file_checksum,
    fsync_dir,
    load_file,
    load_single_file,
    save_file,
    tensor_bytes,
    to_jsonable,
    to_plain,
    verify_checksum,
    verify_records,
    write_json,
)
from .merged import MERGED_KEY, is_merged, merged_meta, merged_state, split_merged, warn_no_rank_state, warn_other_world

SHARED_FILE = "shared.pt"
SHARDED_DIR = "sharded"  # torch.distributed.checkpoint files: each rank writes its own shard
META_FILE = "meta.json"
POINTERS = ("last", "best")
FORMAT = "colossal_lite.checkpoint"
FORMAT_VERSION = 1
_NAME_RE = re.compile(r"epoch(-?\d+)-step(-?\d+)")
_DEFAULT = object()


def rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def checkpoint_name(epoch: int, step: int) -> str:
    """The folder name of the checkpoint taken at ``epoch`` (0-based) after ``step`` optimizer steps."""
    return f"epoch{int(epoch)}-step{int(step)}"


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not name or name in POINTERS or name.startswith(".") or name in ("..",) \
            or "/" in name or "\\" in name or name != name.strip():
        raise ValueError(f"checkpoint name {name!r} cannot be used: give a plain folder name that does not start "
                         f"with '.' and is not 'last' or 'best', e.g. {checkpoint_name(3, 120)!r}")
    return name


class _Ranks:
    """The ranks of the default process group (one process: no collectives)."""

    def __init__(self):
        self.rank = cl_dist.rank()
        self.world_size = cl_dist.world_size()
        self.distributed = self.world_size > 1

    def all_gather(self, obj) -> list:
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj):
        return cl_dist.broadcast_object(obj)

    def failures(self, error: Optional[BaseException], payload: Any = None) -> Tuple[list, list]:
        """``([(rank, (kind, message)) of each rank that failed], [every rank's payload])``. A collective."""
        reports = self.all_gather((_report(error), payload))
        return [(r, report) for r, (report, _) in enumerate(reports) if report is not None], [p for _, p in reports]

    def agree(self, error: Optional[BaseException], what: str, on_failure=None, payload: Any = None,
              fallback=CheckpointWriteError) -> list:
        """Every rank's ``payload`` when no rank failed; else raise on every rank. A collective.

        The failing rank raises its own error; every other rank raises the same kind of checkpoint
        error with the same message (other errors become ``fallback`` naming the rank and ``what``).
        ``on_failure`` (a clean-up) runs first; it is best effort and never hides the error.
        """
        failed, payloads = self.failures(error, payload)
        if not failed:
            return payloads
        if on_failure is not None:
            try:
                on_failure()
            except OSError:
                pass  # e.g. a read-only file system: there is nothing to clean up, and the error says why
        if self.distributed:
            dist.barrier()  # every rank sees the cleaned-up folder when the error surfaces
        if error is not None:
            raise error
        rank, (kind, message) = failed[0]
        raise _error_from(rank, kind, message, what, fallback)


# errors that every rank raises alike when one rank meets them
_SHARED_ERRORS = {cls.__name__: cls for cls in (CheckpointWriteError, CheckpointDamagedError, CheckpointNotFoundError,
                                                UnsafeCheckpointError, CheckpointError)}


def _report(error: Optional[BaseException]) -> Optional[Tuple[str, str]]:
    return None if error is None else (type(error).__name__, str(error))


def _error_from(rank: int, kind: str, message: str, what: str, fallback) -> CheckpointError:
    cls = _SHARED_ERRORS.get(kind)
    if cls is not None:
        return cls(f"{message} (reported by rank {rank})")
    return fallback(f"{what}: rank {rank} failed: {kind}: {message}")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own leftover from an earlier failed attempt
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists but belongs to someone else
    return True


def _remove(path: Path) -> None:
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
        if m and _pid_alive(int(m.group(1))):
            continue  # another live process on this machine is writing it
        _remove(entry)
        if not entry.exists():
            removed.append(entry)
    return removed


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


def _is_complete(folder: Path) -> Optional[Dict[str, Any]]:
    try:
        return read_meta(folder)
    except CheckpointError:
        return None


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


def _sharded_share(names: List[str], rank: int, world_size: int) -> List[str]:
    """This rank's share of the sharded files ``names`` (each file is checksummed by one rank)."""
    return [n for n in sorted(names) if n.startswith(SHARDED_DIR + "/")][rank::world_size]


def sharded_checksums(folder: Path, rank: int, world_size: int) -> Dict[str, str]:
    """Checksums of this rank's share of the files torch.distributed.checkpoint wrote into ``folder/sharded``.

    DCP writes its files itself, so they are read back once (from the page cache, just after
    the write) and the ranks split the reading.
    """
    names = [f"{SHARDED_DIR}/{p.name}" for p in (folder / SHARDED_DIR).iterdir() if p.is_file()]
    return {n: file_checksum(folder / n) for n in _sharded_share(names, rank, world_size)}


def verify_sharded(folder: PathLike, meta: Dict[str, Any], rank: int = 0, world_size: int = 1) -> None:
    """Compare this rank's share of the sharded files with the checksums ``meta`` records."""
    folder = Path(folder)
    sums = meta.get("checksums") or {}
    for name in _sharded_share(list(sums), rank, world_size):
        verify_checksum(folder / name, sums[name])


def model_state_from(shared: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """The model weights inside a checkpoint's shared state: ``shared['model']`` or ``shared['engine']['model']``."""
    for candidate in (shared.get("model"), (shared.get("engine") or {}).get("model")
                      if isinstance(shared.get("engine"), dict) else None):
        if isinstance(candidate, dict) and candidate and all(isinstance(v, torch.Tensor) for v in candidate.values()):
            return candidate
    raise CheckpointError(f"no model weights found in this checkpoint: expected a dict of tensors under 'model' or "
                          f"'engine' -> 'model', found top-level keys {sorted(map(str, shared))}")


def _metric_value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().float().item() if v.numel() == 1 else to_jsonable(v)
    if hasattr(v, "item") and callable(v.item):  # NumPy scalars
        try:
            return v.item()
        except (TypeError, ValueError):
            pass
    return to_jsonable(v)


class CheckpointManager:
    """Writes and finds checkpoints in ``checkpoint_dir``; every rank calls ``save`` and ``load``.

    Args:
        checkpoint_dir: the folder of this run's checkpoints (created at the first save). With several
            ranks it must be on a filesystem every rank sees.
        save_last: move the ``last`` pointer to each new checkpoint.
        save_best: ``None`` or ``(metric_name, 'min' | 'max')``: move the ``best`` pointer when
            ``metrics[metric_name]`` improves. The best value is read back from the ``best``
            checkpoint's metadata, so it survives a restart.
        keep_last_n: keep only the ``n`` newest checkpoints (plus whatever ``last`` and ``best``
            point at); ``None`` keeps all.
        cleanup: remove leftovers of interrupted writes now (rank 0 only).
    """

    def __init__(self, checkpoint_dir: PathLike, save_last: bool = True,
                 save_best: Optional[Tuple[str, str]] = None, keep_last_n: Optional[int] = None,
                 cleanup: bool = True):
        self.checkpoint_dir = Path(checkpoint_dir)
        self.save_last = bool(save_last)
        if save_best is not None:
            if not (isinstance(save_best, (tuple, list)) and len(save_best) == 2 and isinstance(save_best[0], str)
                    and save_best[1] in ("min", "max")):
                raise ValueError(f"save_best must be None or (metric_name, 'min' | 'max'), e.g. ('loss', 'min') or "
                                 f"('accuracy', 'max'); got {save_best!r}")
            save_best = (save_best[0], save_best[1])
        self.save_best = save_best
        if keep_last_n is not None and (isinstance(keep_last_n, bool) or not isinstance(keep_last_n, int)
                                        or keep_last_n < 1):
            raise ValueError(f"keep_last_n must be None (keep all) or an int >= 1, got {keep_last_n!r}")
        self.keep_last_n = keep_last_n
        self.removed_leftovers: List[Path] = []
        if cleanup and self._ranks.rank == 0:
            self.removed_leftovers = remove_leftovers(self.checkpoint_dir)
        self.best_value: Optional[float] = self._read_best_value()

    @property
    def _ranks(self) -> _Ranks:
        return _Ranks()  # read at each use: the manager may be built before the process group starts

    # -- finding checkpoints ---------------------------------------------------------------------
    def _metas(self) -> List[Tuple[Path, Dict[str, Any]]]:
        if not self.checkpoint_dir.is_dir():
            return []
        found = []
        for entry in self.checkpoint_dir.iterdir():
            if entry.name.startswith(".") or entry.name in POINTERS or not entry.is_dir():
                continue
            meta = _is_complete(entry)
            if meta is not None:
                found.append((entry, meta))
        found.sort(key=lambda pm: (int(pm[1].get("seq", 0)), pm[1].get("created", 0), pm[0].name))
        return found

    def list_checkpoints(self) -> List[Path]:
        """Complete checkpoints, oldest first (by the order they were written)."""
        return [p for p, _ in self._metas()]

    def latest(self) -> Optional[Path]:
        """The newest complete checkpoint, whatever the pointers say; ``None`` if there is none."""
        found = self.list_checkpoints()
        return found[-1] if found else None

    def pointer(self, which: str) -> Optional[Path]:
        """The complete checkpoint the ``last`` or ``best`` pointer names, or ``None``."""
        target = _read_pointer(self.checkpoint_dir / which)
        if target is None:
            return None
        path = self.checkpoint_dir / target
        return path if _is_complete(path) is not None else None

    def resolve(self, which: Union[str, PathLike, None] = "auto") -> Optional[Path]:
        """The checkpoint folder ``which`` names.

        ``"auto"``: ``last`` (or, without a ``last`` pointer, the newest complete checkpoint) or
        ``None`` when there is none, so a fresh run starts. ``"last"``, ``"best"``, ``"latest"``,
        a folder path, a pointer file, a merged file or a checkpoint name inside ``checkpoint_dir``
        must exist.
        """
        if which is None:
            return None
        if isinstance(which, str) and which == "auto":
            return self.pointer("last") or self.latest()
        if isinstance(which, str) and which in POINTERS:
            pointer = self.checkpoint_dir / which
            target = _read_pointer(pointer)
            if target is None:
                raise CheckpointNotFoundError(
                    f"no '{which}' checkpoint in {self.checkpoint_dir}: {pointer} does not exist"
                    + (" (no checkpoint was completed there yet)" if which == "last" else
                       " (no checkpoint was saved with save_best there yet)"))
            path = self.checkpoint_dir / target
            read_meta(path)  # raises naming the folder when it is missing or incomplete
            return path
        if isinstance(which, str) and which == "latest":
            path = self.latest()
            if path is None:
                raise CheckpointNotFoundError(f"no complete checkpoint in {self.checkpoint_dir}")
            return path
        return resolve_path(which, self.checkpoint_dir)

    # -- best ----------------------------------------------------------------------------------
    def _read_best_value(self) -> Optional[float]:
        if self.save_best is None:
            return None
        path = self.pointer("best")
        if path is None:
            return None
        value = read_meta(path).get("metrics", {}).get(self.save_best[0])
        return float(value) if isinstance(value, (int, float)) else None

    def _improves(self, metrics: Dict[str, Any]) -> bool:
        if self.save_best is None:
            return False
        name, mode = self.save_best
        value = metrics.get(name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
            if metrics and name not in metrics:
                warnings.warn(f"save_best watches metric {name!r} but this checkpoint's metrics have only "
                              f"{sorted(metrics)}; 'best' was not moved", stacklevel=3)
            return False
        if self.best_value is None:
            return True
        return value < self.best_value if mode == "min" else value > self.best_value

    # -- saving --------------------------------------------------------------------------------
    def save(self, name: str, shared_state: Dict[str, Any], rank_state: Optional[Dict[str, Any]] = None,
             metrics: Optional[Dict[str, Any]] = None, *, epoch: Optional[int] = None, step: Optional[int] = None,
             config: Any = _DEFAULT, sharded_state: Optional[Dict[str, Any]] = None) -> Path:
        """Write one checkpoint and return its folder. Every rank calls it (it runs collectives).

        ``shared_state`` is replicated state and is written once, from rank 0 (other ranks may pass
        ``None``); ``rank_state`` is this rank's own state (RNG, data position). ``metrics`` (plain
        numbers) go into the metadata and drive ``best``. ``epoch`` and ``step`` default to the
        numbers in ``name`` (``checkpoint_name(epoch, step)``); ``config`` defaults to ``gpc.config``.
        If the name is taken (a resumed run saving at the same point again) ``-v1``, ``-v2``... is added.
        A failure on any rank raises on every rank and leaves earlier checkpoints as they were.
        ``sharded_state`` (DTensor state of a ZeRO 2/3 model and optimizer) is written with
        ``torch.distributed.checkpoint`` into ``sharded/``: each rank writes its own shard.
        """
        _check_name(name)
        ranks = self._ranks
        if epoch is None or step is None:
            m = _NAME_RE.search(name)
            if m:
                epoch = int(m.group(1)) if epoch is None else epoch
                step = int(m.group(2)) if step is None else step
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
        except Exception as e:  # noqa: BLE001 - every rank must reach the collective below
            error = e
        target, tmp = self._make_folder(ranks, name, error)
        checksums = self._write_files(ranks, target, tmp, shared_plain, rank_plain, sharded_state)

        # rank 0 completes it: metadata, rename into place, pointers, retention
        if ranks.rank == 0:
            try:
                self._commit(tmp, target, shared_plain, metrics_plain, epoch, step, config, checksums)
            except Exception as e:  # noqa: BLE001 - every rank must reach the collective below
                error = self._write_error(target, e) if type(e) is not CheckpointWriteError and isinstance(e, OSError) else e
                if tmp.exists():
                    _remove(tmp)
        ranks.agree(error, f"checkpoint {target} was not completed")
        return target

    def _make_folder(self, ranks: _Ranks, name: str, error: Optional[BaseException]) -> Tuple[Path, Path]:
        """Rank 0 makes the temporary folder (under a free name); every rank gets ``(target, tmp)``. Collective."""
        target = self.checkpoint_dir / name
        tmp: Optional[Path] = None
        final = name
        if ranks.rank == 0 and error is None:
            try:
                self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
                final = self._free_name(name)
                target = self.checkpoint_dir / final
                tmp = self.checkpoint_dir / f"{TMP_PREFIX}{final}-{os.getpid()}"
                if tmp.exists():
                    _remove(tmp)
                tmp.mkdir()
            except OSError as e:
                error = self._write_error(target, e)
        ranks.agree(error, f"checkpoint {target} was not written", lambda: tmp is not None and _remove(tmp))
        final, tmp_name = ranks.broadcast((final, None if tmp is None else tmp.name))
        return self.checkpoint_dir / final, self.checkpoint_dir / tmp_name

    def _write_files(self, ranks: _Ranks, target: Path, tmp: Path, shared_plain, rank_plain,
                     sharded_state: Optional[Dict[str, Any]]) -> Dict[str, str]:
        """Every rank writes its own file(s) into ``tmp``; returns every file's checksum (all ranks). Collective."""
        error: Optional[BaseException] = None
        sums: Dict[str, str] = {}
        try:
            if not tmp.is_dir():
                raise CheckpointWriteError(f"could not write checkpoint {target}: the folder {tmp} made by rank 0 is "
                                           f"not visible on rank {ranks.rank}; checkpoint_dir must be on a "
                                           f"filesystem every rank shares")
            if ranks.rank == 0:
                sums[SHARED_FILE] = save_file(shared_plain, tmp / SHARED_FILE)
            sums[rank_file(ranks.rank)] = save_file(rank_plain, tmp / rank_file(ranks.rank))
        except Exception as e:  # noqa: BLE001 - every rank must reach the collective below
            error = self._write_error(target, e) if type(e) is not CheckpointWriteError and isinstance(e, OSError) else e
        checksums = _merged(ranks.agree(error, f"checkpoint {target} was not written",
                                        lambda: ranks.rank == 0 and _remove(tmp), payload=sums))
        if sharded_state is not None:
            sums = {}
            try:
                save_sharded(sharded_state, tmp / SHARDED_DIR)
                sums = sharded_checksums(tmp, ranks.rank, ranks.world_size)
            except Exception as e:  # noqa: BLE001 - every rank must reach the collective below
                error = self._write_error(target, e) if isinstance(e, OSError) else e
            checksums.update(_merged(ranks.agree(error, f"checkpoint {target} was not written",
                                                 lambda: ranks.rank == 0 and _remove(tmp), payload=sums)))
        return checksums

    def _free_name(self, name: str) -> str:
        final, k = name, 0
        while (self.checkpoint_dir / final).exists():
            k += 1
            final = f"{name}-v{k}"
        return final

    def _write_error(self, target: Path, e: OSError) -> CheckpointWriteError:
        where = f" ({e.filename})" if getattr(e, "filename", None) and str(e.filename) != str(target) else ""
        last = _read_pointer(self.checkpoint_dir / "last")
        kept = f"; the previous checkpoint ({self.checkpoint_dir / last}) is untouched" if last else ""
        err = CheckpointWriteError(f"could not write checkpoint {target}{where}: {_describe_os_error(e)}{kept}")
        err.__cause__ = e
        return err

    def _commit(self, tmp: Path, target: Path, shared: Dict[str, Any], metrics: Dict[str, Any],
                epoch: Optional[int], step: Optional[int], config: Any, checksums: Dict[str, str]) -> None:
        files = {}
        for fname in [SHARED_FILE] + [rank_file(r) for r in range(self._ranks.world_size)]:
            p = tmp / fname
            if not p.is_file():
                raise CheckpointWriteError(f"could not write checkpoint {target}: {fname} is missing from {tmp}; "
                                           f"checkpoint_dir must be on a filesystem every rank shares")
            files[fname] = p.stat().st_size
        if (tmp / SHARDED_DIR).is_dir():
            for p in sorted((tmp / SHARDED_DIR).iterdir()):
                files[f"{SHARDED_DIR}/{p.name}"] = p.stat().st_size
        if config is _DEFAULT:
            config = gpc.config
        metas = self._metas()
        meta = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "name": target.name,
            "seq": 1 + max((int(m.get("seq", 0)) for _, m in metas), default=0),
            "epoch": epoch, "step": step, "metrics": metrics, "world_size": self._ranks.world_size,
            "created": time.time(), "created_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "version": __version__, "torch_version": torch.__version__,
            "config": None if config is None else to_jsonable(config),
            "files": files,
            "checksums": {name: checksums[name] for name in files if name in checksums},
            "entries": {str(k): tensor_bytes(v) for k, v in shared.items()},
            "save_best": list(self.save_best) if self.save_best else None,
        }
        write_json(tmp / META_FILE, meta)
        fsync_dir(tmp)
        os.rename(tmp, target)
        fsync_dir(self.checkpoint_dir)
        # the checkpoint is complete: now the pointers may move
        try:
            if self.save_last:
                _write_pointer(self.checkpoint_dir / "last", target.name)
            if self.save_best is not None and self._improves(metrics):
                _write_pointer(self.checkpoint_dir / "best", target.name)
                self.best_value = float(metrics[self.save_best[0]])
        except OSError as e:
            raise CheckpointWriteError(f"checkpoint {target} was written but a pointer could not be moved: "
                                       f"{_describe_os_error(e)}") from e
        self._apply_retention()

    def _apply_retention(self) -> List[Path]:
        if self.keep_last_n is None:
            return []
        found = self.list_checkpoints()
        keep = set(found[-self.keep_last_n:])
        for which in POINTERS:
            target = _read_pointer(self.checkpoint_dir / which)
            if target is not None:
                keep.add(self.checkpoint_dir / target)
        deleted = []
        for path in found:
            if path in keep:
                continue
            doomed = self.checkpoint_dir / f"{DEL_PREFIX}{path.name}-{os.getpid()}"
            try:
                os.rename(path, doomed)  # atomic: a half-deleted folder never looks like a checkpoint
                shutil.rmtree(doomed)
            except OSError as e:
                warnings.warn(f"could not delete old checkpoint {path}: {_describe_os_error(e)}", stacklevel=3)
                continue
            deleted.append(path)
        return deleted

    # -- loading -------------------------------------------------------------------------------
    def load(self, which: Union[str, PathLike] = "last") -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
        """``(shared_state, rank_state)`` of the checkpoint ``which`` names (see ``read``). Every rank calls it."""
        found = self.read(which)
        if found is None:
            raise CheckpointNotFoundError(f"no checkpoint to load in {self.checkpoint_dir}")
        return found[1], found[2]

    def read(self, which: Union[str, PathLike, None] = "auto"
             ) -> Optional[Tuple[Path, Dict[str, Any], Optional[Dict[str, Any]]]]:
        """``(folder, shared_state, rank_state)`` of the checkpoint ``which`` names (see ``resolve``). Collective.

        Rank 0 picks the folder and every rank reads the same one; each file is compared with the
        checksum ``meta.json`` records before it is unpickled. A damaged checkpoint raises
        ``CheckpointDamagedError`` naming the file, except with ``"auto"``, which warns and falls back
        to the newest checkpoint that verifies (``None``: nothing to resume). ``rank_state`` is
        ``None`` (with a warning) when the checkpoint was written by fewer ranks than this run has.
        """
        ranks = self._ranks
        candidates, error = [], None
        if ranks.rank == 0:
            try:
                candidates = [str(p) for p in self._candidates(which)]
            except (CheckpointError, ValueError) as e:
                error = e
        ranks.agree(error, f"could not load checkpoint {which!r}", fallback=CheckpointError)
        candidates = ranks.broadcast(candidates)
        fall_back = isinstance(which, str) and which == "auto"
        damaged: List[str] = []
        for path in map(Path, candidates):
            loaded = self._read_verified(path, ranks, damaged if fall_back else None)
            if loaded is not None:
                return (path,) + loaded
        if damaged:
            raise CheckpointDamagedError(f"no checkpoint in {self.checkpoint_dir} can be resumed: "
                                         + "; ".join(damaged))
        return None

    def _candidates(self, which) -> List[Path]:
        """The folders ``which`` may load, in order: one, or for ``'auto'`` every complete one, ``last`` first."""
        if not (isinstance(which, str) and which == "auto"):
            path = self.resolve(which)
            return [] if path is None else [path]
        found = list(reversed(self.list_checkpoints()))
        last = self.pointer("last")
        return found if last is None else [last] + [p for p in found if p != last]

    def _read_verified(self, path: Path, ranks: _Ranks, damaged: Optional[List[str]]):
        """Every rank reads ``path``; a damaged one is noted in ``damaged`` and skipped when that is a list."""
        result, error = None, None
        try:
            result = read_checkpoint(path, ranks.rank, ranks.world_size)
        except CheckpointError as e:
            error = e
        failed, _ = ranks.failures(error)
        if not failed:
            return result
        _, (kind, message) = failed[0]
        if damaged is not None and kind == CheckpointDamagedError.__name__:
            damaged.append(message)
            if ranks.rank == 0:
                warnings.warn(f"{message}; resume_from='auto' goes on to the next newest checkpoint in "
                              f"{self.checkpoint_dir}", stacklevel=4)
            return None
        ranks.agree(error, f"could not load checkpoint {path}", fallback=CheckpointError)  # raises on every rank
        return None


def _merged(dicts: List[Dict[str, str]]) -> Dict[str, str]:
    out: Dict[str, str] = {}
    for d in dicts:
        out.update(d or {})
    return out


def save_sharded(state: Dict[str, Any], folder: Path) -> None:
    """Every rank writes its shard of ``state`` (DTensors) with torch.distributed.checkpoint, then fsyncs."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder), sync_files=True))
    if folder.is_dir():
        fsync_dir(folder)


def load_sharded(path: PathLike, state: Dict[str, Any]) -> Dict[str, Any]:
    """Fill ``state`` (this run's DTensor layout, any number of ranks) from ``path/sharded`` in place. Collective."""
    import torch.distributed.checkpoint as dcp

    folder = Path(path) / SHARDED_DIR
    if not folder.is_dir():
        raise CheckpointNotFoundError(f"checkpoint {path} has no sharded state ({folder} is missing): it was not "
                                      f"written by a zero stage 2/3 run; load it with zero stage 0/1, or merge it")
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(folder)))
    return state


def has_sharded_state(path: PathLike) -> bool:
    return (Path(path) / SHARDED_DIR).is_dir()


def merge_sharded(path: PathLike) -> Dict[str, Any]:
    """The full (unsharded) state of ``path/sharded`` in this one process, as plain tensors."""
    import tempfile

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


def read_checkpoint(path: PathLike, rank: int = 0, world_size: Optional[int] = None
                    ) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
    """Read a checkpoint in this process only (no collectives): ``(shared_state, rank_state of rank)``.

    ``path`` is a checkpoint folder or a file ``ckpt merge`` wrote. Every file read is first compared
    with the checksum ``meta.json`` records (``CheckpointDamagedError`` naming the file); of the sharded
    files, this rank checks its share of ``world_size`` (all of them when ``world_size`` is None).
    Checkpoints written before checksums were recorded are checked by size. A merged file is checked
    against the CRC-32 of each record of its zip archive.
    """
    path = Path(path)
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
    verify_sharded(path, meta, rank if world_size is not None else 0, world_size or 1)
    return shared, rank_state


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


def load_shared(folder: PathLike) -> Dict[str, Any]:
    """The verified ``shared.pt`` of a checkpoint folder (one process, no collectives)."""
    folder = Path(folder)
    meta = read_meta(folder)
    verify_files(folder, meta)
    return load_file(folder / SHARED_FILE, (meta.get("checksums") or {}).get(SHARED_FILE))


def _read_pointer(pointer: Path) -> Optional[str]:
    try:
        text = pointer.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    if not text or "/" in text or "\\" in text or text.startswith("."):
        return None  # not a name we wrote: never follow it outside the folder
    return text


def is_single_file(path: PathLike) -> bool:
    """True for a single-file checkpoint (``save_checkpoint``), False for folders and ``last``/``best`` pointers."""
    p = Path(path)
    return p.is_file() and (p.stat().st_size >= 4096 or _read_pointer(p) is None)


def _write_pointer(pointer: Path, name: str) -> None:
    atomic_write_text(pointer, name + "\n")


def resolve_path(which: PathLike, checkpoint_dir: Optional[PathLike] = None) -> Path:
    """A checkpoint folder from a folder path, a ``last``/``best`` pointer file, a checkpoint directory
    (its ``last``) or a name inside ``checkpoint_dir``; a single file (``ckpt merge``'s) is returned as it is."""
    candidates = [Path(which)]
    if checkpoint_dir is not None and not Path(which).is_absolute():
        candidates.append(Path(checkpoint_dir) / which)
    for path in candidates:
        if path.is_file():
            target = _read_pointer(path) if path.stat().st_size < 4096 else None
            if target is None or not (path.parent / target).is_dir():
                return path  # a single file: read_checkpoint takes one ckpt merge wrote, and says what to do with others
            path = path.parent / target
        if path.is_dir():
            if not (path / META_FILE).exists() and (path / "last").is_file():
                target = _read_pointer(path / "last")
                if target is not None:
                    path = path / target
            read_meta(path)
            return path
    raise CheckpointNotFoundError(f"checkpoint {which} does not exist"
                                  + (f" (also looked for {Path(checkpoint_dir) / which})"
                                     if len(candidates) > 1 else ""))


def checkpoint_info(path: PathLike) -> Dict[str, Any]:
    """What a checkpoint holds: epoch, step, metrics, config summary, versions and the size of each file and entry.

    ``path`` is a checkpoint folder, a ``last``/``best`` pointer, a checkpoint directory (its ``last``
    is shown), a single-file checkpoint from ``colossal_lite.utils.save_checkpoint`` or a file
    ``ckpt merge`` wrote.
    """
    p = Path(path)
    if is_single_file(p):
        return _file_info(p)
    folder = resolve_path(p)
    meta = read_meta(folder)
    files = {}
    for entry in sorted(folder.iterdir()):
        if entry.is_file():
            files[entry.name] = entry.stat().st_size
    pointers = [w for w in POINTERS if _read_pointer(folder.parent / w) == folder.name]
    damaged = _damaged_files(folder, meta)
    return {
        "path": str(folder), "kind": "folder", "name": folder.name, "epoch": meta.get("epoch"),
        "step": meta.get("step"), "metrics": meta.get("metrics", {}), "config": meta.get("config"),
        "version": meta.get("version"), "torch_version": meta.get("torch_version"),
        "world_size": meta.get("world_size"), "created_utc": meta.get("created_utc"), "files": files,
        "total_bytes": sum(files.values()), "entries": meta.get("entries", {}), "pointers": pointers,
        "damaged": damaged, "checksums": _checksum_summary(meta, damaged),
    }


def _file_info(p: Path) -> Dict[str, Any]:
    """``checkpoint_info`` of a single file; a merged one reports the metadata of the folder it was made from."""
    checked = verify_records(p)
    state = load_file(p)
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
