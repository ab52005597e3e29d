"""``SpeedReportHook``: throughput, model FLOPs utilisation and where each step's time went, ranked at the end.

Throughput and MFU cost one clock read and a few host operations per optimizer step; the FLOPs are counted
once, on meta tensors. The breakdown (``breakdown=True``, the default) wraps every hook handler of the run and
marks each phase of a training iteration on a clock (``_timeline``): the host's clock on a CPU, CUDA events on a
GPU, read only at the epoch's end and at the end of ``fit``, where the run reads the device anyway.
"""
from __future__ import annotations

import os
import time
import warnings
from typing import Any, Callable, Dict, List, Optional

import torch

from ...core.dist import all_reduce_sum_, log_rank_0, world_size
from ...engine.batch import call_criterion, call_with
from ...logging import get_dist_logger
from ...utils.flops import StepFlops, compute_kind, count_step_flops, peak_flops
from .._timeline import Timeline, make_clock
from ..events import Event
from ..speed_report import HOOK_PREFIX, PHASES, SpeedFigures, format_report
from ._metric_hook import Metric, MetricHook
from ._utils import device_of

__all__ = ["SpeedReportHook"]

#: The phase a training run is in after each event (its handlers' own time is theirs, see ``_timed``).
PHASE_AFTER = {
    "before_train": "loop", "before_train_epoch": "loop", "before_train_iter": "data",
    "after_batch_loaded": "forward", "before_backward": "backward", "after_backward": "optimizer",
    "before_optimizer_step": "optimizer", "after_optimizer_step": "loop", "after_train_iter": "loop",
    "after_train_epoch": "loop", "on_save_checkpoint": "checkpoint", "before_test": "evaluation",
    "after_test_epoch": "evaluation", "after_test": "loop", "after_train": None,
}


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
        return f"{100 * value:.3g}%" if self.percent else f"{value:.5g}"

    @staticmethod
    def is_better(a, b) -> bool:
        return a > b


def _timed(fn: Callable, phase: str, timeline: Timeline) -> Callable:
    """``fn`` with its own time given to ``phase``."""
    def timed(*args):
        back = timeline.switch(phase)
        try:
            fn(*args)
        finally:
            timeline.switch(back)
    return timed


class _Totals:
    """Host sums of a span of the run: samples of this rank, tokens (a device tensor, or None), the steps'
    seconds on the host clock, optimizer steps and micro-batches."""

    def __init__(self):
        self.samples, self.tokens, self.seconds, self.steps, self.micro_batches = 0, None, 0.0, 0, 0


class SpeedReportHook(MetricHook):
    """Train metrics ``samples_per_s`` (all ranks), ``samples_per_s_per_rank``, ``tokens_per_s`` and
    ``tokens_per_s_per_rank`` (with ``grad_reduction='per-token-mean'``, whose criterion counts the tokens),
    ``mfu`` (model FLOPs utilisation, 0..1) per optimizer step and per epoch; with ``breakdown`` the seconds of
    each phase per epoch (``time/<phase>``, in the metrics file, not the log line), and at the end of ``fit`` a
    ranked table of where the time went with one suggestion per cause (``report``; ``hook.report_text``).

    ``peak_tflops``: the device's peak for MFU (default: the table in ``utils.flops`` for a GPU, a short matrix
    product on a CPU with ``measure_cpu_peak``, else no MFU). ``flops_per_sample``: give the model's training
    FLOPs per sample instead of counting them (None: counted once on meta tensors). ``warmup_steps``: the first
    optimizer steps of the fit, left out of every figure (their one-time costs: allocation, autotuning, compilation).
    """

    def __init__(self, breakdown: bool = True, report: bool = True, peak_tflops: Optional[float] = None,
                 measure_cpu_peak: bool = True, flops_per_sample: Optional[float] = None, warmup_steps: int = 1,
                 logger=None, priority: int = 10):
        super().__init__(priority)
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"SpeedReportHook(warmup_steps={warmup_steps!r}): give the optimizer steps to leave out "
                             f"at the start of fit as an int >= 0")
        self.warmup_steps = warmup_steps
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
        self._handles: List[Any] = []

    # -- attach ----------------------------------------------------------------------------------------------
    def after_hook_is_attached(self, trainer):
        if not trainer.state.fitting:
            return
        self._check_metric_states_initialization(trainer)
        self._release()  # (what a fit that raised before its end left behind)
        engine = self._engine = trainer.engine
        self._world = world_size()
        self._peak, self.peak_note = peak_flops(device_of(trainer), compute_kind(engine.precision.name),
                                                self.peak_tflops, self.measure_cpu_peak)
        self._counts_tokens = hasattr(engine.reduction, "tokens")
        self._fit, self._epoch_totals = _Totals(), _Totals()
        self._last_step: Dict[str, Any] = {}
        self._recorded: Dict[str, float] = {}  # phase seconds up to the last record (and the warm-up's)
        self._baseline: Dict[str, float] = {}  # phase seconds of the warm-up steps, left out of the report
        self._steps_seen = self._micro_batches = self._micro_samples = 0
        self._sync_watch: Any = None  # the warnings caught while torch's sync debug mode is on (False: done)
        self.sync_counts: Dict[str, int] = {}  # host syncs seen on a GPU, by Python line
        self._register(trainer)
        self.timeline = Timeline(make_clock(device_of(trainer)))
        if self.breakdown:
            self._instrument(trainer)

    def _register(self, trainer) -> None:
        device = device_of(trainer)
        train, test = trainer.states["metrics"]["train"], trainer.states["metrics"]["test"]
        names = ["samples_per_s", "samples_per_s_per_rank"]
        if self._counts_tokens:
            names += ["tokens_per_s", "tokens_per_s_per_rank"]
        if self._peak is not None:
            names.append("mfu")
        for name in names:
            train[name] = _Figure(lambda n=name: self._last_step.get(n), lambda n=name: self._epoch_figures()[n],
                                  False, device, percent=name == "mfu")
        self._own = {"train": list(names), "test": []}
        if self.breakdown:
            for phase in self._phases(trainer):
                train[f"time/{phase}"] = _Figure(lambda: None, lambda p=phase: self._epoch_figures()[p], True,
                                                 device, in_log_line=False)
                self._own["train"].append(f"time/{phase}")
            for name in ("steps", "micro_batches", "world_size", "ops_per_micro_batch", "flops_per_micro_batch",
                         "peak_tflops"):
                train[f"speed/{name}"] = _Figure(lambda: None, lambda n=name: self._epoch_figures()[n], True,
                                                 device, in_log_line=False)
                self._own["train"].append(f"speed/{name}")
            test["time/evaluation"] = _Figure(lambda: None, self._evaluation_seconds, True, device, in_log_line=False)
            self._own["test"].append("time/evaluation")

    def _phases(self, trainer) -> List[str]:
        """The phases recorded per epoch, the same list on every rank (the hooks are the same)."""
        hooks = [HOOK_PREFIX + type(h).__name__ for h in trainer.hooks if h is not self] + [HOOK_PREFIX + "Recorder"]
        return [p for p in PHASES if p != "evaluation"] + list(dict.fromkeys(hooks))

    def _instrument(self, trainer) -> None:
        """Each event's handlers, this hook's first as the phase marker, the others timed as their hook's."""
        handlers, timeline = trainer._h, self.timeline  # (the run's handler table, rebuilt at every attach)
        for event in Event:
            name = event.value
            others = tuple(_timed(fn, HOOK_PREFIX + type(getattr(fn, "__self__", fn)).__name__, timeline)
                           for fn in getattr(handlers, name) if getattr(fn, "__self__", None) is not self)
            marker = self._marker(name) if name in PHASE_AFTER else None
            setattr(handlers, name, ((marker,) if marker else ()) + others)
        trainer._step.before_load = (lambda: timeline.switch("h2d"),)
        if self._world > 1:
            self._watch_gradients(trainer.engine.unwrapped_model)

    def _marker(self, event: str) -> Callable:
        own, phase, timeline = getattr(self, "_on_" + event, None), PHASE_AFTER[event], self.timeline
        if event == "after_backward" and self._world > 1:  # gradient reduction (and clipping) over the ranks
            phase = "communication"

        def marker(trainer, *args):
            if own is not None:
                own(trainer, *args)
            timeline.switch(phase)
        return marker

    def _watch_gradients(self, model: torch.nn.Module) -> None:
        """Mark the time each gradient is accumulated: what the backward waits for after the last one is
        exposed communication (DDP's all-reduce finishing)."""
        clock = self.timeline.clock
        self._grads_done = None

        def done(param):
            self._grads_done = clock.mark()
        self._handles = [p.register_post_accumulate_grad_hook(done) for p in model.parameters() if p.requires_grad]

    # -- the events (each one is also the phase marker's work with ``breakdown``) ----------------------------------
    def before_train(self, trainer):
        self._stamp = time.perf_counter()

    def before_train_epoch(self, trainer):
        self._epoch_totals = _Totals()
        for name in self._own["train"]:
            trainer.states["metrics"]["train"][name].reset()
        self._stamp = time.perf_counter()

    def after_batch_loaded(self, trainer):
        size = trainer.engine.schedule.batch_size
        self._micro_batches += 1
        self._micro_samples += 1 if size is None else size
        if self.flops is None and not self.flops_note:  # once; its time is neither the step's nor a phase's
            back = self.timeline.switch("report") if self.breakdown else None
            start = time.perf_counter()
            self._count_flops(trainer, 1 if size is None else size)
            self._stamp += time.perf_counter() - start
            if self.breakdown:
                self.timeline.switch(back)

    def after_backward(self, trainer):
        if self._counts_tokens:
            self._tokens = self._engine.reduction.tokens
        grads_done, self._grads_done = getattr(self, "_grads_done", None), None
        if grads_done is not None and self.breakdown:  # (the marker then ends the exposed wait here)
            self.timeline.split(grads_done, "communication")

    def before_test(self, trainer):
        self._watch_syncs(False)
        for name in self._own["test"]:
            trainer.states["metrics"]["test"][name].reset()

    def after_test(self, trainer):
        self._stamp = time.perf_counter()  # (evaluation is not training time)

    def after_train_iter(self, trainer, *args):
        if trainer.state.stepped:
            self._step_done()

    def after_train_epoch(self, trainer):
        self._watch_syncs(False)  # (the epoch's figures are read after this: a read the user asked for)

    def after_train(self, trainer):
        self._finish(trainer)

    _on_before_train, _on_before_train_epoch, _on_after_batch_loaded = before_train, before_train_epoch, \
        after_batch_loaded
    _on_after_backward, _on_after_test, _on_after_train_iter = after_backward, after_test, after_train_iter
    _on_after_train, _on_before_test = after_train, before_test

    # -- figures -------------------------------------------------------------------------------------------
    def _count_flops(self, trainer, samples: int) -> None:
        """The training FLOPs of one micro-batch, counted once on meta tensors (or the user's figure)."""
        if self._given_flops is not None:
            self.flops = StepFlops(flops=int(self._given_flops * samples), ops=0, samples=samples)
            return
        st, engine = trainer.state, self._engine
        criterion = engine.criterion.wrapped
        try:
            self.flops = count_step_flops(engine.unwrapped_model, st.data, st.label,
                                          None if criterion is None else lambda o, y: call_criterion(criterion, o, y),
                                          samples, call=call_with)
        except Exception as err:  # noqa: BLE001 - a model that cannot run on meta tensors has no counted FLOPs
            self.flops_note = (f"no MFU: the FLOPs could not be counted on meta tensors ({type(err).__name__}: "
                               f"{err}); give SpeedReportHook(flops_per_sample=...)")

    def _step_done(self) -> None:
        """One optimizer step ended: its figures (host numbers, and a device tensor for tokens). The warm-up steps
        (their one-time costs: allocation, autotuning, compilation) are left out of every figure."""
        now = time.perf_counter()
        seconds, self._stamp = max(now - self._stamp, 1e-9), now
        samples, micro_batches, self._micro_samples, self._micro_batches = self._micro_samples, self._micro_batches, 0, 0
        self._steps_seen += 1
        watch_from = max(self.warmup_steps, 1)
        if self._steps_seen in (watch_from, watch_from + self.sync_check_steps):
            self._watch_syncs(self._steps_seen == watch_from)
        if self._steps_seen <= self.warmup_steps:
            if self.breakdown and self._steps_seen == self.warmup_steps:
                self.timeline.switch(self.timeline.phase)  # (the open phase's time so far is the warm-up's)
                self._baseline = dict(self.timeline.settle())
                self._recorded = dict(self._baseline)
            return
        tokens = self._tokens if self._counts_tokens else None
        for totals in (self._fit, self._epoch_totals):
            totals.micro_batches += micro_batches
            totals.samples += samples
            totals.seconds += seconds
            totals.steps += 1
            if tokens is not None:
                totals.tokens = tokens.detach().clone() if totals.tokens is None else totals.tokens + tokens
        step = self._last_step
        step["samples_per_s_per_rank"] = samples / seconds
        step["samples_per_s"] = samples * self._world / seconds
        if tokens is not None:
            step["tokens_per_s_per_rank"] = tokens / seconds
            step["tokens_per_s"] = tokens * (self._world / seconds)
        if self._peak is not None and self.flops is not None:
            step["mfu"] = self.flops.flops_per_sample * samples / seconds / self._peak

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
        out.update(samples_per_s=samples / seconds if seconds > 0 else None, steps=totals.steps,
                   micro_batches=totals.micro_batches, world_size=world,
                   ops_per_micro_batch=self.flops.ops if self.flops is not None and self.flops.ops else None,
                   flops_per_micro_batch=None if self.flops is None else float(self.flops.flops),
                   peak_tflops=None if self._peak is None else self._peak / 1e12)
        out["samples_per_s_per_rank"] = None if out["samples_per_s"] is None else out["samples_per_s"] / world
        out["tokens_per_s"] = values[-1] / seconds if self._counts_tokens and seconds > 0 else None
        out["tokens_per_s_per_rank"] = None if out["tokens_per_s"] is None else out["tokens_per_s"] / world
        mfu_ok = self._peak is not None and self.flops is not None and out["samples_per_s_per_rank"] is not None
        out["mfu"] = self.flops.flops_per_sample * out["samples_per_s_per_rank"] / self._peak if mfu_ok else None
        return out

    def _phase_seconds(self, since: Dict[str, float], phases: List[str]) -> Dict[str, float]:
        """The seconds of each of ``phases`` since the totals ``since`` (the open phase is closed here first)."""
        self.timeline.switch(self.timeline.phase)
        totals = self.timeline.settle()
        return {p: totals.get(p, 0.0) - since.get(p, 0.0) for p in phases}

    def _epoch_figures(self) -> Dict[str, float]:
        """This epoch's figures over every rank, computed once per epoch (every rank reads them together)."""
        cached = getattr(self._epoch_totals, "figures", None)
        if cached is None:
            phases = [n.split("/", 1)[1] for n in self._own["train"] if n.startswith("time/")]
            seconds = self._phase_seconds(self._recorded, phases) if self.breakdown else {}
            self._recorded.update({p: self._recorded.get(p, 0.0) + v for p, v in seconds.items()})
            cached = self._epoch_totals.figures = self._reduced(self._epoch_totals, seconds)
        return cached

    def _evaluation_seconds(self) -> float:
        seconds = self._phase_seconds(self._recorded, ["evaluation"])
        self._recorded["evaluation"] = self._recorded.get("evaluation", 0.0) + seconds["evaluation"]
        values = all_reduce_sum_(torch.tensor([seconds["evaluation"]], dtype=torch.float64,
                                              device=self._engine.device)).tolist()
        return values[0] / self._world

    #: Optimizer steps after the warm-up during which a GPU run watches for host syncs (torch's sync debug mode).
    sync_check_steps = 3

    def _watch_syncs(self, start: bool) -> None:
        """On a GPU, start or stop torch's sync debug mode ("warn"); each sync's Python line is counted."""
        watching = isinstance(self._sync_watch, list)
        if self._engine.device.type != "cuda" or (start and self._sync_watch is not None) or not (start or watching):
            return
        if start:
            self._sync_catcher = warnings.catch_warnings(record=True)
            self._sync_watch = self._sync_catcher.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            return
        torch.cuda.set_sync_debug_mode("default")
        self._sync_catcher.__exit__(None, None, None)
        for caught in self._sync_watch:
            if "synchroniz" in str(caught.message):
                site = f"{os.path.basename(caught.filename)}:{caught.lineno}"
                self.sync_counts[site] = self.sync_counts.get(site, 0) + 1
        self._sync_watch = False  # (watched once per fit)

    def _release(self) -> None:
        """Stop watching for syncs and remove the gradient hooks from the model."""
        if getattr(self, "_engine", None) is not None:
            self._watch_syncs(False)
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _finish(self, trainer) -> None:
        """The end of fit: the whole run's figures and the report; the run's own metrics and hooks removed."""
        self._release()
        phases = self._phases(trainer) + ["evaluation"] if self.breakdown else []
        seconds = self._phase_seconds(self._baseline, phases) if self.breakdown else {}
        fit = self._reduced(self._fit, seconds)
        self.figures = SpeedFigures(
            seconds={p: fit[p] for p in seconds if fit[p] > 0}, steps=self._fit.steps, micro_batches=self._fit.micro_batches,
            world_size=self._world, samples_per_s=fit["samples_per_s"], tokens_per_s=fit["tokens_per_s"],
            mfu=fit["mfu"], peak_note=self.flops_note or self.peak_note, ops_per_micro_batch=fit["ops_per_micro_batch"],
            flops_per_micro_batch=fit["flops_per_micro_batch"], peak_flops=self._peak,
            sync_sites=[f"{site} ({n}x)" for site, n in sorted(self.sync_counts.items(), key=lambda kv: -kv[1])])
        self.report_text = format_report(self.figures)
        if self.report:
            log_rank_0(self.logger or trainer.logger or get_dist_logger(), self.report_text)
        for phase, names in self._own.items():
            for name in names:
                trainer.states["metrics"][phase].pop(name, None)
