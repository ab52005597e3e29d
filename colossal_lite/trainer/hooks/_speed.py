"""``SpeedReportHook``: throughput, model FLOPs utilisation and where each step's time went, ranked at the end.

Throughput and MFU cost one clock read and a few host operations per optimizer step; the FLOPs are counted
once, on meta tensors. The breakdown (``breakdown=True``, the default) times the phases of a training step on a
sample of the optimizer steps (every one of the first ``breakdown_first`` after the warm-up, then one in
``breakdown_every`` at random): on a sampled step it takes over the run's event points through
``Trainer.instrument``, marks each phase on a clock (``_timeline``: the host's clock on a CPU, CUDA events on a
GPU, read only at the epoch's end and at the end of ``fit``) and times every hook handler as its hook's; the
other steps run the hooks' own handlers untouched, their time measured as a whole and shared out over the phases
in the proportions the sampled steps measured.
"""
from __future__ import annotations

import os
import random
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ...core.dist import all_reduce_sum_, log_rank_0, world_size
from ...engine import batch as _batch_module
from ...engine.batch import call_criterion, call_with
from ...logging import get_dist_logger
from ...utils.flops import StepFlops, compute_kind, count_step_flops, peak_flops
from .._timeline import Timeline, make_clock
from ..speed_report import HOOK_PREFIX, OWN_PARTS, PHASES, TAIL, UNPINNED_BATCH_SITE, SpeedFigures, format_report
from ._metric_hook import Metric, MetricHook, samples_in
from ._utils import device_of

__all__ = ["SpeedReportHook"]

#: The phase a training run is in after each point of a sampled step (a handler's own time is its hook's).
PHASE_AFTER = {
    "before_train_epoch": "loop", "after_train_epoch": "loop", "before_train_iter": "data", "before_load": "h2d",
    "after_batch_loaded": "forward", "before_backward": "backward", "after_backward": "optimizer",
    "before_optimizer_step": "optimizer", "after_optimizer_step": "loop", "on_save_checkpoint": "checkpoint",
}
#: The points the breakdown takes over on a sampled step (``after_train_iter`` is the hook's on every step).
SPAN_POINTS = ("before_train_epoch", "after_train_epoch", "before_train_iter", "before_zero_grad", "before_load",
               "after_batch_loaded", "before_forward", "after_forward", "after_loss", "before_backward",
               "after_backward", "after_grad_norm", "before_optimizer_step", "after_optimizer_step",
               "on_save_checkpoint")
#: The timeline's key for the steps that were not sampled: their time is shared out over the phases.
UNSAMPLED = "unsampled"
#: Timeline keys that take no share of the unsampled time: evaluation (timed apart, always) and the report's own
#: one-time work (the FLOP count).
_NOT_SHARED = (UNSAMPLED, "evaluation", "report")


class _Figure(Metric):
    """One figure of the report as a metric: ``step()`` the last optimizer step's value (None: none),
    ``epoch()`` the epoch's (every rank calls it). ``in_log_line`` False keeps it out of the epoch log line."""

    def __init__(self, step: Callable[[], Any], epoch: Callable[[], Optional[float]], epoch_only: bool,
                 device, in_log_line: bool = True, percent: bool = False):
        super().__init__(epoch_only, device)
        self._step, self._epoch = step, epoch
        self.in_log_line, self.percent = in_log_line, percent

    def update(self, *args, **kwargs) -> None:
        self._cached = None

    def last_step_value(self):
        return self._step()

    def _compute_accumulated(self) -> float:
        value = self._epoch()
        return float("nan") if value is None else float(value)

    def get_accumulated_info(self) -> str:
        value = self.get_accumulated_value()
        if value != value:  # (NaN: no step of the epoch was measured, e.g. only the warm-up ran)
            return "n/a"
        return f"{100 * value:.3g}%" if self.percent else f"{value:.5g}"

    @staticmethod
    def is_better(a, b) -> bool:
        return a > b


def _hook_key(fn: Callable) -> str:
    return _hook_phase(getattr(fn, "__self__", fn))


def _hook_phase(hook) -> str:
    """``'hook:<class name>'``; a hook of the user's whose class has the name of a part the Trainer adds itself
    (``OWN_PARTS``) is named with its module, so that its time is neither added to that part's nor reported as it."""
    kind = type(hook)
    ours = kind.__module__.split(".")[0] == __name__.split(".")[0]
    return HOOK_PREFIX + (kind.__name__ if ours or kind.__name__ not in OWN_PARTS else f"{kind.__module__}.{kind.__name__}")


def _unit_phase(trainer) -> Optional[str]:
    """The one phase a training step runs as after its batch is loaded, when it fires no event inside to split it
    by: ``'step'`` for a step function of the user's (``fit(step=...)``), ``'auto'`` for forward, loss and backward
    run as one retriable unit (``gradient_accumulation='auto'``); None when the events split it."""
    if trainer.user_step is not None:
        return "step"
    return "auto" if trainer.engine.auto_batcher is not None else None


def shared_out(seconds: Dict[str, float], basis: Dict[str, float]) -> Dict[str, float]:
    """``seconds`` (by timeline key) with the unsampled steps' time given to the phases in the proportions of
    ``basis`` (the sampled steps' seconds by key; ``_NOT_SHARED`` keys take no share)."""
    out = dict(seconds)
    unsampled = out.pop(UNSAMPLED, 0.0)
    weights = {key: value for key, value in basis.items() if key not in _NOT_SHARED and value > 0}
    total = sum(weights.values())
    if not total:
        weights, total = {"loop": 1.0}, 1.0
    for key, value in weights.items():
        out[key] = out.get(key, 0.0) + unsampled * value / total
    return out


def sync_site(filename: str, lineno: int) -> str:
    """How the report names the Python line of a host sync: ``file.py:line``, or what the library's own batch copy
    waits for (a batch in memory that is not pinned)."""
    site = f"{os.path.basename(filename)}:{lineno}"
    if os.path.abspath(filename) == os.path.abspath(_batch_module.__file__):
        return f"{UNPINNED_BATCH_SITE} ({site})"
    return site


class SyncWatch:
    """The warnings of a few steps, caught to find torch's sync debug mode's: ``stop`` counts those by Python line
    and shows every other warning again, once each, under the filters then in force (catching them all is the
    only way to see the syncs, and a user's own warnings, torch's, or a checkpoint writer's must not be lost)."""

    def __init__(self):
        self._catcher = warnings.catch_warnings(record=True)
        self._caught = self._catcher.__enter__()
        warnings.simplefilter("always")

    def stop(self) -> Dict[str, int]:
        """The syncs seen, by site (``sync_site``)."""
        self._catcher.__exit__(None, None, None)
        counts: Dict[str, int] = {}
        others: Dict[tuple, Any] = {}
        for caught in self._caught:
            if "synchroniz" in str(caught.message):
                site = sync_site(caught.filename, caught.lineno)
                counts[site] = counts.get(site, 0) + 1
            else:
                others.setdefault((str(caught.message), caught.category, caught.filename, caught.lineno), caught)
        for caught in others.values():
            warnings.warn_explicit(caught.message, caught.category, caught.filename, caught.lineno, source=caught.source)
        return counts


class _Breakdown:
    """The phase timing of one fit: which optimizer steps are sampled, and the functions that mark a sampled
    step's phases and time its hooks' handlers, put in place through ``Trainer.instrument`` for those steps.

    ``hook`` is the ``SpeedReportHook`` (its own handlers run first at each point, untimed); ``lean`` gives the
    functions of a step that is not sampled."""

    def __init__(self, hook, trainer, lean: Callable, every: int, first: int, warmup: int):
        self.hook, self.trainer, self.lean = hook, trainer, lean
        self.timeline = Timeline(make_clock(device_of(trainer)))
        self.world = world_size()
        self.every, self.first_until = every, warmup + first
        self.rng = random.Random(0)  # (the same steps on every rank, and the global RNGs untouched)
        self.sampling = False  # the step running now is sampled
        self.next_sampled = warmup  # the next step is sampled when the steps seen reach this
        self.tables: Dict[str, Tuple[Callable, ...]] = {}
        self.iter_pairs: Tuple[Tuple[str, Callable], ...] = ()  # after_train_iter's other handlers, keyed
        self.grads_done: Any = None
        self._handles: List[Any] = []

    # -- which steps ----------------------------------------------------------------------------------------
    def step_ended(self, steps_seen: int) -> bool:
        """``steps_seen`` optimizer steps ended (the warm-up's included): sample the next one or not; -> whether
        the step that ended was sampled."""
        was_sampled = self.sampling
        sample = steps_seen >= self.next_sampled
        if sample:
            gap = 1 if steps_seen < self.first_until or self.every == 1 else self.rng.randint(1, 2 * self.every - 1)
            self.next_sampled = steps_seen + gap
        if sample != self.sampling:
            self._switch(sample)
        return was_sampled

    def _switch(self, sample: bool) -> None:
        """Put the sampled step's functions in place (or the lean ones back) at every point it takes over."""
        self.sampling = sample
        self.timeline.switch("loop" if sample else UNSAMPLED)
        self.trainer.instrument(self._timed if sample else self.lean, SPAN_POINTS, owner=self.hook)
        if self.world > 1:
            self._watch_gradients(sample)

    def stop(self) -> None:
        """The fit ends: the gradient hooks removed (the Trainer builds its handlers afresh at each attach)."""
        self.sampling = False
        self._watch_gradients(False)

    # -- a sampled step's functions ---------------------------------------------------------------------------
    def _timed(self, point: str, handlers: Tuple[Callable, ...]) -> Tuple[Callable, ...]:
        """The functions of ``point`` on a sampled step (built once per fit)."""
        table = self.tables.get(point)
        if table is None:
            table = self.tables[point] = self._build(point, handlers)
        return table

    def _build(self, point: str, handlers: Tuple[Callable, ...]) -> Tuple[Callable, ...]:
        """One function for ``point``: the handlers in their priority order, the other hooks' each timed as its
        hook's (this hook's own in the phase that was running), then the phase that follows the point (none: the
        phase that ran before it goes on)."""
        timeline, hook = self.timeline, self.hook
        if point == "before_load":
            return (lambda: timeline.switch("h2d"),)
        calls = tuple((None if getattr(fn, "__self__", None) is hook else _hook_key(fn), fn) for fn in handlers)
        if point == "after_backward":  # (the tokens, and where exposed communication starts: first)
            calls = ((None, hook.sampled_backward),) + tuple(call for call in calls if call[0] is not None)
        after = PHASE_AFTER.get(point)
        if point == "after_batch_loaded":
            after = _unit_phase(self.trainer) or after
        if point == "after_backward" and self.world > 1:  # gradient reduction (and clipping) over the ranks
            after = "communication"
        if after is None and not calls:
            return ()
        switch = timeline.switch

        def dispatch(trainer, *args):
            back = timeline.phase
            for key, fn in calls:
                switch(back if key is None else key)
                fn(trainer, *args)
            switch(back if after is None else after)
        return (dispatch,)

    def set_iter_handlers(self, handlers: Tuple[Callable, ...]) -> None:
        self.iter_pairs = tuple((_hook_key(fn), fn) for fn in handlers)

    def run_iter_handlers(self, trainer, args) -> None:
        """The other hooks' ``after_train_iter`` handlers on a sampled step, each timed as its hook's."""
        switch = self.timeline.switch
        for key, fn in self.iter_pairs:
            switch(key)
            fn(trainer, *args)
        switch("loop")

    def _watch_gradients(self, on: bool) -> None:
        """Mark the time each gradient is accumulated: what the backward waits for after the last one is
        exposed communication (DDP's all-reduce finishing). Only on sampled steps."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if on:
            clock = self.timeline.clock

            def done(param):
                self.grads_done = clock.mark()
            model = self.trainer.engine.unwrapped_model
            self._handles = [p.register_post_accumulate_grad_hook(done) for p in model.parameters() if p.requires_grad]

    def after_backward(self) -> None:
        """On a sampled step: the backward ended when its last gradient was accumulated; from there until now
        the rank waited for communication (the marker then ends that wait)."""
        grads_done, self.grads_done = self.grads_done, None
        if grads_done is not None:
            self.timeline.split(grads_done, "communication")

    # -- the figures -----------------------------------------------------------------------------------------
    def seconds_since(self, since: Dict[str, float]) -> Dict[str, float]:
        """Seconds by timeline key since the totals ``since`` (the open phase is closed here first)."""
        self.timeline.switch(self.timeline.phase)
        totals = self.timeline.settle()
        return {key: value - since.get(key, 0.0) for key, value in totals.items()}


class _Totals:
    """Host sums of a span of the run: samples of this rank, tokens (a device tensor, or None), the steps'
    seconds on the host clock, optimizer steps and micro-batches."""

    def __init__(self):
        self.samples, self.tokens, self.seconds, self.steps, self.micro_batches = 0, None, 0.0, 0, 0
        self.timed_steps = 0  # the steps whose phases were timed
        self.figures: Optional[Dict[str, Any]] = None

    def add(self, other: "_Totals") -> None:
        self.samples += other.samples
        self.timed_steps += other.timed_steps
        self.seconds += other.seconds
        self.steps += other.steps
        self.micro_batches += other.micro_batches
        if other.tokens is not None:
            self.tokens = other.tokens.clone() if self.tokens is None else self.tokens + other.tokens


class SpeedReportHook(MetricHook):
    """Train metrics ``samples_per_s`` (all ranks), ``samples_per_s_per_rank``, ``tokens_per_s`` and
    ``tokens_per_s_per_rank`` (with ``grad_reduction='per-token-mean'``, whose criterion counts the tokens),
    ``mfu`` (model FLOPs utilisation, 0..1) per optimizer step and per epoch; with ``breakdown`` the seconds of
    each phase per epoch (``time/<phase>``, in the metrics file, not the log line), and at the end of ``fit`` a
    ranked table of where the time went with one suggestion per cause (``report``; ``hook.report_text``).

    ``peak_tflops``: the device's peak for MFU (default: the table in ``utils.flops`` for a GPU, a short matrix
    product on a CPU with ``measure_cpu_peak``, measured once per process, else no MFU). ``flops_per_sample``:
    give the model's training FLOPs per sample instead of counting them (None: counted once on meta tensors).
    ``warmup_steps``: the first optimizer steps of the fit, left out of every figure (their one-time costs:
    allocation, autotuning, compilation). ``breakdown_every``: after the first ``breakdown_first`` optimizer
    steps past the warm-up (all timed), the phases are timed on one step in this many, chosen at random (the
    same steps on every rank), and the other steps' time is shared out in the proportions those measured;
    1 times every step.
    """

    #: Optimizer steps after the warm-up whose phases are all timed before the breakdown samples.
    breakdown_first = 16
    #: Optimizer steps after the warm-up during which a GPU run watches for host syncs (torch's sync debug mode).
    sync_check_steps = 3

    def __init__(self, breakdown: bool = True, report: bool = True, peak_tflops: Optional[float] = None,
                 measure_cpu_peak: bool = True, flops_per_sample: Optional[float] = None, warmup_steps: int = 1,
                 breakdown_every: int = 16, logger=None, priority: int = 10):
        super().__init__(priority)
        for name, value, least in (("warmup_steps", warmup_steps, 0), ("breakdown_every", breakdown_every, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                what = ("the optimizer steps to leave out at the start of fit" if least == 0 else
                        "how many optimizer steps share one timed step (1: time every step)")
                raise ValueError(f"SpeedReportHook({name}={value!r}): give {what} as an int >= {least}")
        self.warmup_steps, self.breakdown_every = warmup_steps, breakdown_every
        if peak_tflops is not None and not (isinstance(peak_tflops, (int, float)) and peak_tflops > 0):
            raise ValueError(f"SpeedReportHook(peak_tflops={peak_tflops!r}): give the device's dense peak in "
                             f"TFLOP/s as a positive number (e.g. 989.4 for an H100 SXM in bf16), or None")
        if flops_per_sample is not None and not (isinstance(flops_per_sample, (int, float)) and flops_per_sample > 0):
            raise ValueError(f"SpeedReportHook(flops_per_sample={flops_per_sample!r}): give the training FLOPs of "
                             f"one sample (forward and backward) as a positive number, or None to count them")
        self.breakdown, self.report = bool(breakdown), bool(report)
        self.peak_tflops, self.measure_cpu_peak = peak_tflops, bool(measure_cpu_peak)
        self.flops: Optional[StepFlops] = None
        self.flops_note = ""
        self._given_flops = flops_per_sample
        self.logger = logger
        self.figures: Optional[SpeedFigures] = None
        self.report_text = ""
        self.clock_kind: Optional[str] = None  # the breakdown's clock: 'DeviceClock' (CUDA events) or 'HostClock'
        self._timing: Optional[_Breakdown] = None

    # -- attach ----------------------------------------------------------------------------------------------
    def after_hook_is_attached(self, trainer):
        if not trainer.state.fitting:
            return
        if sum(isinstance(hook, SpeedReportHook) for hook in trainer.hooks) > 1:
            # each would take the run's event points over, and all but the last would measure nothing
            raise ValueError("SpeedReportHook is in fit's hooks more than once: keep one (it measures the whole run; "
                             "its options say what it reports)")
        self._check_metric_states_initialization(trainer)
        self._release()  # (what a fit that raised before its end left behind)
        engine = self._engine = trainer.engine
        self._world = world_size()
        self._peak, self.peak_note = peak_flops(device_of(trainer), compute_kind(engine.precision.name),
                                                self.peak_tflops, self.measure_cpu_peak)
        if self._world > 1:
            self._peak = self._ranks_peak(self._peak)
        # the window's real tokens are read after each backward, an event a step of the user's own does not fire
        self.counts_tokens = hasattr(engine.reduction, "tokens") and trainer.user_step is None
        self._fit, self._epoch_totals = _Totals(), _Totals()
        self._last: Optional[Tuple[int, float, Any]] = None  # (samples, seconds, tokens) of the last step counted
        self._recorded: Dict[str, float] = {}  # seconds by timeline key up to the last record (and the warm-up's)
        self._baseline: Dict[str, float] = {}  # seconds by timeline key of the warm-up steps, left out of the report
        self._steps_seen = self._micro_samples = self._iteration = 0
        self._recorded_epoch = trainer.state.epoch  # the epoch of the last epoch record (the time after it: its)
        self._tokens: Any = None
        self._sync_watch: Any = None  # a SyncWatch while torch's sync debug mode is on (False: done)
        self.sync_counts: Dict[str, int] = {}  # host syncs seen on a GPU, by Python line
        self._register(trainer)
        if self.breakdown:
            self._timing = _Breakdown(self, trainer, self._lean, self.breakdown_every, self.breakdown_first,
                                      self.warmup_steps)
            self.clock_kind = type(self._timing.timeline.clock).__name__
        self._iter_handlers: Tuple[Callable, ...] = ()
        trainer.instrument(self._lean, ("after_train_iter", "after_backward"))

    def _ranks_peak(self, peak: Optional[float]) -> Optional[float]:
        """The mean of the ranks' peaks (one all-reduce), so that every rank divides by the same one: a CPU's is
        measured by each process and varies; None when some rank has none."""
        both = all_reduce_sum_(torch.tensor([peak or 0.0, peak is not None], dtype=torch.float64,
                                            device=self._engine.device)).tolist()
        if both[1] < self._world:
            if peak is not None:
                self.peak_note = "no MFU: another rank knows no peak for its device; give peak_tflops="
            return None
        mean = both[0] / self._world
        if self.peak_tflops is None and self._engine.device.type == "cpu":
            self.peak_note = (f"{mean / 1e9:.1f} GFLOP/s measured by a float32 matrix product on this CPU (the mean "
                              f"of the {self._world} ranks' measurements)")
        return mean

    def _lean(self, point: str, handlers: Tuple[Callable, ...]) -> Sequence[Callable]:
        """The functions of ``point`` on a step the breakdown does not time: the hooks' own, with this hook's
        count of each micro-batch in ``after_train_iter`` and its token count after each backward."""
        if point == "after_train_iter":
            self._iter_handlers = handlers
            if self._timing is not None:
                self._timing.set_iter_handlers(handlers)
            return (self._after_iter,)
        if point == "after_backward" and self.counts_tokens:
            return handlers + (self._note_tokens,)
        return handlers

    def _register(self, trainer) -> None:
        device = device_of(trainer)
        train, test = trainer.states["metrics"]["train"], trainer.states["metrics"]["test"]
        names = ["samples_per_s", "samples_per_s_per_rank"]
        if self.counts_tokens:
            names += ["tokens_per_s", "tokens_per_s_per_rank"]
        if self._peak is not None:
            names.append("mfu")
        for name in names:
            # per step the history keeps the all-ranks throughput only: a step's per-rank figure and MFU are it
            # times a constant (1 / world size, FLOPs per sample / peak); the progress line shows them all
            per_step = name in ("samples_per_s", "tokens_per_s")
            train[name] = _Figure(lambda n=name: self._step_figure(n), lambda n=name: self._epoch_figures()[n],
                                  not per_step, device, percent=name == "mfu")
        self._own = {"train": list(names), "test": []}
        if self.breakdown:
            for phase in self._phases(trainer):
                train[f"time/{phase}"] = _Figure(lambda: None, lambda p=phase: self._epoch_figures()[p], True,
                                                 device, in_log_line=False)
                self._own["train"].append(f"time/{phase}")
            # (no operators are counted when the user gives the FLOPs: that figure is not recorded, rather than
            # recorded as NaN, which would make two runs' histories unequal)
            counted = ("ops_per_micro_batch",) if self._given_flops is None else ()
            for name in ("steps", "timed_steps", "micro_batches", "seconds", "world_size", *counted,
                         "flops_per_micro_batch", "peak_tflops"):
                train[f"speed/{name}"] = _Figure(lambda: None, lambda n=name: self._epoch_figures()[n], True,
                                                 device, in_log_line=False)
                self._own["train"].append(f"speed/{name}")
            test["time/evaluation"] = _Figure(lambda: None, self._evaluation_seconds, True, device, in_log_line=False)
            self._own["test"].append("time/evaluation")

    def _phases(self, trainer) -> List[str]:
        """The phases recorded per epoch, the same list on every rank (the hooks are the same)."""
        hooks = [_hook_phase(h) for h in trainer.hooks if h is not self] + [HOOK_PREFIX + "Recorder"]
        unit = _unit_phase(trainer)
        own = [p for p in PHASES if p != "evaluation" and (p not in ("step", "auto") or p == unit)]
        return own + list(dict.fromkeys(hooks))

    # -- the events ------------------------------------------------------------------------------------------
    def before_train(self, trainer):
        self._stamp = time.perf_counter()
        self._iteration = trainer.state.iteration
        if self._timing is not None and self.warmup_steps == 0:
            self._timing.step_ended(0)

    def before_train_epoch(self, trainer):
        self._fit.add(self._epoch_totals)
        self._epoch_totals = _Totals()
        for name in self._own["train"]:
            trainer.states["metrics"]["train"][name].reset()
        self._stamp = time.perf_counter()

    def _after_iter(self, trainer, *args):
        """Every training iteration, in place of the hooks' ``after_train_iter`` handlers (which it calls, timed
        on a sampled step): count the micro-batch, and at an optimizer step's end its figures."""
        self._micro_samples += samples_in(trainer, args[1])
        if trainer.state.stepped:
            self._step_done(trainer)
        timing = self._timing
        if timing is not None and timing.sampling:
            timing.run_iter_handlers(trainer, args)
        else:
            for fn in self._iter_handlers:
                fn(trainer, *args)

    def _note_tokens(self, trainer):
        self._tokens = self._engine.reduction.tokens

    def sampled_backward(self, trainer):
        """``after_backward`` on a sampled step: the tokens, and the exposed communication's start."""
        if self.counts_tokens:
            self._tokens = self._engine.reduction.tokens
        self._timing.after_backward()

    def before_test(self, trainer):
        if not trainer.state.fitting:  # (evaluate() alone: the hook measures fits only)
            return
        self._watch_syncs(False)
        for name in self._own["test"]:
            trainer.states["metrics"]["test"][name].reset()
        if self._timing is not None:
            self._eval_back = self._timing.timeline.switch("evaluation")

    def after_test(self, trainer):
        if not trainer.state.fitting:
            return
        self._stamp = time.perf_counter()  # (evaluation is not training time)
        if self._timing is not None:
            self._timing.timeline.switch(self._eval_back)

    def after_train_epoch(self, trainer):
        self._watch_syncs(False)  # (the epoch's figures are read after this: a read the user asked for)
        self._recorded_epoch = trainer.state.epoch

    def after_train(self, trainer):
        self._record_tail(trainer)
        self._finish(trainer)

    def _record_tail(self, trainer) -> None:
        """Record what the epochs' records left out, so that the metrics file holds the whole fit (what
        ``colossal-lite report`` reads): the time spent after the last epoch's record (a checkpoint saved at
        its end is timed after it), or a stopped epoch's figures (preemption ends an epoch without its record).
        Every rank records alike (the figures are a collective)."""
        totals = self._epoch_totals
        whole_epoch = totals.figures is None and totals.steps > 0  # (figures never read: never recorded)
        if not whole_epoch and self._timing is None:
            return
        if not whole_epoch:
            self._fit.add(totals)
            self._epoch_totals = _Totals()
        figures = self._epoch_figures()
        if whole_epoch:  # the stopped epoch's record, as its end would have made it
            values = {f"train/{n}": figures[n.split("/", 1)[1] if "/" in n else n] for n in self._own["train"]}
            epoch = trainer.state.epoch
        else:  # a record of its own: the last epoch's record is at this step, and a step's later record replaces it
            values = {f"train/{TAIL}/{n[5:]}": figures[n[5:]] for n in self._own["train"] if n.startswith("time/")}
            epoch = self._recorded_epoch  # (the run has moved past it: no epoch of its own)
        trainer.record_values({n: v for n, v in values.items() if v is not None and v == v}, epoch=epoch)

    # -- figures -------------------------------------------------------------------------------------------
    def _first_count(self, trainer, samples: int) -> None:
        """Count the FLOPs once (their time is neither the step's nor a phase's)."""
        timeline = self._timing.timeline if self._timing is not None else None
        back = timeline.switch("report") if timeline is not None else None
        start = time.perf_counter()
        self._count_flops(trainer, samples)
        self._stamp += time.perf_counter() - start
        if timeline is not None:
            timeline.switch(back)

    def _count_flops(self, trainer, samples: int) -> None:
        """The training FLOPs of one micro-batch, counted once on meta tensors (or the user's figure)."""
        if self._given_flops is not None:
            self.flops = StepFlops(flops=int(self._given_flops * samples), ops=0, samples=samples)
            return
        if trainer.user_step is not None:
            self.flops_note = ("no MFU: a step of your own (fit(step=...)) calls the model itself, so its FLOPs are "
                               "not counted; give SpeedReportHook(flops_per_sample=...)")
            return
        st, engine = trainer.state, self._engine
        criterion, model_loss = engine.criterion.wrapped, engine.model_loss

        def loss_of(output, label):
            """The loss as the engine takes it (the criterion's, or the model's own from its output), without the
            engine's bookkeeping (token counts), which the count must not touch."""
            return model_loss(output) if model_loss is not None else call_criterion(criterion, output, label)
        try:
            self.flops = count_step_flops(engine.unwrapped_model, st.data, st.label, loss_of, samples, call=call_with)
        except Exception as err:  # noqa: BLE001 - a model that cannot run on meta tensors has no counted FLOPs
            self.flops_note = (f"no MFU: the FLOPs could not be counted on meta tensors ({type(err).__name__}: "
                               f"{err}); give SpeedReportHook(flops_per_sample=...)")

    def _step_done(self, trainer) -> None:
        """One optimizer step ended: its totals, and its samples, seconds and tokens (a device tensor) kept for the
        step's figures, which are computed when read (``_step_figure``). The warm-up steps (their one-time costs:
        allocation, autotuning, compilation) are left out of every figure; the FLOPs are counted at the first."""
        if self.flops is None and not self.flops_note:
            self._first_count(trainer, samples_in(trainer, trainer.state.label))
        now = time.perf_counter()
        seconds, self._stamp = max(now - self._stamp, 1e-9), now
        samples, self._micro_samples = self._micro_samples, 0
        micro_batches, self._iteration = trainer.state.iteration - self._iteration, trainer.state.iteration
        n = self._steps_seen = self._steps_seen + 1
        if n <= self.warmup_steps + self.sync_check_steps:
            self._warming_up(n)
            if n <= self.warmup_steps:
                return
        totals = self._epoch_totals
        if self._timing is not None:
            totals.timed_steps += self._timing.step_ended(n)
        totals.micro_batches += micro_batches
        totals.samples += samples
        totals.seconds += seconds
        totals.steps += 1
        tokens = self._tokens
        if tokens is not None:
            totals.tokens = tokens.detach().clone() if totals.tokens is None else totals.tokens + tokens
        self._last = (samples, seconds, tokens)

    def _step_figure(self, name: str) -> Any:
        """The last counted optimizer step's figure ``name`` (None before one), computed from its samples, seconds
        and tokens when a reader asks (the history at every step, a progress display at its own interval)."""
        if self._last is None:
            return None
        samples, seconds, tokens = self._last
        if name == "mfu":
            return None if self.flops is None else self.flops.flops_per_sample * samples / seconds / self._peak
        count = tokens if name.startswith("tokens") else samples
        if count is None:
            return None
        return count / seconds if name.endswith("_per_rank") else count * (self._world / seconds)

    def _warming_up(self, n: int) -> None:
        """The first steps: at the warm-up's end the time so far is set aside and the breakdown starts; on a GPU
        the host syncs are watched for ``sync_check_steps`` steps after it."""
        watch_from = max(self.warmup_steps, 1)
        if n in (watch_from, watch_from + self.sync_check_steps):
            self._watch_syncs(n == watch_from)
        if n == self.warmup_steps and self._timing is not None:
            self._baseline = self._timing.seconds_since({})
            self._recorded = dict(self._baseline)
            self._timing.step_ended(n)

    def _reduced(self, totals: _Totals, phases: Dict[str, float]) -> Dict[str, float]:
        """Figures of a span over every rank (one all-reduce): throughput summed over ranks, seconds averaged."""
        names = list(phases)
        tokens = totals.tokens if totals.tokens is not None else torch.zeros((), device=self._engine.device)
        head = torch.tensor([float(totals.samples), totals.seconds] + [phases[n] for n in names],
                            dtype=torch.float64, device=self._engine.device)
        values = all_reduce_sum_(torch.cat([head, tokens.detach().double().reshape(1).to(head.device)])).tolist()
        world = self._world
        samples, seconds = values[0], values[1] / world
        out = {name: value / world for name, value in zip(names, values[2:-1])}
        out.update(samples_per_s=samples / seconds if seconds > 0 else None, seconds=seconds, steps=totals.steps,
                   timed_steps=totals.timed_steps, micro_batches=totals.micro_batches, world_size=world,
                   ops_per_micro_batch=self.flops.ops if self.flops is not None and self.flops.ops else None,
                   flops_per_micro_batch=None if self.flops is None else float(self.flops.flops),
                   peak_tflops=None if self._peak is None else self._peak / 1e12)
        out["samples_per_s_per_rank"] = None if out["samples_per_s"] is None else out["samples_per_s"] / world
        out["tokens_per_s"] = values[-1] / seconds if self.counts_tokens and seconds > 0 else None
        out["tokens_per_s_per_rank"] = None if out["tokens_per_s"] is None else out["tokens_per_s"] / world
        mfu_ok = self._peak is not None and self.flops is not None and out["samples_per_s_per_rank"] is not None
        out["mfu"] = self.flops.flops_per_sample * out["samples_per_s_per_rank"] / self._peak if mfu_ok else None
        return out

    def _epoch_figures(self) -> Dict[str, float]:
        """This epoch's figures over every rank, computed once per epoch (every rank reads them together). The
        unsampled steps' time is shared out as the epoch's sampled steps measured (none: as the fit's so far)."""
        cached = self._epoch_totals.figures
        if cached is None:
            phases = [n.split("/", 1)[1] for n in self._own["train"] if n.startswith("time/")]
            seconds: Dict[str, float] = {}
            if self._timing is not None:
                raw = self._timing.seconds_since(self._recorded)
                raw.pop("evaluation", None)
                for key, value in raw.items():
                    self._recorded[key] = self._recorded.get(key, 0.0) + value
                sampled = any(v > 0 for k, v in raw.items() if k not in _NOT_SHARED)
                basis = raw if sampled else self._timing.seconds_since(self._baseline)
                shared = shared_out(raw, basis)
                seconds = {p: shared.get(p, 0.0) for p in phases}
            cached = self._epoch_totals.figures = self._reduced(self._epoch_totals, seconds)
        return cached

    def _evaluation_seconds(self) -> float:
        seconds = self._timing.seconds_since(self._recorded).get("evaluation", 0.0)
        self._recorded["evaluation"] = self._recorded.get("evaluation", 0.0) + seconds
        values = all_reduce_sum_(torch.tensor([seconds], dtype=torch.float64, device=self._engine.device)).tolist()
        return values[0] / self._world

    def _watch_syncs(self, start: bool) -> None:
        """On a GPU, start or stop torch's sync debug mode ("warn"); each sync's Python line is counted."""
        watching = isinstance(self._sync_watch, SyncWatch)
        if self._engine.device.type != "cuda" or (start and self._sync_watch is not None) or not (start or watching):
            return
        if start:
            self._sync_watch = SyncWatch()
            torch.cuda.set_sync_debug_mode("warn")
            return
        torch.cuda.set_sync_debug_mode("default")
        for site, n in self._sync_watch.stop().items():
            self.sync_counts[site] = self.sync_counts.get(site, 0) + n
        self._sync_watch = False  # (watched once per fit)

    def _release(self) -> None:
        """Stop watching for syncs and remove the gradient hooks from the model."""
        if getattr(self, "_engine", None) is not None:
            self._watch_syncs(False)
        if self._timing is not None:
            self._timing.stop()
            self._timing = None

    def _finish(self, trainer) -> None:
        """The end of fit: the whole run's figures and the report; the run's own metrics removed."""
        timing = self._timing
        self._release()
        self._fit.add(self._epoch_totals)
        self._epoch_totals = _Totals()
        seconds: Dict[str, float] = {}
        if timing is not None:  # the time up to the last record (``_record_tail`` made one just now)
            raw = {key: value - self._baseline.get(key, 0.0) for key, value in self._recorded.items()}
            shared = shared_out(raw, raw)
            seconds = {p: shared.get(p, 0.0) for p in self._phases(trainer) + ["evaluation"]}
        fit = self._reduced(self._fit, seconds)
        self.figures = SpeedFigures(
            seconds={p: fit[p] for p in seconds if fit[p] > 0}, steps=self._fit.steps, micro_batches=self._fit.micro_batches,
            world_size=self._world, samples_per_s=fit["samples_per_s"], tokens_per_s=fit["tokens_per_s"],
            mfu=fit["mfu"], peak_note=self.flops_note or self.peak_note, ops_per_micro_batch=fit["ops_per_micro_batch"],
            flops_per_micro_batch=fit["flops_per_micro_batch"], peak_flops=self._peak,
            sync_sites=[f"{site} ({n}x)" for site, n in sorted(self.sync_counts.items(), key=lambda kv: -kv[1])],
            timed_steps=self._fit.timed_steps if timing is not None else None)
        self.report_text = format_report(self.figures)
        if self.report:
            log_rank_0(self.logger or trainer.logger or get_dist_logger(), self.report_text)
        for phase, names in self._own.items():
            for name in names:
                trainer.states["metrics"][phase].pop(name, None)
