"""Trainer checkpoints: what one holds, how ``fit`` saves and restores it, and preemption.

A trainer checkpoint is one ``CheckpointManager`` folder (``docs/checkpoints.md``)::

    shared_state = {"engine": ..., "lr_schedulers": {...}, "trainer": {"progress", "hooks"},
                    "hooks": {...}, "colossal_lite": {"version", "world_size", "format"}}
    rank_state   = {"rng": capture_rng_state(), "data": train_loader.state_dict(), "hooks": {...}}

``fit`` saves only at *safe points*: after an optimizer step and the evaluation that may follow it,
or after an epoch's end events, its evaluation and the move to the next epoch. Nothing else happens
between a safe point and the next training batch, so a run resumed from there computes exactly
what the uninterrupted run computed. ``CheckpointSession`` is that part of one ``fit`` call:
resume, interval saves at safe points, and preemption (SIGTERM / SIGINT).
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch.optim import lr_scheduler

from ..checkpoint import CheckpointManager, capture_rng_state, checkpoint_name, restore_rng_state, to_plain
from ..checkpoint.io import CheckpointError, format_bytes
from ..checkpoint.manager import has_sharded_state, load_sharded, model_state_from
from ..checkpoint.merged import keyed_by_name, optimizer_state_by_name, optimizer_state_by_position, parameter_names
from ..core.global_context import global_context as gpc
from ..launch import preemption_exit_note, under_torchrun
from ..nn.lr_scheduler import LinearWarmupLR, PolynomialLR
from ..nn.lr_scheduler._base import _TwoStageScheduler
from .hooks._log_hook import log_rank_0
from .hooks._metric_hook import LRSchedulerHook

__all__ = ["PREEMPTED_EXIT_CODE", "TrainingPreempted", "save_trainer_checkpoint", "load_trainer_checkpoint",
           "restore_trainer_checkpoint", "checkpoint_metrics", "CheckpointSession", "checkpoint_round_trip"]

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): "temporary failure, run again" -- resume with resume_from='auto'
TRAINER_FORMAT = 1
PathLike = Union[str, "os.PathLike[str]"]


class TrainingPreempted(SystemExit):
    """Raised by ``fit`` after SIGTERM/SIGINT once the checkpoint is written; exits the process with status 75.

    ``signal``: the signal number; ``checkpoint``: the folder written (or the one already there at that step).
    With several ranks, once the exit status has been read (by the interpreter, as the exception ends the
    script) the process ends with ``os._exit(75)`` after a flush and the exit handlers registered after this
    module was imported: a process
    leaving with its gloo threads alive can otherwise abort in C++ teardown (status 134) and hide the 75.
    """

    def __init__(self, signum: int, checkpoint: Optional[Path], hard_exit: bool = False):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.signal = signum
        self.checkpoint = checkpoint
        self._hard_exit = hard_exit

    @property
    def code(self) -> int:
        global _HARD_EXIT
        if self._hard_exit:
            _HARD_EXIT = PREEMPTED_EXIT_CODE
        return PREEMPTED_EXIT_CODE

    def __str__(self) -> str:
        return (f"training preempted by {_signal_name(self.signal)}; checkpoint {self.checkpoint}; "
                f"exit status {PREEMPTED_EXIT_CODE}")


_HARD_EXIT: Optional[int] = None


def _exit_now_if_preempted() -> None:
    """Registered when this module is imported, so it runs after the exit handlers registered later."""
    if _HARD_EXIT is None:
        return
    import logging
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - closed or replaced streams
            pass
    os._exit(_HARD_EXIT)


atexit.register(_exit_now_if_preempted)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


# -- ranks ---------------------------------------------------------------------------------------
def _world() -> int:
    return gpc.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _broadcast(obj):
    if _world() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_ok(ok: bool, device) -> bool:
    if _world() == 1:
        return ok
    flag = torch.tensor([1.0 if ok else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() > 0)


# -- what a checkpoint holds ---------------------------------------------------------------------
def position(trainer) -> Tuple[int, int, int, int]:
    """``(epoch, step, iteration, batch_idx)``: where the run stands (two saves at one position are one)."""
    st = trainer.state
    return st.epoch, st.step, st.iteration, st.batch_idx


def _name_epoch(trainer) -> int:
    """The epoch a checkpoint is named after: the one its last optimizer step belongs to."""
    st = trainer.state
    if st.batch_idx == 0 and st.epoch > 0 and st.step > 0:
        return st.epoch - 1  # taken after the epoch's end: named after the finished epoch
    return st.epoch


def _scheduler_hooks(trainer) -> List[Tuple[str, Any]]:
    return [(key, hook) for key, hook in zip(trainer._hook_keys(), trainer.hooks) if isinstance(hook, LRSchedulerHook)]


def _loader_state(loader) -> Optional[Dict[str, Any]]:
    fn = getattr(loader, "state_dict", None)
    if not callable(fn):
        return None
    try:
        return fn()
    except TypeError:  # e.g. a ResumableDataLoader over a sampler that cannot resume
        return None


def _metric_value(metric) -> Optional[float]:
    try:
        return float(metric.get_accumulated_value())
    except Exception:  # noqa: BLE001 - a metric that cannot be read is left out (same on every rank)
        return None


def checkpoint_metrics(trainer, watch: Optional[str] = None) -> Dict[str, Optional[float]]:
    """The metric values a checkpoint records (``'train/Loss'``, ``'test/Accuracy'`` ...). Every rank calls it.

    Train metrics are recorded when they cover a whole epoch (at an epoch's end), test metrics when
    the evaluation ran at this very step. ``watch`` (a ``save_best`` name) is always a key: a bare
    name is the test metric when ``fit`` evaluates, else the train one; None when not measured here.
    Reading a metric is a collective (an all-reduce), so every rank reads the same ones in the same order.
    """
    st = trainer.state
    metrics = trainer.states.get("metrics", {})
    out: Dict[str, Optional[float]] = {}
    if st.batch_idx == 0 and st.step > 0:
        for name, metric in metrics.get("train", {}).items():
            out[f"train/{name}"] = _metric_value(metric)
    if st.last_eval_step is not None and st.last_eval_step == st.step:
        for name, metric in metrics.get("test", {}).items():
            out[f"test/{name}"] = _metric_value(metric)
    if watch is not None and watch not in out:
        if "/" in watch:
            out[watch] = None
        else:
            phase = "test" if (st.will_test and watch in metrics.get("test", {})) else "train"
            out[watch] = out.get(f"{phase}/{watch}")
    return out


def trainer_checkpoint_state(trainer, train_loader=None) -> Tuple[Dict[str, Any], Dict[str, Any], Optional[dict]]:
    """``(shared_state, rank_state, sharded_state)`` of the run now; hooks add entries via ``on_save_checkpoint``.

    Every rank calls it (the engine's state dict may gather shards).
    """
    from .._version import __version__

    rank_state: Dict[str, Any] = {"rng": capture_rng_state(), "data": _loader_state(train_loader), "hooks": {},
                                  "metrics": trainer.metric_partial_states()}
    engine = trainer.engine
    sharded = engine.sharded_state_dict() if engine.shards_state else None
    shared: Dict[str, Any] = {
        "engine": engine.state_dict_without_shards() if sharded is not None else engine.state_dict(),
        "lr_schedulers": {key: hook.lr_scheduler.state_dict() for key, hook in _scheduler_hooks(trainer)},
        "trainer": trainer.state_dict(),
        "hooks": {},
        "colossal_lite": {"version": __version__, "world_size": _world(), "format": TRAINER_FORMAT},
    }
    checkpoint = dict(shared, rank_state=rank_state)
    trainer.fire("on_save_checkpoint", checkpoint)
    checkpoint.pop("rank_state", None)
    return checkpoint, rank_state, sharded


def save_trainer_checkpoint(trainer, manager: CheckpointManager, train_loader=None,
                            metrics: Optional[Dict[str, Any]] = None) -> Path:
    """Write the run's checkpoint with ``manager``, named ``epoch{E}-step{S}``; returns its folder. Every rank calls it.

    Take it at a safe point (an optimizer step boundary in a hook's ``after_train_iter``, or what
    ``SaveCheckpointHook`` does); inside an accumulation window the gathered gradients are saved too.
    """
    if train_loader is None and getattr(trainer, "_checkpoints", None) is not None:
        train_loader = trainer._checkpoints.train_loader
    shared, rank_state, sharded = trainer_checkpoint_state(trainer, train_loader)
    st = trainer.state
    return manager.save(checkpoint_name(_name_epoch(trainer), st.step), shared, rank_state, metrics or {},
                        sharded_state=sharded)


# -- restoring ---------------------------------------------------------------------------------
def _load_weights_only(trainer, path: Path, shared: Dict[str, Any], strict: bool) -> None:
    engine = trainer.engine
    if has_sharded_state(path) and "model" not in (shared.get("engine") or {}):
        if not engine.shards_state:
            raise CheckpointError(f"checkpoint {path} holds its model as zero stage 2/3 shards; load it with zero "
                                  f"stage 2/3, or write one file first: colossal-lite ckpt merge {path} merged.pt")
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        state = {"model": engine.sharded_state_dict()["model"]}
        load_sharded(path, state)
        set_model_state_dict(engine.model, state["model"], options=StateDictOptions(strict=strict))
        return
    weights = model_state_from(shared)
    if not strict:
        own = set(engine.unwrapped_model.state_dict()) if not engine.shards_state else None
        if own is not None:
            plain = {k[len("module."):] if k.startswith("module.") else k for k in weights}
            missing, unexpected = sorted(own - plain), sorted(plain - own)
            if missing or unexpected:
                log_rank_0(trainer._logger, f"finetune from {path}: missing keys {missing}, unexpected keys "
                                            f"{unexpected} (left as they are; strict=False)")
    engine.strategy.load_model_state_dict(engine.model, weights, strict=strict)


def load_trainer_checkpoint(trainer, manager: CheckpointManager, which: Union[str, PathLike] = "last",
                            train_loader=None, finetune: bool = False, strict: bool = True) -> Optional[Path]:
    """Restore the run from the checkpoint ``which`` names (see ``CheckpointManager.resolve``); every rank calls it.

    ``which`` may name a checkpoint folder or a file ``ckpt merge`` wrote. ``which='auto'`` with nothing
    to resume returns None (a fresh start), and skips damaged checkpoints with a warning
    (``CheckpointManager.read``). See ``restore_trainer_checkpoint`` for what is restored.
    """
    found = manager.read(which)
    if found is None:
        return None
    path, shared, rank_state = found
    return restore_trainer_checkpoint(trainer, path, shared, rank_state, train_loader, finetune, strict)


def restore_trainer_checkpoint(trainer, path: Path, shared: Dict[str, Any], rank_state: Optional[Dict[str, Any]],
                               train_loader=None, finetune: bool = False, strict: bool = True) -> Path:
    """Restore the run from a checkpoint already read (``read_checkpoint``); every rank calls it. Returns ``path``.

    Restores the engine (model, optimizer, loss scaler, accumulation window), the schedulers of the
    ``LRSchedulerHook`` s, the progress and hook states, fires ``on_load_checkpoint``, then the data
    position and the random state. ``finetune=True``: the model weights only, progress from 0.
    Call it with the hooks attached.
    """
    if train_loader is None and getattr(trainer, "_checkpoints", None) is not None:
        train_loader = trainer._checkpoints.train_loader
    st = trainer.state
    if finetune:
        _load_weights_only(trainer, path, shared, strict)
        st.load_state_dict({"epoch": 0, "step": 0, "iteration": 0, "batch_idx": 0})
        trainer._step_from_epoch = False
        return path
    _restore_engine(trainer.engine, path, shared, strict)

    saved_schedulers = shared.get("lr_schedulers") or {}
    for key, hook in _scheduler_hooks(trainer):
        if key in saved_schedulers:
            hook.lr_scheduler.load_state_dict(saved_schedulers[key])
        else:
            warnings.warn(f"checkpoint {path} has no state for {key}'s scheduler (it has {sorted(saved_schedulers)}); "
                          f"it starts from its current state", stacklevel=2)

    saved_trainer = shared.get("trainer") or {}
    st.load_state_dict(saved_trainer.get("progress", {}))
    _warn_short_schedules(trainer, path)
    trainer._step_from_epoch = False
    trainer._pending_hook_states = None
    trainer._load_hook_states(saved_trainer.get("hooks", {}))

    checkpoint = dict(shared, rank_state=rank_state if rank_state is not None else {})
    trainer.fire("on_load_checkpoint", checkpoint)
    _restore_rank_state(trainer, path, shared, rank_state, train_loader)
    return path


def _restore_engine(engine, path: Path, shared: Dict[str, Any], strict: bool) -> None:
    """Model, optimizer, loss scaler, accumulation window: from the shards with ZeRO 2/3, else from ``shared``."""
    engine_state = shared.get("engine")
    if not isinstance(engine_state, dict):
        raise CheckpointError(f"checkpoint {path} holds no trainer state (no 'engine' entry; top-level keys "
                              f"{sorted(map(str, shared))}); a weights-only file loads with finetune=True or "
                              f"colossal_lite.utils.load_checkpoint")
    if has_sharded_state(path) and "model" not in engine_state:
        if not engine.shards_state:
            raise CheckpointError(f"checkpoint {path} holds model and optimizer as zero stage 2/3 shards; resume it "
                                  f"with zero stage 2/3, or write one file first: colossal-lite ckpt merge {path} "
                                  f"merged.pt")
        state = engine.sharded_state_dict()
        load_sharded(path, state)
        engine.load_sharded_state_dict(state)
    elif "optimizer" in engine_state:  # whole tensors, by name (merged from shards) or by position (unsharded)
        engine_state = dict(engine_state, optimizer=_optimizer_state_for(engine, engine_state["optimizer"]))
    engine.load_state_dict(engine_state, strict=strict)


def _optimizer_state_for(engine, optimizer_state):
    """The checkpoint's full optimizer state in the layout this engine's optimizer loads: by parameter name
    over sharded parameters (ZeRO 2/3), by position otherwise (torch's own layout, ZeroRedundancyOptimizer's)."""
    if not engine.shards_state:
        return optimizer_state_by_position(optimizer_state)
    if keyed_by_name(optimizer_state):
        return optimizer_state
    return optimizer_state_by_name(optimizer_state, parameter_names(engine.unwrapped_model, engine.optimizer))


def _restore_rank_state(trainer, path: Path, shared: Dict[str, Any], rank_state: Optional[Dict[str, Any]],
                        train_loader) -> None:
    """This rank's data position and train metric sums (with the world size that wrote them), then its random state."""
    if rank_state is None:
        return
    st = trainer.state
    saved_world = (shared.get("colossal_lite") or {}).get("world_size")
    same_world = saved_world in (None, _world())  # this rank's data position and sums are its own
    data = rank_state.get("data")
    load = getattr(train_loader, "load_state_dict", None)
    if data is not None and callable(load) and same_world:
        load(data)  # the sampler starts after the samples already seen; nothing is loaded to skip them
    if same_world:  # this rank's sums of the epoch so far (used when it resumes inside one)
        trainer._pending_metric_states = rank_state.get("metrics") or None
    elif rank_state.get("metrics") and st.batch_idx:
        warnings.warn(f"checkpoint {path} was written by {saved_world} ranks and this run has {_world()}: the "
                      f"train metrics of the resumed epoch ({', '.join(sorted(rank_state['metrics']))}) count only "
                      f"its batches from batch {st.batch_idx} on", stacklevel=3)
    if rank_state.get("rng") is not None:
        restore_rng_state(rank_state["rng"])


def _unwrapped(scheduler):
    """The scheduler inside wrappers such as the engine's (which steps it only after real updates)."""
    while not isinstance(scheduler, lr_scheduler.LRScheduler) and getattr(scheduler, "lr_scheduler", None) is not None:
        scheduler = scheduler.lr_scheduler
    return scheduler


def schedule_length(scheduler) -> Optional[int]:
    """Scheduler steps after which ``scheduler``'s schedule has run its course, or None when it has no end.

    Past its end a cosine climbs back up, a decay stays at its final LR and OneCycleLR refuses to step.
    Step, exponential, multi-step, lambda and warm-up-only (rising ``LinearLR``) schedules have no end.
    """
    scheduler = _unwrapped(scheduler)
    if isinstance(scheduler, _TwoStageScheduler):  # warm-up / delay, then the inner schedule
        inner = schedule_length(scheduler.after_scheduler)
        return None if inner is None else scheduler.warmup_epochs + scheduler.delay_epochs + inner
    if isinstance(scheduler, (LinearWarmupLR, PolynomialLR)):
        return scheduler.total_steps
    if isinstance(scheduler, lr_scheduler.CosineAnnealingLR):
        return scheduler.T_max
    if isinstance(scheduler, lr_scheduler.OneCycleLR):
        return scheduler.total_steps
    if isinstance(scheduler, lr_scheduler.PolynomialLR):
        return scheduler.total_iters
    if isinstance(scheduler, lr_scheduler.LinearLR) and scheduler.end_factor < scheduler.start_factor:
        return scheduler.total_iters
    if isinstance(scheduler, lr_scheduler.SequentialLR):
        last = schedule_length(scheduler._schedulers[-1])
        return None if last is None else scheduler._milestones[-1] + last
    return None


def _warn_short_schedules(trainer, path: Path) -> None:
    """Warn (rank 0) for each restored scheduler whose schedule ends before the run ``fit`` was asked for."""
    st = trainer.state
    if not st.fitting or not st.total_steps or gpc.get_global_rank() != 0:
        return
    for key, hook in _scheduler_hooks(trainer):
        length = schedule_length(hook.lr_scheduler)
        if length is None:
            continue
        unit = "epochs" if hook.by_epoch else "optimizer steps"
        run_left = st.max_epochs - st.epoch if hook.by_epoch else st.total_steps - st.step
        schedule_left = length - int(getattr(hook.lr_scheduler, "last_epoch", 0))
        if schedule_left >= run_left:
            continue
        warnings.warn(
            f"{key}: the {type(_unwrapped(hook.lr_scheduler)).__name__} restored from {path} was built for the run "
            f"that wrote it: it is {length} {unit} long and has {max(schedule_left, 0)} left, but this fit runs "
            f"{run_left} more {unit}. Past its end the learning rate no longer follows a schedule (a cosine climbs "
            f"back up, a decay stays at its last value). To extend a finished run, load only the engine state (model "
            f"and optimizer) and build a scheduler for the {unit} still to run: see 'Extending a finished run' in "
            f"docs/checkpoints.md", stacklevel=2)


# -- test mode ---------------------------------------------------------------------------------
def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # NaN
    return a == b


def checkpoint_round_trip(trainer, train_loader=None) -> str:
    """Save the run to a temporary folder, read it back, compare; the folder is removed. Every rank calls it.

    Returns a few words for ``fit(test_mode=True)``'s verdict; ``'checkpoint round trip FAILED (...)'`` on a
    mismatch or an error. The run itself is not changed (nothing is loaded back into it).
    """
    start = time.perf_counter()
    folder = tempfile.mkdtemp(prefix="colossal_lite-test-mode-") if gpc.get_global_rank() == 0 else None
    folder = Path(_broadcast(folder))
    ok, why, size = True, "", 0
    try:
        manager = CheckpointManager(folder, cleanup=False)
        shared, rank_state, sharded = trainer_checkpoint_state(trainer, train_loader)
        st = trainer.state
        path = manager.save(checkpoint_name(_name_epoch(trainer), st.step), shared, rank_state, {},
                            sharded_state=sharded, config=None)
        loaded_shared, loaded_rank = manager.load(path)
        if gpc.get_global_rank() == 0:
            size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
            if not _same(to_plain(shared), loaded_shared):
                ok, why = False, "the state read back differs from the state written"
            elif "model" in shared["engine"] and set(shared["engine"]["model"]) != set(
                    trainer.engine.unwrapped_model.state_dict()):
                ok, why = False, "the saved model keys do not match the model"
        if ok and not _same(to_plain(rank_state), loaded_rank):
            ok, why = False, f"rank {gpc.get_global_rank()}'s state read back differs"
    except Exception as e:  # noqa: BLE001 - reported in the verdict
        ok, why = False, f"{type(e).__name__}: {e}"
    finally:
        if _world() > 1:
            dist.barrier()
        if gpc.get_global_rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)
    ok = _all_ok(ok, trainer.engine.device if dist.is_initialized() and dist.get_backend() != "gloo" else "cpu")
    if not ok:
        return f"checkpoint round trip FAILED ({why or 'on another rank'})"
    took = time.perf_counter() - start
    return f"checkpoint round trip OK ({format_bytes(size)}, {took:.2f} s)" if size else \
        f"checkpoint round trip OK ({took:.2f} s)"


# -- one fit call ------------------------------------------------------------------------------
class CheckpointSession:
    """Checkpoints during one ``fit``: resume, saves at safe points, preemption by SIGTERM/SIGINT.

    ``saving`` is False in test mode (nothing is written to the run's folders). With several ranks the
    stop flag is agreed with one all-reduce at a step boundary; the checks are spaced so that they
    happen about every ``check_s`` seconds (at every step when steps are slower), counted in steps
    agreed by all ranks, so every rank stops after the same step.
    """

    check_s = 1.0  # seconds between two agreements of the stop flag with several ranks
    max_check_every = 1000  # optimizer steps

    def __init__(self, trainer, train_loader, saving: bool = True):
        from .hooks._checkpoint_hook import SaveCheckpointHook

        self.trainer = trainer
        self.train_loader = train_loader
        self.saving = saving
        self.save_hooks = [h for h in trainer.hooks if isinstance(h, SaveCheckpointHook)]
        self.active = saving and bool(self.save_hooks)
        self.world = _world()
        self.preempted: Optional[int] = None
        self.checkpoint: Optional[Path] = None
        self._received: Optional[int] = None
        self._previous: Dict[int, Any] = {}
        self._since = 0  # step boundaries since the last agreement
        self._every = 1  # step boundaries between two agreements
        self._last_check = time.perf_counter()
        device = trainer.engine.device
        self._device = device if dist.is_initialized() and dist.get_backend() != "gloo" else torch.device("cpu")

    # -- resume -------------------------------------------------------------------------------
    def resume(self, resume_from) -> Optional[Path]:
        """Restore from ``resume_from`` (None, 'auto', 'last', 'best', 'latest' or a path); None: fresh start."""
        if resume_from is None:
            return None
        trainer = self.trainer
        if isinstance(resume_from, str) and resume_from in ("auto", "last", "best", "latest"):
            if not self.save_hooks:
                raise ValueError(f"fit(resume_from={resume_from!r}) looks for checkpoints in the checkpoint_dir of a "
                                 f"SaveCheckpointHook, and hooks has none: add SaveCheckpointHook(checkpoint_dir=...) "
                                 f"to hooks, or pass the checkpoint's path (resume_from='runs/ck/epoch3-step120')")
            manager = self.save_hooks[0].manager
        elif isinstance(resume_from, (str, os.PathLike)):
            manager = CheckpointManager(Path(resume_from), cleanup=False)
        else:
            raise TypeError(f"fit(resume_from={resume_from!r}): use None, 'auto', 'last', 'best' or a checkpoint path")
        path = load_trainer_checkpoint(trainer, manager, resume_from, self.train_loader)
        st = trainer.state
        if path is None:
            log_rank_0(trainer._logger, f"resume_from='auto': no checkpoint in {manager.checkpoint_dir} yet, "
                                        f"training starts from the beginning")
            return None
        self.restored(path)
        log_rank_0(trainer._logger, f"resumed from {path}: epoch {st.epoch}, step {st.step}, "
                                    f"batch {st.batch_idx} of the epoch")
        return path

    def nothing_to_do(self) -> bool:
        """True (and a log line on rank 0) when the run already stands at the end this ``fit`` was asked for."""
        st = self.trainer.state
        by_steps = st.max_steps is not None and st.step >= st.max_steps
        if st.epoch < st.max_epochs and not by_steps:
            return False
        if by_steps:
            message = (f"already trained to step {st.step} (epoch {st.epoch}, batch {st.batch_idx}), nothing to do: "
                       f"this fit ends at max_steps={st.max_steps}; pass a larger max_steps to train further")
        else:
            message = (f"already trained to epoch {st.epoch}, nothing to do (step {st.step}; this fit ends at "
                       f"epochs={st.max_epochs}); pass more epochs to train further")
        log_rank_0(self.trainer._logger, message)
        return True

    def restored(self, path: Path) -> None:
        """The run now stands where ``path`` was taken: a save at this position would only repeat it."""
        here = position(self.trainer)
        for hook in self.save_hooks:
            hook._last_position, hook.last_path = here, path

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
            os.write(2, f"{_signal_name(signum)} received: finishing the current optimizer step, then writing a "
                        f"checkpoint{again}\n".encode())

    def close(self) -> None:
        """Put back the signal handlers that were there before ``fit``."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    # -- safe points --------------------------------------------------------------------------
    def _save_due(self) -> None:
        for hook in self.save_hooks:
            if hook._due:
                hook._due = False
                hook.save(self.trainer)

    def at_step_boundary(self) -> bool:
        """After an optimizer step (and its evaluation): interval saves; True when the run must stop (preempted)."""
        st = self.trainer.state
        if st.batch_idx >= st.iters_per_epoch:
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
            dist.all_reduce(buf, op=dist.ReduceOp.MAX)
            flag, elapsed = buf.tolist()
            per_step = elapsed / max(self._since, 1)
            self._every = max(1, min(self.max_check_every, int(self.check_s / max(per_step, 1e-6))))
            self._since, self._last_check = 0, time.perf_counter()
            signum = int(flag)
        if not signum:
            return False
        self._stop(signum)
        return True

    def _stop(self, signum: int) -> None:
        trainer = self.trainer
        self.preempted = signum
        self.checkpoint = self.save_hooks[0].save(trainer)
        st = trainer.state
        log_rank_0(trainer._logger, f"{_signal_name(signum)}: stopped at epoch {st.epoch}, step {st.step} (batch "
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
            raise TrainingPreempted(self.preempted, self.checkpoint, hard_exit=self.world > 1)
