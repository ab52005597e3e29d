"""How a command-line tool ends when its reader closes the pipe early: quietly, with SIGPIPE's status.

Shared by ``colossal-lite`` and ``python -m colossal_lite.checkpoint.cli``.
"""
from __future__ import annotations

import functools
import os
import sys
from typing import Callable, List, Optional

__all__ = ["BROKEN_PIPE_STATUS", "quiet_on_broken_pipe"]

# A reader that stops early (``colossal-lite ckpt info DIR | head -1``) closes the pipe. The command then
# stops quietly with the status a shell gives any tool stopped by SIGPIPE (128 + 13), as ``cat`` or ``grep``
# would: a script with ``set -o pipefail`` sees the same as for them, and no caller mistakes the cut-short
# output for a complete one (status 0 would claim it was all delivered).
BROKEN_PIPE_STATUS = 141


def _stdout_to_devnull() -> None:
    """Point stdout at the null device, so that the interpreter's last flush at exit has nowhere to fail."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # not a real file (an in-process capture): nothing is flushed at exit
        pass


def quiet_on_broken_pipe(main_fn: Callable[[Optional[List[str]]], int]) -> Callable[[Optional[List[str]]], int]:
    """Wrap a command's ``main(argv)``: a reader that closed stdout early ends it with ``BROKEN_PIPE_STATUS``
    and no traceback. Output still in the buffer is flushed here, where the error can be caught."""
    @functools.wraps(main_fn)
    def main(argv: Optional[List[str]] = None) -> int:
        try:
            try:
                return main_fn(argv)
            finally:  # also after ``--help`` or ``--version``, which end in SystemExit
                sys.stdout.flush()
        except BrokenPipeError:
            _stdout_to_devnull()
            return BROKEN_PIPE_STATUS

    return main
