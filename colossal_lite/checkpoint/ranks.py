"""Every rank agreeing on a checkpoint operation: a failure on one rank raises on all of them."""
from __future__ import annotations

from typing import Any, Optional, Tuple

from ..core import dist as cl_dist
from .io import (
    CheckpointDamagedError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    UnsafeCheckpointError,
)


class Ranks:
    """The ranks of the default process group (one process: no collectives)."""

    def __init__(self):
        self.rank = cl_dist.rank()
        self.world_size = cl_dist.world_size()
        self.distributed = self.world_size > 1

    def all_gather(self, obj) -> list:
        return cl_dist.all_gather_object(obj)

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
        cl_dist.barrier()  # every rank sees the cleaned-up folder when the error surfaces
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
