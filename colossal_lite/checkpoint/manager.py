"""``CheckpointManager``: a run's checkpoints in one directory, written atomically by every rank, with ``last``/``best``.

The manager joins storage and policy: ``writer.py`` writes one folder atomically (layout in
``layout.py``, pointer files in ``pointers.py``, sharded state in ``sharded.py``), ``reader.py`` reads
one back verified, and ``policy.py`` decides which pointers move and which folders are kept. The
names other modules import from here (``read_checkpoint``, ``read_meta``, ``load_sharded``, ...) are
re-exported from their modules.
"""
from __future__ import annotations

import difflib
import os
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from .async_writer import AsyncSaves, SaveTimes
from .info import checkpoint_info
from .io import CheckpointDamagedError, CheckpointError, CheckpointNotFoundError, PathLike
from .layout import (
    FORMAT,
    FORMAT_VERSION,
    META_FILE,
    POINTERS,
    SHARDED_DIR,
    SHARED_FILE,
    checkpoint_name,
    complete_checkpoints,
    newest_checkpoint,
    rank_file,
    read_meta,
    remove_leftovers,
    verify_files,
)
from .pointers import is_single_file, read_pointer, resolve_path, why_not_followed
from .policy import BestMetric, apply_retention, check_keep_last_n, move_pointers, pointed_at
from .ranks import Ranks
from .reader import load_shared, merge_checkpoint, model_state_from, read_checkpoint
from .sharded import (
    has_sharded_state,
    load_sharded,
    merge_sharded,
    optimizer_state_keys,
    save_sharded,
    verify_sharded,
)
from .writer import USE_GPC_CONFIG, begin_write, numbers_from, write_checkpoint

__all__ = [
    "CheckpointManager", "checkpoint_info", "checkpoint_name", "rank_file", "read_meta", "verify_files",
    "remove_leftovers", "is_single_file", "resolve_path", "read_checkpoint", "load_shared", "merge_checkpoint",
    "model_state_from", "has_sharded_state", "optimizer_state_keys", "load_sharded", "merge_sharded", "save_sharded",
    "verify_sharded",
    "FORMAT", "FORMAT_VERSION", "META_FILE", "POINTERS", "SHARDED_DIR", "SHARED_FILE",
]


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
        async_save: ``save`` returns once the state is copied to host memory and writes the folder in the
            background (``async_writer.py``); the folder appears, and the pointers move, when ``poll`` at a
            step boundary finds every rank's write finished, or when ``wait`` (or the next ``save``) waits
            for it. Call ``wait()`` before the program ends.
    """

    def __init__(self, checkpoint_dir: PathLike, save_last: bool = True,
                 save_best: Optional[Tuple[str, str]] = None, keep_last_n: Optional[int] = None,
                 cleanup: bool = True, async_save: bool = False):
        self.checkpoint_dir = Path(checkpoint_dir)
        self.finished_saves: List[SaveTimes] = []  # each complete save's times, in order (callers may clear it)
        self._async = AsyncSaves(self.finished_saves) if async_save else None
        self.save_last = bool(save_last)
        self._best = BestMetric(save_best)
        self.keep_last_n = check_keep_last_n(keep_last_n)
        self.removed_leftovers: List[Path] = []
        if cleanup and Ranks().rank == 0:  # read at each use: the manager may be built before the process group
            self.removed_leftovers = remove_leftovers(self.checkpoint_dir)
        self._best.read_back(self.checkpoint_dir)

    @property
    def save_best(self) -> Optional[Tuple[str, str]]:
        return self._best.spec

    @property
    def best_value(self) -> Optional[float]:
        """The watched metric's best value so far (``None`` before the first ``best``)."""
        return self._best.value

    # -- finding checkpoints ---------------------------------------------------------------------
    def list_checkpoints(self) -> List[Path]:
        """Complete checkpoints, oldest first (by the order they were written)."""
        return [p for p, _ in complete_checkpoints(self.checkpoint_dir)]

    def latest(self) -> Optional[Path]:
        """The newest complete checkpoint, whatever the pointers say; ``None`` if there is none."""
        return newest_checkpoint(self.checkpoint_dir)

    def pointer(self, which: str) -> Optional[Path]:
        """The complete checkpoint the ``last`` or ``best`` pointer names, or ``None``."""
        return pointed_at(self.checkpoint_dir, which)

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
            target = read_pointer(pointer)
            if target is None:
                if pointer.exists():
                    raise CheckpointNotFoundError(f"no '{which}' checkpoint in {self.checkpoint_dir}: "
                                                  f"{why_not_followed(pointer)}")
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
        try:
            return resolve_path(which, self.checkpoint_dir)
        except CheckpointNotFoundError as error:
            close = difflib.get_close_matches(str(which), ["auto", *POINTERS, "latest"], n=1, cutoff=0.6)
            if not close or os.sep in str(which):
                raise
            raise CheckpointNotFoundError(f"{error}; did you mean {close[0]!r}?") from None

    # -- saving --------------------------------------------------------------------------------
    def save(self, name: str, shared_state: Dict[str, Any], rank_state: Optional[Dict[str, Any]] = None,
             metrics: Optional[Dict[str, Any]] = None, *, epoch: Optional[int] = None, step: Optional[int] = None,
             config: Any = USE_GPC_CONFIG, sharded_state: Optional[Dict[str, Any]] = None,
             started_at: Optional[float] = None) -> Path:
        """Write one checkpoint and return its folder. Every rank calls it (it runs collectives).

        ``shared_state`` is replicated state and is written once, from rank 0 (other ranks may pass
        ``None``); ``rank_state`` is this rank's own state (RNG, data position). ``metrics`` (plain
        numbers) go into the metadata and drive ``best``. ``epoch`` and ``step`` default to the
        numbers in ``name`` (``checkpoint_name(epoch, step)``); ``config`` defaults to ``gpc.config``.
        If the name is taken (a resumed run saving at the same point again) ``-v1``, ``-v2``... is added.
        A failure on any rank raises on every rank and leaves earlier checkpoints as they were.
        ``sharded_state`` (DTensor state of a ZeRO 2/3 model and optimizer) is written with
        ``torch.distributed.checkpoint`` into ``sharded/``: each rank writes its own shard.
        With ``async_save`` it returns once the state is copied (see the class). ``started_at``
        (``time.perf_counter()`` when the caller began gathering the state) is where the save's times start;
        they go to ``finished_saves`` once its folder is complete (a synchronous save blocks for all of it).
        """
        options = dict(epoch=epoch, step=step, config=config, save_best=self.save_best, on_complete=self._after_save)
        if self._async is not None:
            return self._async.start(lambda stage: begin_write(self.checkpoint_dir, name, shared_state, rank_state,
                                                               metrics, stage=stage, **options), sharded_state,
                                     started_at)
        started = time.perf_counter() if started_at is None else started_at
        path = write_checkpoint(self.checkpoint_dir, name, shared_state, rank_state, metrics,
                                sharded_state=sharded_state, **options)
        took = time.perf_counter() - started
        self.finished_saves.append(SaveTimes(path, *numbers_from(name, epoch, step), blocking=took, total=took))
        return path

    @property
    def async_save(self) -> bool:
        return self._async is not None

    @property
    def in_flight(self) -> Optional[Path]:
        """The folder an asynchronous save is writing now (not complete yet), or None."""
        flight = None if self._async is None else self._async.in_flight
        return None if flight is None else flight.job.target

    @property
    def in_flight_waited(self) -> float:
        """Seconds the save in flight waited, when it was started, for the one before it to be written."""
        flight = None if self._async is None else self._async.in_flight
        return 0.0 if flight is None else flight.waited

    def poll(self) -> bool:
        """At a step boundary (every rank): complete the asynchronous save in flight if every rank's write has
        finished; raises ``CheckpointWriteError`` on every rank if one failed. True when a folder was completed."""
        return self._async is not None and self._async.poll()

    def wait(self) -> float:
        """Wait for the asynchronous save in flight and complete it (every rank); the seconds waited."""
        return 0.0 if self._async is None else self._async.wait()

    def release_buffers(self) -> None:
        """No save in flight: let the asynchronous saves' host copies of the state go (the end of a run)."""
        if self._async is not None:
            self._async.release_buffers()

    def abandon(self) -> Optional[Path]:
        """After an error: finish the write in flight; in one process its folder is completed, else it is left
        for the next start to remove. The completed folder, or None."""
        return None if self._async is None else self._async.abandon()

    def _after_save(self, target: Path, metrics: Dict[str, Any]) -> None:
        """The policy, on rank 0, once ``target`` is complete: the pointers move, then old checkpoints go."""
        move_pointers(self.checkpoint_dir, target, metrics, self.save_last, self._best)
        apply_retention(self.checkpoint_dir, self.keep_last_n)

    # -- loading -------------------------------------------------------------------------------
    def load(self, which: Union[str, PathLike] = "last") -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
        """``(shared_state, rank_state)`` of the checkpoint ``which`` names (see ``read``). Every rank calls it."""
        found = self.read(which)
        if found is None:
            raise CheckpointNotFoundError(f"no checkpoint to load in {self.checkpoint_dir}")
        return found[1], found[2]

    def read(self, which: Union[str, PathLike, None] = "auto", damaged: Optional[Dict[str, str]] = None
             ) -> Optional[Tuple[Path, Dict[str, Any], Optional[Dict[str, Any]]]]:
        """``(folder, shared_state, rank_state)`` of the checkpoint ``which`` names (see ``resolve``). Collective.

        Rank 0 picks the folder and every rank reads the same one; each file is compared with the
        checksum ``meta.json`` records before it is unpickled. A damaged checkpoint raises
        ``CheckpointDamagedError`` naming the file, except with ``"auto"``, which warns and falls back
        to the newest checkpoint that verifies (``None``: nothing to resume). ``rank_state`` is
        ``None`` (with a warning) when the checkpoint was written by fewer ranks than this run has.
        ``damaged`` (with ``"auto"``): folders found damaged after they were read (a ZeRO 2/3 shard is checked
        as it loads), each with its error's message: they are passed over like the ones found here.
        """
        ranks = Ranks()
        candidates, error = [], None
        if ranks.rank == 0:
            try:
                candidates = [str(p) for p in self._candidates(which)]
            except (CheckpointError, ValueError) as e:
                error = e
        ranks.agree(error, f"could not load checkpoint {which!r}", fallback=CheckpointError)
        candidates = ranks.broadcast(candidates)
        fall_back = isinstance(which, str) and which == "auto"
        passed_over = damaged if fall_back and damaged else {}
        found_damaged: List[str] = list(passed_over.values())
        for path in map(Path, candidates):
            if str(path) in passed_over:
                continue
            loaded = self._read_verified(path, ranks, found_damaged if fall_back else None)
            if loaded is not None:
                return (path,) + loaded
        if found_damaged:
            raise CheckpointDamagedError(f"no checkpoint in {self.checkpoint_dir} can be resumed: "
                                         + "; ".join(found_damaged))
        return None

    def _candidates(self, which) -> List[Path]:
        """The folders ``which`` may load, in order: one, or for ``'auto'`` every complete one, ``last`` first."""
        if not (isinstance(which, str) and which == "auto"):
            path = self.resolve(which)
            return [] if path is None else [path]
        found = list(reversed(self.list_checkpoints()))
        last = self.pointer("last")
        return found if last is None else [last] + [p for p in found if p != last]

    def _read_verified(self, path: Path, ranks: Ranks, damaged: Optional[List[str]]):
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
