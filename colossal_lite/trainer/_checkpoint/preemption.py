"""``TrainingPreempted`` and the process exit after a preemption (status 75, also with several ranks)."""
from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Optional

__all__ = ["PREEMPTED_EXIT_CODE", "TrainingPreempted", "signal_name"]

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): "temporary failure, run again" -- resume with resume_from='auto'


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class TrainingPreempted(SystemExit):
    """Raised by ``fit`` after SIGTERM/SIGINT once the checkpoint is written; exits the process with status 75.

    ``signal``: the signal number; ``checkpoint``: the folder written (or the one already there at that step).
    """

    def __init__(self, signum: int, checkpoint: Optional[Path]):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.signal = signum
        self.checkpoint = checkpoint

    def __str__(self) -> str:
        return (f"training preempted by {signal_name(self.signal)}; checkpoint {self.checkpoint}; "
                f"exit status {PREEMPTED_EXIT_CODE}")


_HARD_EXIT: Optional[int] = None


def exit_hard_at_interpreter_exit(code: int = PREEMPTED_EXIT_CODE) -> None:
    """End the process with ``code`` once the interpreter exits, with ``os._exit`` after a flush and the exit
    handlers registered after this module was imported, whatever the script does after catching the
    preemption. With several ranks a process leaving with its gloo threads alive can otherwise abort in C++
    teardown (status 134) and hide the preemption's status from the launcher that must restart the job."""
    global _HARD_EXIT
    _HARD_EXIT = code


def _exit_now_if_preempted() -> None:
    """Registered when this module is imported, so it runs after the exit handlers registered later."""
    if _HARD_EXIT is None:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - closed or replaced streams
            pass
    os._exit(_HARD_EXIT)


atexit.register(_exit_now_if_preempted)
