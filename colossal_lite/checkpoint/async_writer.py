"""Asynchronous checkpoint saves: the state is copied off the training path, the folder is written in the background.

A save blocks only while the state is copied to host memory (``staging.py``) and the temporary
folder is made. A thread of each rank then writes that rank's files (fsync and checksum as on the
synchronous path) and, under ZeRO stage 2/3, waits for the sharded files ``torch.distributed.checkpoint``
writes on a process group of its own. The background does no collective on the training's group:
the ranks learn that every write has finished at a step boundary (``poll``), or when a save, the
end of ``fit`` or a preemption waits for it (``wait``), and only then agree and complete the folder
exactly as a synchronous save does (``writer.complete_write``): ``meta.json``, the rename, the
pointers and retention. A folder therefore appears only complete, and a failed write raises
``CheckpointWriteError`` on every rank at that point, leaving the previous checkpoint as it was.
At most one save is in flight; the next one waits for it.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from ..core import dist as cl_dist
from .io import fsync_dir
from .layout import SHARDED_DIR, remove
from .sharded import lowest_rank_planner, sharded_checksums
from .staging import HostStage
from .writer import FolderWrite, agree_written, commit_folder, write_error, write_rank_files

__all__ = ["AsyncSaves", "SaveTimes"]


@dataclass
class SaveTimes:
    """How long one save took, in seconds: ``blocking`` held the training (gathering and copying the state,
    any wait for the save before it, the agreements that complete it; a wait for its own write only when
    something waited for it, as the end of ``fit`` does), ``total`` from the call to the complete folder;
    ``waited``: the part of ``blocking`` spent waiting for the save before it. A synchronous save blocks for
    all of it (``blocking == total``)."""

    path: Path
    epoch: Optional[int]
    step: Optional[int]
    blocking: float
    total: float
    waited: float = 0.0


class _InFlight:
    """One folder being written by this rank's background thread; on rank 0 the thread then completes it."""

    def __init__(self, job: FolderWrite, sharded_future, started: float, blocking: float, waited: float):
        self.job, self.started, self.blocking, self.waited = job, started, blocking, waited
        self.sums: Dict[str, str] = {}
        self.error: Optional[BaseException] = None  # the write's, then (rank 0) the completion's
        self.written = threading.Event()
        self.committing = False  # every rank's files are in; rank 0's thread completes the folder
        self._go = threading.Event()
        self._checksums: Optional[Dict[str, str]] = None  # every rank's, once agreed (None: give up)
        self._sharded = sharded_future
        # a daemon: a process that ends without waiting for it leaves an unfinished .tmp- folder, as a kill does,
        # instead of hanging on a background collective whose other ranks are gone
        self.thread = threading.Thread(target=self._run, name=f"checkpoint-writer {job.target.name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.sums = write_rank_files(self.job)
            if self._sharded is not None:
                self._sharded.result()
                fsync_dir(self.job.tmp / SHARDED_DIR)
                ranks = self.job.ranks
                self.sums.update(sharded_checksums(self.job.tmp, ranks.rank, ranks.world_size))
        except BaseException as e:  # noqa: BLE001 - reported on every rank when the ranks next agree
            self.error = write_error(self.job, e)
        self.written.set()
        if self.job.ranks.rank != 0 or self.error is not None:
            return
        self._go.wait()
        if self._checksums is not None:
            self.error = commit_folder(self.job, self._checksums)

    def commit(self, checksums: Optional[Dict[str, str]]) -> None:
        """Every rank's files are written (``checksums``): rank 0's thread completes the folder; None: it stops."""
        self._checksums, self.committing = checksums, checksums is not None
        self._go.set()

    def busy(self) -> bool:
        """This rank still has work on this folder: its files, or on rank 0 the completion."""
        return self.thread.is_alive() if self.committing else not self.written.is_set()


class AsyncSaves:
    """The asynchronous saves of one ``CheckpointManager``: at most one in flight, completed at agreed points.

    Two agreements complete a save: once every rank has written its files (their checksums are
    gathered, and rank 0's thread writes ``meta.json``, renames the folder, moves the pointers and
    applies retention), and once rank 0 has done so (its outcome is shared). ``completed`` (the
    manager's list) gets the ``SaveTimes`` of each save once its folder is complete.
    """

    def __init__(self, completed: List[SaveTimes]):
        self.stage = HostStage()
        self.in_flight: Optional[_InFlight] = None
        self.completed = completed
        self._group = None  # the process group of the background sharded writes
        self._flags = None  # a gloo group for the step boundaries' question "is every rank done?": no device sync
        self._stager = None  # DCP's stager of the sharded state (its host buffers are reused from save to save)

    # seconds an error in training waits for this rank's files with several ranks: a sharded write in flight
    # may be waiting for a rank that has gone
    abandon_wait_s = 60.0

    def start(self, begin: Callable[[Callable[[Any], Any]], FolderWrite],
              sharded_state: Optional[Dict[str, Any]], started_at: Optional[float] = None) -> Path:
        """Wait for the save in flight, then copy the state (``begin(stage)``) and write it in the background.

        Collective. Returns the folder the checkpoint will have once it is complete. ``started_at``: when
        the caller began gathering the state (its blocking time counts from there; default: now).
        """
        started = time.perf_counter() if started_at is None else started_at
        if self._flags is None and cl_dist.world_size() > 1:
            self._flags = dist.new_group(backend="gloo")
        waited = self.wait(charge=False) if self.in_flight is not None else 0.0
        job = begin(self.stage.copy)
        sharded = self._start_sharded(job, sharded_state) if sharded_state is not None else None
        blocking = time.perf_counter() - started
        self.in_flight = _InFlight(job, sharded, started, blocking, waited)
        return job.target

    def _start_sharded(self, job: FolderWrite, state: Dict[str, Any]):
        """Stage the sharded state now and let torch.distributed.checkpoint write it on a group of its own.
        Collective: a rank that cannot start it raises on every rank."""
        import torch.distributed.checkpoint as dcp

        if self._group is None and dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")  # the training's group stays free of background collectives
        future, error = None, None
        try:
            writer = dcp.FileSystemWriter(str(job.tmp / SHARDED_DIR), sync_files=True)
            future = dcp.async_save(state, storage_writer=writer, process_group=self._group,
                                    async_stager=self._sharded_stager(), planner=lowest_rank_planner())
        except Exception as e:  # noqa: BLE001 - every rank must reach the agreement below
            error = write_error(job, e)
        job.ranks.agree(error, f"checkpoint {job.target} was not written",
                        lambda: job.ranks.rank == 0 and remove(job.tmp))
        return future

    def _sharded_stager(self):
        """DCP's stager of the sharded state, kept for the run: it copies each shard into the host buffer it used
        at the previous save (the one in flight is always written by then), so only the first save allocates."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self._stager = DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(),
                                                        use_shared_memory=False, use_async_staging=False,
                                                        use_non_blocking_copy=False))
        return self._stager

    def release_buffers(self) -> None:
        """Let the host copies of the state go (none in flight): the reuse is from save to save within a run, and
        a trainer or hook kept after ``fit`` would otherwise hold a host copy of the whole training state."""
        self.stage.release()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def poll(self) -> bool:
        """At a step boundary: move the save in flight on when every rank has finished its part. Collective with
        several ranks while a save is in flight (one all-reduce of one number on a gloo group, so no device
        sync); True when its folder completed."""
        flight = self.in_flight
        if flight is None:
            return False
        began = time.perf_counter()
        if _any_rank(flight.busy(), self._flags):
            return False
        if not flight.committing:
            self._agree_written(flight)
            if _any_rank(flight.busy(), self._flags):
                flight.blocking += time.perf_counter() - began
                return False
        self._finish(flight, began)
        return True

    def wait(self, charge: bool = True) -> float:
        """Wait for the save in flight and complete it (collective); the seconds this took.

        ``charge``: the time spent waiting for its write counts as that save's blocking time (the end of
        ``fit``); the next save passes False and counts it as its own ``waited`` instead.
        """
        flight = self.in_flight
        if flight is None:
            return 0.0
        began = time.perf_counter()
        if not flight.committing:
            flight.written.wait()
            self._agree_written(flight)
        flight.thread.join()
        idle = time.perf_counter() - began
        self._finish(flight, began, uncharged=0.0 if charge else idle)
        return idle

    def _agree_written(self, flight: _InFlight) -> None:
        """Every rank has written its files: share the checksums and let rank 0 complete the folder (or raise on
        every rank when one failed; the folder is removed)."""
        try:
            checksums = agree_written(flight.job, flight.error, flight.sums)
        except BaseException:
            flight.commit(None)
            self._drop(flight)
            raise
        flight.commit(checksums)

    def _finish(self, flight: _InFlight, began: float, uncharged: float = 0.0) -> None:
        """Rank 0 has completed the folder: every rank learns the outcome (raises on every rank when it failed).
        The time since ``began``, less ``uncharged``, is added to the save's blocking time."""
        self._drop(flight)
        job = flight.job
        job.ranks.agree(flight.error if job.ranks.rank == 0 else None, f"checkpoint {job.target} was not completed")
        flight.blocking += time.perf_counter() - began - uncharged
        self.completed.append(SaveTimes(job.target, job.epoch, job.step, flight.blocking,
                                        time.perf_counter() - flight.started, flight.waited))

    def _drop(self, flight: _InFlight) -> None:
        self.in_flight = None
        flight.job.shared_plain = flight.job.rank_plain = None

    def abandon(self) -> Optional[Path]:
        """After an error in training: let the write in flight finish, and complete it only in one process
        (other ranks may not reach an agreement); the folder left unfinished is removed at the next start."""
        flight = self.in_flight
        if flight is None:
            return None
        several = cl_dist.world_size() > 1
        flight.written.wait(timeout=self.abandon_wait_s if several else None)
        if several or flight.error is not None:
            flight.commit(None)  # rank 0's thread stops waiting to complete it
            self._drop(flight)
            if not several:
                remove(flight.job.tmp)  # the write failed: nothing of it is worth keeping
            return None
        self.wait()
        return flight.job.target


def _any_rank(flag: bool, group) -> bool:
    """True when ``flag`` is true on any rank (one all-reduce on the CPU group ``group`` with several ranks)."""
    if cl_dist.world_size() == 1:
        return flag
    return bool(cl_dist.all_reduce_max_(torch.tensor([float(flag)]), group=group).item())
