"""``ProfilerHook``: ``torch.profiler`` over chosen optimizer steps of ``fit``, one trace file per rank and cycle.

The file ``torch.profiler.export_chrome_trace`` writes is at once a Chrome trace (chrome://tracing, Perfetto) and
the ``*.pt.trace.json`` file TensorBoard's PyTorch profiler plugin reads, so each trace is written once, under a
name that carries the rank and the steps it covers. ``docs/profiling.md`` describes the layout.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, List, Optional, Tuple

from torch.profiler import ProfilerActivity, profile, schedule

from ...core.dist import rank as this_rank
from ...core.dist import world_size
from ...logging import DistributedLogger, get_dist_logger
from ._base_hook import BaseHook

__all__ = ["ProfilerHook"]

_EVENTS = ("before_train", "after_train_iter", "after_train")
SUMMARY_ROWS = 10  # operators in the summary table


def _steps(name: str, value, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"ProfilerHook({name}={value!r}) must be a whole number of optimizer steps >= {least}")
    return value


def _checked_ranks(ranks) -> Optional[Tuple[int, ...]]:
    if ranks is None:
        return None
    if isinstance(ranks, int) and not isinstance(ranks, bool):
        ranks = (ranks,)
    try:
        ranks = tuple(ranks)
    except TypeError:
        raise ValueError(f"ProfilerHook(ranks={ranks!r}) must be a list of global ranks, e.g. ranks=(0,), "
                         f"or None for every rank") from None
    if not ranks or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ranks):
        raise ValueError(f"ProfilerHook(ranks={ranks!r}) must name at least one global rank (whole numbers >= 0), "
                         f"or be None for every rank")
    return tuple(sorted(set(ranks)))


def _checked_dir(folder) -> Path:
    if folder is None:
        raise ValueError("ProfilerHook(dir=None): give the folder the traces are written to, e.g. dir='runs/profile'")
    if not isinstance(folder, (str, os.PathLike)) or not str(folder):
        raise ValueError(f"ProfilerHook(dir={folder!r}) must be a folder path (a str or a pathlib.Path)")
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise ValueError(f"ProfilerHook(dir={folder!r}) is a file; give a folder for the traces")
    return path


class ProfilerHook(BaseHook):
    """Runs ``torch.profiler`` during ``fit`` and writes a trace of each active cycle: per profiled rank,
    ``dir/rank{R}.steps{A}-{B}.pt.trace.json``, a Chrome trace that TensorBoard's profiler plugin also reads.

    The schedule counts optimizer steps (a gradient-accumulation window is one step) of this ``fit``, a resumed
    one included: ``skip_first`` steps, then ``wait`` steps, ``warmup`` steps (profiled, not kept: the first
    steps carry the profiler's own start-up cost) and ``active`` recorded steps; that cycle runs ``repeat`` times
    (0: until the fit ends). In the trace, ``ProfilerStep#N`` marks the trainer's optimizer step N
    (``trainer.cur_step`` once it is done), counted over the whole training as the file names are.

    Activities: CPU, and CUDA when the engine's device is a GPU. ``record_shapes``, ``profile_memory`` and
    ``with_stack`` are ``torch.profiler.profile``'s options. ``ranks``: the global ranks that profile (None:
    every rank). ``print_summary``: log the ``key_averages`` table (the costliest operators) of each cycle.
    Lines are logged by the lowest profiled rank through ``logger`` (else the Trainer's, else the library's).

    A fit that ends inside an active cycle writes what was recorded (the name says which steps); one that ends
    before it writes nothing and says so. The profiler stops at ``after_train``, or, in a fit that raises, as
    its hooks are detached (what an active cycle recorded is written then).
    """

    reads_train_output = False  # (BaseHook.reads_train_output)

    def __init__(self, wait: int = 1, warmup: int = 1, active: int = 3, dir=None, *, skip_first: int = 0,
                 repeat: int = 1, ranks: Optional[Iterable[int]] = (0,), record_shapes: bool = False,
                 profile_memory: bool = False, with_stack: bool = False, print_summary: bool = False,
                 logger=None, priority: int = 100):
        super().__init__(priority)
        self.wait, self.warmup = _steps("wait", wait, 0), _steps("warmup", warmup, 0)
        self.active, self.skip_first = _steps("active", active, 1), _steps("skip_first", skip_first, 0)
        self.repeat = _steps("repeat", repeat, 0)
        self.dir = _checked_dir(dir)
        self.ranks = _checked_ranks(ranks)
        self.options = dict(record_shapes=bool(record_shapes), profile_memory=bool(profile_memory),
                            with_stack=bool(with_stack))
        self.print_summary = bool(print_summary)
        self._given_logger, self._logger = logger, logger
        #: The trace files this rank wrote, over every fit of this hook.
        self.trace_files: List[Path] = []
        self._prof: Optional[profile] = None  # the running profiler
        self._start_step = self._last_step = 0  # trainer steps when this fit began / at its last optimizer step
        self._written = 0  # traces written in this fit
        self._sort_by = "self_cpu_time_total"

    # -- which ranks -------------------------------------------------------------------------------
    @property
    def skipped_events(self) -> tuple:
        return () if self.ranks is None or this_rank() in self.ranks else _EVENTS

    @property
    def _cycle(self) -> int:
        return self.wait + self.warmup + self.active

    def _reports_here(self) -> bool:
        return this_rank() == (0 if self.ranks is None else self.ranks[0])

    def after_hook_is_attached(self, trainer) -> None:
        world = world_size()
        if self.ranks is not None and self.ranks[-1] >= world:
            raise ValueError(f"ProfilerHook(ranks={self.ranks}) names rank {self.ranks[-1]}, but this run has "
                             f"{world} rank(s) (0..{world - 1}); use ranks=None for every rank")
        self._logger = next((lg for lg in (self._given_logger, trainer.logger) if lg is not None), None)

    # -- the profiler over this fit -----------------------------------------------------------------
    def before_train(self, trainer) -> None:
        self.close()  # a profiler a raising fit left running
        start = trainer.state.step
        self._start_step = self._last_step = start
        self._written = 0
        cuda = trainer.engine.device.type == "cuda"
        self._sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
        self.dir.mkdir(parents=True, exist_ok=True)
        cycles = schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=self.repeat,
                          skip_first=self.skip_first)
        prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                       schedule=lambda n: cycles(max(n - start - 1, 0)), on_trace_ready=self._write,
                       **self.options)
        # The profiler numbers its steps from step_num on; starting it at this fit's first step makes its
        # ProfilerStep#N marks the trainer's step numbers, which a resumed fit continues.
        prof.step_num = start + 1
        prof.start()
        self._prof = prof

    def after_train_iter(self, trainer, *args) -> None:
        st = trainer.state
        if self._prof is None or not st.stepped:
            return
        self._last_step = st.step
        done = self.repeat and st.step - self._start_step >= self.skip_first + self.repeat * self._cycle
        if done or (st.total_steps is not None and st.step >= st.total_steps):
            self.close()  # the last cycle or the last step: nothing more to record
        else:
            self._prof.step()

    def after_train(self, trainer) -> None:
        self.close()

    def after_hook_is_detached(self, trainer) -> None:
        self.close()  # (a fit that raised did not reach after_train)

    def close(self) -> None:
        """Stop the profiler if it is running; an active cycle it was recording is written as far as it got.
        ``fit`` calls it at its end, whether it ended normally or raised."""
        prof, self._prof = self._prof, None
        if prof is None:
            return
        prof.stop()
        if not self._written:
            first = self._start_step + self.skip_first + self.wait + self.warmup + 1
            self._say(f"ProfilerHook: no trace written: this fit ran {self._last_step - self._start_step} optimizer "
                      f"step(s), and the first recorded step would have been step {first} (skip_first={self.skip_first}"
                      f", wait={self.wait}, warmup={self.warmup} steps come first)")

    def __enter__(self) -> "ProfilerHook":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- traces ------------------------------------------------------------------------------------
    def _recorded_steps(self) -> Tuple[int, int]:
        """The trainer steps ``(first, last)`` the cycle being written recorded (last < first: none ran)."""
        last_index = self._last_step - self._start_step - 1  # this fit's last optimizer step, from 0
        cycle = max(last_index - self.skip_first, 0) // self._cycle
        first = self._start_step + self.skip_first + cycle * self._cycle + self.wait + self.warmup + 1
        return first, self._last_step

    def _write(self, prof: profile) -> None:
        """``on_trace_ready``: write the cycle's trace (called by ``prof.step()`` or when the profiler stops)."""
        first, last = self._recorded_steps()
        if last < first:  # the fit ended as the cycle's recording began
            return
        path = self.dir / f"rank{this_rank()}.steps{first}-{last}.pt.trace.json"
        prof.export_chrome_trace(str(path))
        self.trace_files.append(path)
        self._written += 1
        planned = first + self.active - 1
        steps = f"steps {first}-{last}" if last == planned else \
            f"steps {first}-{last} (the fit ended inside the profiled steps {first}-{planned})"
        others = "" if self.ranks is not None and len(self.ranks) == 1 else \
            f"; every profiled rank writes its rank<R>.steps{first}-{last}.pt.trace.json there"
        self._say(f"ProfilerHook: trace of {steps} written to {path}{others}")
        if self.print_summary and self._reports_here():
            table = prof.key_averages().table(sort_by=self._sort_by, row_limit=SUMMARY_ROWS)
            self._say(f"ProfilerHook: the costliest operators of steps {first}-{last}:\n{table}")

    def _say(self, message: str) -> None:
        if not self._reports_here():
            return
        logger = self._logger if self._logger is not None else get_dist_logger()
        if isinstance(logger, DistributedLogger):
            logger.info(message, ranks=[this_rank()])
        else:
            logger.info(message)

    def __repr__(self) -> str:
        return (f"ProfilerHook(wait={self.wait}, warmup={self.warmup}, active={self.active}, dir={str(self.dir)!r}, "
                f"skip_first={self.skip_first}, repeat={self.repeat}, ranks={self.ranks}, priority={self.priority})")
