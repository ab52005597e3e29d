"""``CheckpointSession``: the checkpoints of one ``fit`` -- resume, saves at safe points, preemption signals."""
from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from ...checkpoint import CheckpointManager
from ...core.dist import all_reduce_max_, collective_device, is_rank_0, log_rank_0, world_size
from ...launch import preemption_exit_note, under_torchrun
from .preemption import PREEMPTED_EXIT_CODE, TrainingPreempted, exit_hard_at_interpreter_exit, signal_name
from .restore import load_trainer_checkpoint

__all__ = ["CheckpointSession"]

_NAMED = ("auto", "last", "best", "latest")


class CheckpointSession:
    """Checkpoints during one ``fit``: resume, saves at safe points, preemption by SIGTERM/SIGINT.

    The ``SaveCheckpointHook`` s decide *when* a checkpoint is due; the session writes it at the next safe
    point. ``saving`` is False in test mode (nothing is written to the run's folders). With several ranks the
    stop flag is agreed with one all-reduce at a step boundary; the checks are spaced so that they
    happen about every ``check_s`` seconds (at every step when steps are slower), counted in steps
    agreed by all ranks, so every rank stops after the same step.
    """

    check_s = 1.0  # seconds between two agreements of the stop flag with several ranks
    max_check_every = 1000  # optimizer steps

    def __init__(self, trainer, train_loader, saving: bool = True):
        self.trainer = trainer
        self.train_loader = train_loader
        self.saving = saving
        self.save_hooks = [h for h in trainer.hooks if h.saves_checkpoints]
        self.active = saving and bool(self.save_hooks)
        self.world = world_size()
        self.preempted: Optional[int] = None
        self.checkpoint: Optional[Path] = None
        self._received: Optional[int] = None
        self._previous: Dict[int, Any] = {}
        self._since = 0  # step boundaries since the last agreement
        self._every = 1  # step boundaries between two agreements
        self._last_check = time.perf_counter()
        self._device = collective_device()

    @property
    def last_saved(self) -> Optional[Path]:
        """The newest checkpoint the run's (first) checkpoint hook wrote or resumed from; None when none."""
        return self.save_hooks[0].last_path if self.save_hooks else None

    # -- resume -------------------------------------------------------------------------------
    def _manager_for(self, resume_from) -> CheckpointManager:
        if isinstance(resume_from, str) and resume_from in _NAMED:
            if not self.save_hooks:
                raise ValueError(f"fit(resume_from={resume_from!r}) looks for checkpoints in the checkpoint_dir of a "
                                 f"SaveCheckpointHook, and hooks has none: add SaveCheckpointHook(checkpoint_dir=...) "
                                 f"to hooks, or pass the checkpoint's path (resume_from='runs/ck/epoch3-step120')")
            return self.save_hooks[0].manager
        if isinstance(resume_from, (str, os.PathLike)):
            return CheckpointManager(Path(resume_from), cleanup=False)
        raise TypeError(f"fit(resume_from={resume_from!r}): use None, 'auto', 'last', 'best' or a checkpoint path")

    def resume(self, resume_from) -> Optional[Path]:
        """Restore from ``resume_from`` (None, 'auto', 'last', 'best', 'latest' or a path); None: fresh start."""
        if resume_from is None:
            return None
        trainer = self.trainer
        manager = self._manager_for(resume_from)
        path = load_trainer_checkpoint(trainer, manager, resume_from, self.train_loader)
        if path is None:
            log_rank_0(trainer.logger, f"resume_from='auto': no checkpoint in {manager.checkpoint_dir} yet, "
                                       f"training starts from the beginning")
            return None
        self.restored(path)
        st = trainer.state
        log_rank_0(trainer.logger, f"resumed from {path}: epoch {st.epoch}, step {st.step}, "
                                   f"batch {st.batch_idx} of the epoch")
        if getattr(self.train_loader, "persistent_workers", False) and getattr(self.train_loader, "num_workers", 0) \
                and is_rank_0():
            # Persistent workers are seeded once, when the loader's first iterator is made, and carry their random
            # streams from epoch to epoch: no fresh process can make them stand where the interrupted run's stood.
            warnings.warn(f"resumed from {path} on a DataLoader with persistent_workers=True: its workers start new "
                          f"random streams, so random draws in the workers (a data augmentation) differ from the "
                          f"uninterrupted run's for the rest of the run; the model, optimizer, data order and the "
                          f"main process's random state are restored. For an exact resume use "
                          f"persistent_workers=False", stacklevel=3)
        return path

    def nothing_to_do(self) -> bool:
        """True (and a log line on rank 0) when the run already stands at the end this ``fit`` was asked for."""
        st = self.trainer.state
        if not self._run_complete():
            return False
        if st.max_steps_reached:
            message = (f"already trained to step {st.step} (epoch {st.epoch}, batch {st.batch_idx}), nothing to do: "
                       f"this fit ends at max_steps={st.max_steps}; pass a larger max_steps to train further")
        else:
            message = (f"already trained to epoch {st.epoch}, nothing to do (step {st.step}; this fit ends at "
                       f"epochs={st.max_epochs}); pass more epochs to train further")
        log_rank_0(self.trainer.logger, message)
        return True

    def _run_complete(self) -> bool:
        """The run stands at the end this ``fit`` was asked for, or a hook stopped it: nothing is left to train."""
        st = self.trainer.state
        return st.max_steps_reached or (st.max_epochs is not None and st.epoch >= st.max_epochs) or st.stop_training

    def restored(self, path: Path) -> None:
        """The run now stands where ``path`` was taken: a save at this position would only repeat it."""
        for hook in self.save_hooks:
            hook.restored(self.trainer, path)

    # -- signals ------------------------------------------------------------------------------
    def watch_signals(self, signals) -> None:
        """Install the preemption handlers (with a SaveCheckpointHook to write to, in the main thread)."""
        if not self.active or not signals:
            return
        if threading.current_thread() is not threading.main_thread():
            warnings.warn("fit runs outside the main thread, where signal handlers cannot be installed: SIGTERM/SIGINT "
                          "will not write a checkpoint before the process ends", stacklevel=3)
            return
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self._received == signal.SIGINT and (signum == signal.SIGINT or under_torchrun()):
            # a second Ctrl-C: stop at once. Under torchrun it comes as SIGTERM: the agent forwards the first
            # Ctrl-C as SIGINT, and sends SIGTERM when a second one interrupts its wait for the workers
            raise KeyboardInterrupt
        if self._received is None:
            self._received = signum
            again = " (Ctrl-C again stops at once, without a checkpoint)" if signum == signal.SIGINT else ""
            os.write(2, f"{signal_name(signum)} received: finishing the current optimizer step, then writing a "
                        f"checkpoint{again}\n".encode())

    def close(self) -> None:
        """Put back the signal handlers that were there before ``fit``; a save still in flight (``fit`` failed)
        finishes its write."""
        for hook in self.save_hooks:
            hook.abandon(self.trainer)
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    # -- safe points --------------------------------------------------------------------------
    def _save_due(self) -> None:
        for hook in self.save_hooks:
            hook.save_if_due(self.trainer)

    def at_step_boundary(self) -> bool:
        """After an optimizer step (and its evaluation): interval saves; True when the run must stop (preempted)."""
        st = self.trainer.state
        if st.epoch_finished:
            return False  # the epoch ends now: the epoch's boundary comes right after its end events
        self._save_due()
        if st.max_steps_reached or st.stop_training:  # the run stops inside the epoch: the final checkpoint is
            for hook in self.save_hooks:  # taken here, before the epoch-end events of the cut-short epoch
                hook.save(self.trainer)
        self._since += 1
        if self.world > 1 and self._since < self._every:
            return False
        return self._agree()

    def at_epoch_boundary(self) -> bool:
        """After an epoch's end events, its evaluation and the move to the next epoch."""
        if not self.active:
            return False
        self._save_due()
        return self._agree()

    def _agree(self) -> bool:
        if not self._previous:
            return False  # no handlers: nothing can ask to stop
        if self.world == 1:
            signum = self._received
        else:
            now = time.perf_counter()
            buf = torch.tensor([float(self._received or 0), now - self._last_check], device=self._device)
            all_reduce_max_(buf)  # any rank's signal; the slowest rank's time
            flag, elapsed = buf.tolist()
            per_step = elapsed / max(self._since, 1)
            self._every = max(1, min(self.max_check_every, int(self.check_s / max(per_step, 1e-6))))
            self._since, self._last_check = 0, time.perf_counter()
            signum = int(flag)
        if not signum:
            return False
        if self._run_complete():  # (the last step, its evaluation or the final saves: nothing was cut short)
            self._received = None
            log_rank_0(self.trainer.logger, f"{signal_name(signum)} received as the run ended: training is complete and "
                                            f"its checkpoint written, so the run ends normally (exit status 0)")
            return False
        self._stop(signum)
        return True

    def _stop(self, signum: int) -> None:
        trainer = self.trainer
        self.preempted = signum
        self.checkpoint = self.save_hooks[0].save(trainer)
        st = trainer.state
        log_rank_0(trainer.logger, f"{signal_name(signum)}: stopped at epoch {st.epoch}, step {st.step} (batch "
                                   f"{st.batch_idx} of the epoch); checkpoint {self.checkpoint}; "
                                   f"{preemption_exit_note(signum, PREEMPTED_EXIT_CODE)}")

    def finish(self) -> None:
        """At the end of training: each SaveCheckpointHook's final save, then a last look at the stop flag."""
        if not self.active:
            return
        for hook in self.save_hooks:
            hook.save(self.trainer)
        if self.preempted is None:
            self._agree()

    def raise_if_preempted(self) -> None:
        if self.preempted is not None:
            if self.world > 1:
                exit_hard_at_interpreter_exit(PREEMPTED_EXIT_CODE)
            raise TrainingPreempted(self.preempted, self.checkpoint)
