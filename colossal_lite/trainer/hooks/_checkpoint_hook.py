"""``SaveCheckpointHook`` and ``LoadCheckpointHook``: the legacy hooks on top of ``CheckpointManager``.

``SaveCheckpointHook`` only decides *when* a checkpoint is due; ``fit`` writes it at the next safe
point (after the step's or the epoch's evaluation), so a run resumed from it continues exactly.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional, Sequence, Tuple, Union

from ...checkpoint import CheckpointManager
from ...checkpoint.async_writer import SaveTimes
from ...checkpoint.io import CheckpointNotFoundError, load_single_file
from ...checkpoint.layout import write_save_times
from ...checkpoint.manager import is_single_file, read_meta
from ...checkpoint.merged import is_merged, split_merged
from ...core.dist import is_rank_0, log_rank_0, rank, world_size
from ...utils.checkpointing import (
    legacy_epoch_files,
    load_checkpoint_state,
    refuse_window_on_ranks,
    remove_stale_temp_files,
    write_checkpoint_file,
)
from .._checkpoint.contents import checkpoint_metrics, hook_entry, name_epoch, position, save_trainer_checkpoint
from .._checkpoint.restore import load_trainer_checkpoint, restore_trainer_checkpoint
from ..time import AtSteps, Interval, Time, TimeUnit
from ._base_hook import BaseHook
from ._utils import bind_interval

__all__ = ["SaveCheckpointHook", "LoadCheckpointHook"]

LEGACY_FILE_SUFFIXES = (".pt", ".pth")  # SaveCheckpointHook(checkpoint_dir='x.pt'): the legacy single file


class SaveCheckpointHook(BaseHook):
    """Saves the whole run (engine, schedulers, progress, data order, RNG, hooks) every ``interval``.

    Args:
        interval: an int (epochs; optimizer steps with ``save_by_iter=True``) or a time string:
            ``'2ep'``, ``'500ba'`` (optimizer steps), ``'0.25dur'`` (a fraction of the run's steps); or a
            list of the moments to save at, once each: ``[200, 500, 1000]`` (ints in a list are always
            optimizer steps) or time strings (``['0.5dur', '3ep']``: the step that ends epoch 3).
        checkpoint_dir: the folder of this run's checkpoints: one folder ``epoch{E}-step{S}`` per
            checkpoint, plus ``last``/``best`` pointers (``docs/checkpoints.md``). A path ending in ``.pt``
            or ``.pth`` is the legacy single file instead (as the legacy docs and examples pass it): rank 0
            rewrites it atomically at each interval in ``save_checkpoint``'s format (epoch, model, optimizer,
            the first ``LRSchedulerHook``'s scheduler), which ``load_checkpoint`` and ``LoadCheckpointHook``
            read; it holds no run position, so ``fit(resume_from=...)`` needs a folder. A ``{epoch}`` in the
            file's name makes one file per save, as legacy v0.1 wrote them:
            ``get_checkpoint_path('ckpt', '{epoch}')`` is ``ckpt/epoch{epoch}-tp0-pp0.pt``.
        model: kept for the legacy signature; the engine's model is always saved (without the DDP
            prefix). When given it must be the engine's model (wrapped or not).
        save_by_iter: count an int ``interval`` in optimizer steps instead of epochs.
        save_last: move the ``last`` pointer to each new checkpoint.
        save_best: ``None`` or ``(metric, 'min' | 'max')``, e.g. ``('Loss', 'min')``: move ``best`` when the
            metric improves. A bare name is the test metric when ``fit`` evaluates, else the train one;
            ``'train/Loss'`` / ``'test/Accuracy'`` choose. It is compared only where it was measured: a
            test metric right after an evaluation, a train metric at an epoch's end.
        keep_last_n: keep only the ``n`` newest checkpoints (and whatever ``last``/``best`` name).
        async_save: training waits only while the state is copied to host memory; the folder is written in
            the background and appears (``last``/``best`` move, retention runs) at the first step boundary
            after every rank finished writing it. At most one save is in flight: a save due before the
            previous one is written waits for it, and says so. ``fit``'s end, a preemption and an error
            wait for the save in flight.

    Every save's times, in seconds from the save call (gathering the state included), go to the log line
    and to the history and metrics file: ``checkpoint/blocking_s`` (how long training waited) and
    ``checkpoint/total_s`` (until the checkpoint was complete); a synchronous save blocks for all of it.
    They are each rank's own measurement (with the legacy file, only rank 0 writes), and they differ from
    run to run: ``History.without_measured()`` leaves them out when two runs are compared.

    A final checkpoint is also written when ``fit`` ends (unless one was just written at that step).
    ``save(trainer)`` writes one now (every rank must call it; at an optimizer step boundary, or
    inside an accumulation window, whose gradients are then saved too).
    """

    reads_train_output = False  # (BaseHook.reads_train_output)

    def __init__(self, interval: Union[int, str, Time, Sequence[Union[int, str, Time]]] = 1,
                 checkpoint_dir: Optional[str] = None, model=None,
                 save_by_iter: bool = False, priority: int = 10, save_last: bool = True,
                 save_best: Optional[Tuple[str, str]] = None, keep_last_n: Optional[int] = None,
                 async_save: bool = False):
        super().__init__(priority)
        if checkpoint_dir is None:
            raise ValueError("SaveCheckpointHook(checkpoint_dir=None): give the folder the checkpoints go to, "
                             "e.g. SaveCheckpointHook(checkpoint_dir='runs/ck')")
        default_unit = TimeUnit.BATCH if save_by_iter else TimeUnit.EPOCH
        try:
            self.interval = AtSteps(interval) if isinstance(interval, (list, tuple)) \
                else Interval(interval, default_unit=default_unit)
        except ValueError as err:
            raise ValueError(f"SaveCheckpointHook(interval={interval!r}): {err}") from None
        if save_by_iter and self.interval.unit is TimeUnit.EPOCH:
            raise ValueError(f"SaveCheckpointHook(interval={interval!r}, save_by_iter=True): save_by_iter counts "
                             f"optimizer steps, but the interval is in epochs; use interval='500ba' or an int")
        _check_options(save_best, keep_last_n)  # fails at construction, not at the first save
        self._options = dict(save_last=save_last, save_best=save_best, keep_last_n=keep_last_n,
                             async_save=bool(async_save))
        self.checkpoint_dir = Path(checkpoint_dir)
        self.file: Optional[Path] = self.checkpoint_dir if self.checkpoint_dir.suffix in LEGACY_FILE_SUFFIXES else None
        if self.file is not None and (save_best is not None or keep_last_n is not None):
            raise ValueError(f"SaveCheckpointHook({str(checkpoint_dir)!r}, save_best=..., keep_last_n=...): a path "
                             f"ending in {self.file.suffix} is one legacy file, rewritten at each interval; "
                             f"save_best and keep_last_n choose among checkpoint folders: give a folder instead")
        if self.file is not None and async_save:
            raise ValueError(f"SaveCheckpointHook({str(checkpoint_dir)!r}, async_save=True): a path ending in "
                             f"{self.file.suffix} is one legacy file, written by rank 0 at each interval; "
                             f"async_save writes checkpoint folders: give a folder instead")
        self.model = model
        self.save_by_iter = bool(save_by_iter)
        self.save_best = None if save_best is None else (save_best[0], save_best[1])
        self._manager: Optional[CheckpointManager] = None
        self.last_path: Optional[Path] = None  # the newest checkpoint this hook wrote (or resumed from)
        self._last_position = None
        self._due = False

    saves_checkpoints = True

    @property
    def run_folder(self) -> Optional[Path]:
        """The checkpoint folder (None for the legacy single file)."""
        return self.checkpoint_dir if self.file is None else None

    @property
    def manager(self) -> Optional[CheckpointManager]:
        """The ``CheckpointManager`` of the folder (built when the hook is attached to a ``fit``)."""
        if self.file is not None:
            raise ValueError(f"SaveCheckpointHook({str(self.file)!r}) writes one legacy file, which holds the "
                             f"weights, optimizer and scheduler but not where the run stood, so fit(resume_from=...) "
                             f"cannot continue from it exactly: load it with LoadCheckpointHook({str(self.file)!r}) "
                             f"(training goes on with the next epoch), or give SaveCheckpointHook a folder")
        return self._manager

    @property
    def watched_metrics(self):
        return () if self.save_best is None else (self.save_best[0],)

    def after_hook_is_attached(self, trainer):
        if not trainer.state.fitting:
            return
        bind_interval(self.interval, trainer, type(self).__name__)
        if self.model is not None:
            engine = trainer.engine
            if not any(m is self.model for m in engine.model.modules()):
                raise ValueError("SaveCheckpointHook(model=...) is not the engine's model. The engine's model is "
                                 "always saved (without the DDP 'module.' prefix); leave model out")
        if self.file is None and self._manager is None:  # built once: it cleans what interrupted writes left
            self._manager = CheckpointManager(self.checkpoint_dir, **self._options)  # and reads the best value
        elif self.file is not None and is_rank_0():
            remove_stale_temp_files(self.file)  # what a killed earlier run left mid-write
        self._due = False

    def after_train_iter(self, trainer, output, label, loss):
        if trainer.state.stepped and self.interval.unit is not TimeUnit.EPOCH \
                and self.interval.is_step_boundary(trainer.state.step):
            self._due = True

    def after_train_epoch(self, trainer):
        st = trainer.state
        if self.interval.unit is TimeUnit.EPOCH and st.epoch_finished \
                and self.interval.is_epoch_boundary(st.epoch + 1):
            self._due = True

    def save_if_due(self, trainer) -> Optional[Path]:
        """At a safe point: write the checkpoint that ``interval`` made due since the last one (all ranks).

        With ``async_save``, first complete the save in flight if every rank has written it."""
        if self._manager is not None and self._manager.in_flight is not None:
            self._manager.poll()
            self._report(trainer)
        if not self._due:
            return None
        self._due = False
        return self.save(trainer)

    def restored(self, trainer, path: Path) -> None:
        """The run now stands where ``path`` was taken (it was just restored): a save here would only repeat it."""
        self._last_position, self.last_path = position(trainer), path

    def save(self, trainer) -> Path:
        """Write a checkpoint of the run now (all ranks); returns its folder. Once per position."""
        started_at = time.perf_counter()  # a save's times include gathering the state
        here = position(trainer)
        if here == self._last_position and self.last_path is not None:
            return self.last_path
        trainer.check_losses_finite()  # nan weights never become a checkpoint (nor push a good one out)
        if self.file is not None:
            path = self._save_file(trainer)
            took = time.perf_counter() - started_at
            self._record(trainer, SaveTimes(path, name_epoch(trainer), trainer.state.step, took, took))
        else:
            if self._manager is None:
                self._manager = CheckpointManager(self.checkpoint_dir, **self._options)
            metrics = checkpoint_metrics(trainer, None if self.save_best is None else self.save_best[0])
            path = save_trainer_checkpoint(trainer, self._manager, metrics=metrics, started_at=started_at)
        self._last_position, self.last_path = here, path
        self._report(trainer)  # this save when it was synchronous; else the one before it, if this one waited for it
        if self._manager is not None and self._manager.in_flight is not None:
            waited = self._manager.in_flight_waited
            note = f"waited {waited:.3f} s for the previous save to be written (one in flight at most); " \
                if waited > 0 else ""
            log_rank_0(trainer.logger, f"checkpoint {path.name}: {note}writing in the background")
        return path

    def after_train(self, trainer):
        """The end of ``fit`` (a preemption's included): the save in flight is completed before ``fit`` returns,
        and the host copies of the state it was written from are let go."""
        self.wait(trainer)
        if self._manager is not None:
            self._manager.release_buffers()

    def wait(self, trainer) -> None:
        """Wait for the asynchronous save in flight and complete it (every rank); reported like any save."""
        if self._manager is not None and self._manager.in_flight is not None:
            self._manager.wait()
        self._report(trainer)

    def abandon(self, trainer) -> None:
        """After an error in ``fit``: the write in flight finishes (completed in one process, see
        ``CheckpointManager.abandon``) so no thread is cut off halfway through a file."""
        if self._manager is not None and self._manager.in_flight is not None:
            path = self._manager.abandon()
            note = f"completed {path}" if path is not None else "left unfinished (removed at the next start)"
            log_rank_0(trainer.logger, f"fit failed while a checkpoint was written in the background: {note}")
        if self._manager is not None:
            self._manager.finished_saves.clear()
            self._manager.release_buffers()

    def _report(self, trainer) -> None:
        """Log and record each save of the folder completed since the last report (every rank)."""
        if self._manager is None:
            return
        done, self._manager.finished_saves[:] = list(self._manager.finished_saves), []
        for t in done:
            self._record(trainer, t)

    @staticmethod
    def _record(trainer, t: SaveTimes) -> None:
        """One save's times in the log line, the history and the trackers (``checkpoint/blocking_s``, ``total_s``)."""
        wait = f", of which {t.waited:.3f} s waiting for the save before it" if t.waited > 0 else ""
        log_rank_0(trainer.logger, f"checkpoint saved: {t.path} (training blocked {t.blocking:.3f} s{wait}; "
                                   f"written in {t.total:.3f} s)")
        values = {"checkpoint/blocking_s": t.blocking, "checkpoint/total_s": t.total}
        trainer.record_values(values, step=t.step, epoch=t.epoch)
        if is_rank_0() and Path(t.path).is_dir():
            try:
                write_save_times(t.path, t.step, t.epoch, time.time(), values)
            except OSError as err:  # (the checkpoint is complete without them: a run resumed from it lacks them)
                log_rank_0(trainer.logger, f"could not add the save's times to {t.path}: {err}")

    def _save_file(self, trainer) -> Path:
        """The legacy single file: the engine's full model and optimizer state (gathered on every rank: a
        collective under ZeRO), the engine's own state (update count, loss scaler) and the first
        ``LRSchedulerHook``'s scheduler, written by rank 0 over the last one.
        It is named after the epoch its last optimizer step belongs to, as ``LoadCheckpointHook`` expects."""
        refuse_window_on_ranks(trainer.engine, f"SaveCheckpointHook({str(self.file)!r})")
        engine_state = trainer.engine.state_dict()
        scheduler = next((hook for hook in trainer.hooks if hook_entry(hook) == "lr_schedulers"), None)
        epoch = name_epoch(trainer)
        file = Path(str(self.file).replace("{epoch}", str(epoch)))
        if is_rank_0():
            own_state = {key: value for key, value in engine_state.items() if key not in ("model", "optimizer")}
            write_checkpoint_file(file, epoch, engine_state["model"], engine_state["optimizer"],
                                  None if scheduler is None else scheduler.state_dict(), engine_state=own_state)
        return file

    def __repr__(self) -> str:
        return f"SaveCheckpointHook(interval={str(self.interval)!r}, checkpoint_dir={str(self.checkpoint_dir)!r})"


def _check_options(save_best, keep_last_n) -> None:
    if save_best is not None and not (isinstance(save_best, (tuple, list)) and len(save_best) == 2
                                      and isinstance(save_best[0], str) and save_best[1] in ("min", "max")):
        raise ValueError(f"SaveCheckpointHook(save_best={save_best!r}): use None or (metric, 'min' | 'max'), "
                         f"e.g. ('Loss', 'min') or ('Accuracy', 'max')")
    if keep_last_n is not None and (isinstance(keep_last_n, bool) or not isinstance(keep_last_n, int)
                                    or keep_last_n < 1):
        raise ValueError(f"SaveCheckpointHook(keep_last_n={keep_last_n!r}): use None (keep all) or an int >= 1")


class LoadCheckpointHook(BaseHook):
    """Loads a checkpoint before training (legacy ``LoadCheckpointHook``, loaded in ``before_train``).

    Args:
        checkpoint_dir: a folder of checkpoints (``SaveCheckpointHook``'s), one checkpoint folder, a
            ``last``/``best`` pointer, a file ``colossal-lite ckpt merge`` wrote (restored as its folder
            would be), a single file written by ``colossal_lite.utils.save_checkpoint``, or a folder of
            legacy per-epoch files ``epoch{E}-tp0-pp0{suffix}.pt`` (``SaveCheckpointHook(1,
            get_checkpoint_path(folder, '{epoch}'))`` writes them), used when it holds no checkpoint folder.
        epoch: -1 loads the latest checkpoint (``last``; of legacy files, the highest epoch); ``k`` the
            newest one taken in epoch ``k`` (folder ``epoch{k}-step*``; an epoch's end checkpoint is named
            after that epoch), or the legacy file ``epoch{k}-tp0-pp0{suffix}.pt``.
        finetune: load the model weights only; progress, optimizer, schedulers, data order start from 0.
        strict: the model's keys must match the checkpoint's exactly (shape mismatches always fail).
        suffix: the end of the legacy files' names before ``.pt`` (``get_checkpoint_path``'s ``suffix``).

    A missing checkpoint raises ``FileNotFoundError`` (``CheckpointNotFoundError``) naming the folder.
    """

    def __init__(self, checkpoint_dir: Optional[str] = None, epoch: int = -1, finetune: bool = False,
                 strict: bool = False, suffix: str = "", priority: int = 0):
        super().__init__(priority)
        if checkpoint_dir is None:
            raise ValueError("LoadCheckpointHook(checkpoint_dir=None): give the checkpoint folder (or file) to load")
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < -1:
            raise ValueError(f"LoadCheckpointHook(epoch={epoch!r}): use -1 (the latest) or an epoch index >= 0")
        if not isinstance(suffix, str):
            raise ValueError(f"LoadCheckpointHook(suffix={suffix!r}): the suffix is the text between 'pp0' and "
                             f"'.pt' in the legacy file names, a str such as '' or '-best'")
        self.suffix = suffix
        self.checkpoint_dir = Path(checkpoint_dir)
        self.epoch = epoch
        self.finetune = bool(finetune)
        self.strict = bool(strict)
        self.loaded: Optional[Path] = None  # what was loaded

    def _pick(self, manager: CheckpointManager):
        if self.epoch == -1:
            if manager.resolve("auto") is None:
                raise CheckpointNotFoundError(f"LoadCheckpointHook: no checkpoint in {self.checkpoint_dir} (neither "
                                              f"checkpoint folders nor legacy files "
                                              f"epoch<N>-tp0-pp0{self.suffix}.pt)")
            return "auto"
        found, epochs = None, set()
        for path in manager.list_checkpoints():
            e = read_meta(path).get("epoch")
            epochs.add(e)
            if e == self.epoch:
                found = path
        if found is None:
            raise CheckpointNotFoundError(f"LoadCheckpointHook(epoch={self.epoch}): no checkpoint of epoch {self.epoch} "
                                          f"in {self.checkpoint_dir}; it has epochs "
                                          f"{sorted(e for e in epochs if isinstance(e, int))}")
        return found

    def _legacy_epoch_file(self, path: Path) -> Optional[Path]:
        """In a folder without checkpoint folders, legacy v0.1's per-epoch file that ``epoch`` names (the highest
        epoch for -1), as legacy ``LoadCheckpointHook`` found it; ``None`` for any other ``path``."""
        if not path.is_dir() or (path / "meta.json").is_file():
            return None
        files = legacy_epoch_files(path, self.suffix)
        if not files or CheckpointManager(path, cleanup=False).resolve("auto") is not None:
            return None
        if self.epoch == -1:
            return files[max(files)]
        if self.epoch not in files:
            raise CheckpointNotFoundError(f"LoadCheckpointHook(epoch={self.epoch}): no file "
                                          f"epoch{self.epoch}-tp0-pp0{self.suffix}.pt in {path}; it has the files "
                                          f"of epochs {sorted(files)}")
        return files[self.epoch]

    def before_train(self, trainer):
        path = self.checkpoint_dir
        session = trainer.checkpoints
        if is_single_file(path):
            self.loaded = self._load_file(trainer, path)
        elif (legacy_file := self._legacy_epoch_file(path)) is not None:
            self.loaded = self._load_file(trainer, legacy_file)
        else:
            if not path.exists():
                raise CheckpointNotFoundError(f"LoadCheckpointHook: {path} does not exist")
            if (path / "meta.json").is_file() or path.is_file():  # one checkpoint folder, or a pointer file
                manager, which = CheckpointManager(path.parent, cleanup=False), path
            else:
                manager = CheckpointManager(path, cleanup=False)
                which = self._pick(manager)
            self.loaded = load_trainer_checkpoint(trainer, manager, which, finetune=self.finetune, strict=self.strict)
        if session is not None and not self.finetune:
            session.restored(self.loaded)
        st = trainer.state
        log_rank_0(trainer.logger, f"LoadCheckpointHook: loaded {self.loaded}"
                                    + (" (weights only: finetune)" if self.finetune else "")
                                    + f"; training starts at epoch {st.epoch}, step {st.step}")

    def _load_file(self, trainer, path: Path) -> Path:
        """A single file: one ``ckpt merge`` wrote restores the whole run, as its folder would; a ``save_checkpoint``
        file the model (+ optimizer and the first LRSchedulerHook's scheduler unless finetune)."""
        state = load_single_file(path)
        if is_merged(state):
            shared, rank_state = split_merged(state, path, rank(), world_size())
            return restore_trainer_checkpoint(trainer, path, shared, rank_state, finetune=self.finetune,
                                              strict=self.strict)
        return self._load_saved_file(trainer, path, state)

    def _load_saved_file(self, trainer, path: Path, state) -> Path:
        """The content of a ``save_checkpoint`` file: model (+ optimizer and the first LRSchedulerHook's scheduler
        unless finetune); training continues with the epoch after the one it holds."""
        engine, st = trainer.engine, trainer.state
        # the file's one scheduler state goes to the first hook that keeps a scheduler's state (an LRSchedulerHook)
        scheduler = next((hook for hook in trainer.hooks if hook_entry(hook) == "lr_schedulers"), None)
        epoch = load_checkpoint_state(state, path, engine.model, None if self.finetune else engine.optimizer,
                                      None if self.finetune else scheduler, strict=self.strict, engine=engine)
        start = 0 if self.finetune or epoch < 0 else epoch + 1  # the file holds the epoch it finished
        spe = st.steps_per_epoch or 0
        trainer.load_state_dict({"progress": {"epoch": start, "step": start * spe, "batch_idx": 0,
                                              "iteration": start * (st.iters_per_epoch or 0)}})
        return path
