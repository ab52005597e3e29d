"""The speed report: where a run's time went, ranked, with one suggestion per dominant cause.

``SpeedFigures`` holds what a run measured (seconds by phase, steps, throughput, MFU); it comes from a live
``SpeedReportHook`` or from a run's ``metrics.jsonl`` (``figures_from_records``, which ``colossal-lite report``
uses). ``rank_causes`` turns it into rows, largest first, each naming a cause and what to change;
``format_report`` writes them as the short table a user reads.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

from ..utils.metrics_file import by_name

__all__ = ["SpeedFigures", "Cause", "rank_causes", "format_report", "figures_from_records", "PHASES",
           "SMALL_KERNEL_S"]

#: The phases a training run is split into, in the order a step runs them, with what each is in words.
PHASES: Dict[str, str] = {
    "data": "waiting for data",
    "h2d": "host-to-device copies",
    "step": "your step function (fit(step=...): its forward, backward and optimizer step, not split)",
    "auto": "forward, loss and backward (gradient_accumulation='auto' runs them as one unit, split when memory "
            "runs out)",
    "forward": "forward and loss",
    "backward": "backward",
    "communication": "gradient communication (exposed)",
    "optimizer": "clipping and optimizer step",
    "checkpoint": "checkpoint saves",
    "evaluation": "evaluation",
    "loop": "the trainer's own loop (progress display, bookkeeping; a loader without len is read ahead here)",
}
HOOK_PREFIX = "hook:"  # a hook's own time is the phase "hook:<its class name>"
#: ``train/<TAIL>/<phase>``: the seconds of each phase after the last epoch's record (a checkpoint saved at its
#: end), recorded at the end of ``fit``.
TAIL = "time_after_epochs"
#: The last of the figures each epoch records (``SpeedReportHook`` records them in one group, in this order to
#: the end): a group without it was cut short, by a run stopped while writing its metrics file.
LAST_FIGURE = "train/speed/peak_tflops"
#: The per-epoch throughput figures, recorded in the same group as the phase seconds.
_RATES = ("train/samples_per_s", "train/samples_per_s_per_rank", "train/tokens_per_s", "train/tokens_per_s_per_rank",
          "train/mfu")
#: The phases that run the model's forward and backward (whichever of them a run has).
COMPUTE_PHASES = ("auto", "forward", "backward")

#: The fixed cost of launching one operator (the framework's dispatch and, on a GPU, the kernel launch): an
#: operator whose arithmetic at the device's peak takes less than this is dominated by its launch.
SMALL_KERNEL_S = 5e-6
#: An operator whose measured time is above this on average is doing work (arithmetic, memory traffic, Python in
#: the forward), whatever its arithmetic at the peak: launches alone never take that long.
LAUNCH_BOUND_S = 100e-6

_SUGGESTIONS = {
    "data": "data-bound: raise the DataLoader's num_workers, set pin_memory=True, or make the dataset faster "
            "(decode once and cache, smaller samples)",
    "h2d": "pin_memory=True in the DataLoader (the copies can then overlap), and move only the tensors the model needs",
    "small kernels": "many small kernels: compile=True in the config fuses them (torch.compile), or use fewer, "
                     "larger layers / a larger micro-batch",
    "step": "the step function's own work: bf16 (fp16 = dict(mode='bf16')), a larger micro-batch, or compile=True "
            "(the Trainer cannot split a step of your own; time its parts inside it to see which dominates)",
    "auto": "the model's own arithmetic: bf16 (fp16 = dict(mode='bf16')) or compile=True; a fixed "
            "gradient_accumulation (the split the log says the run settled on) times forward and backward apart",
    "forward": "the model's own arithmetic: bf16 (fp16 = dict(mode='bf16')), a larger micro-batch, or compile=True",
    "backward": "the model's own arithmetic: bf16 (fp16 = dict(mode='bf16')), a larger micro-batch, or compile=True",
    "communication": "communication-bound: raise gradient_accumulation (one all-reduce per window), try another "
                     "ZeRO stage (zero = dict(stage=...)), or a larger bucket (torch_ddp = dict(bucket_cap_mb=...))",
    "optimizer": "a fused or foreach optimizer (torch.optim.AdamW(..., fused=True)), or ZeRO stage 1 to shard the "
                 "optimizer's work",
    "checkpoint": ("checkpoints block training: save less often (SaveCheckpointHook's interval), or in the background "
                   "(async_save=True) if not yet; a background save still blocks while it copies the state to host "
                   "memory"),
    "evaluation": "evaluate less often (fit's test_interval) or on a smaller test set",
    "loop": "display_progress=False; for a loader without len this is also its wait for data (give it a len)",
    "host syncs": "host syncs stall the device: remove the .item()/.cpu()/print of tensors at the places listed",
    "unpinned batch": "the batch's copy to the device waits for it: pin_memory=True in the DataLoader (or a "
                      "dataset that returns pinned tensors), so the copy runs beside the device's work",
    "hook:Recorder": "{what} take {ms} ms per step: record fewer values per step (LogMetricByStepHook, a "
                     "tracker's own logging interval)",
}

#: A sync site that is the library's own copy of a batch to the device (``engine/batch.py``): it waits when the
#: batch is in memory that is not pinned, which the user fixes in their loader, not at the line.
UNPINNED_BATCH_SITE = "the batch's copy to the device from memory that is not pinned"

#: Parts the Trainer adds to every fit, timed as hooks are, named for a user who never added them.
OWN_PARTS = {"Recorder": "the Trainer's metric history and trackers"}


@dataclass
class SpeedFigures:
    """What a run measured. ``seconds``: time by phase (``PHASES`` keys and ``'hook:<Name>'``), mean over ranks;
    ``ops_per_micro_batch``: operators one micro-batch's forward and backward dispatch (None: not counted);
    ``timed_steps``: the steps whose phases were timed, the others' time shared out in their proportions."""

    seconds: Dict[str, float]
    steps: int = 0
    micro_batches: int = 0
    world_size: int = 1
    samples_per_s: Optional[float] = None
    tokens_per_s: Optional[float] = None
    mfu: Optional[float] = None
    peak_note: str = ""
    ops_per_micro_batch: Optional[float] = None
    flops_per_micro_batch: Optional[float] = None
    peak_flops: Optional[float] = None
    sync_sites: List[str] = field(default_factory=list)
    timed_steps: Optional[int] = None  # the optimizer steps whose phases were timed (None: every step)
    cut_epochs: List[int] = field(default_factory=list)  # epochs whose figures the metrics file holds only in part


@dataclass
class Cause:
    """One row of the report: ``key`` (a phase, ``'small kernels'`` or ``'hook:<Name>'``), its seconds and
    share of the measured time, the cause in words and what to change."""

    key: str
    seconds: float
    share: float
    what: str
    suggestion: str


def _small_kernels(figures: SpeedFigures) -> bool:
    """Forward and backward are dominated by the launch cost of their operators: the mean operator's arithmetic
    at the device's peak is shorter than a launch and its measured time is no longer than launches take (without
    a peak: its measured time is shorter than a launch)."""
    ops = figures.ops_per_micro_batch or 0
    if not ops or not figures.micro_batches:
        return False
    measured = sum(figures.seconds.get(key, 0.0) for key in COMPUTE_PHASES) / (ops * figures.micro_batches)
    if figures.flops_per_micro_batch is not None and figures.peak_flops:
        return figures.flops_per_micro_batch / ops / figures.peak_flops < SMALL_KERNEL_S and measured < LAUNCH_BOUND_S
    return measured < SMALL_KERNEL_S


def _rows(figures: SpeedFigures) -> List[tuple]:
    """(key, seconds, what) for every phase that took time; forward and backward as one row when small kernels
    dominate them."""
    seconds = dict(figures.seconds)
    rows = []
    if _small_kernels(figures):
        compute = sum(seconds.pop(key, 0.0) for key in COMPUTE_PHASES)
        ops = figures.ops_per_micro_batch * figures.micro_batches
        rows.append(("small kernels", compute, f"forward and backward: many small kernels ({figures.ops_per_micro_batch:.0f} "
                                               f"operators per micro-batch, {compute / ops * 1e6:.1f} us each)"))
    for key, value in seconds.items():
        if key.startswith(HOOK_PREFIX):
            name = key[len(HOOK_PREFIX):]
            rows.append((key, value, OWN_PARTS.get(name, f"the hook {name}")))
        elif key in PHASES:
            rows.append((key, value, PHASES[key]))
    return rows


def rank_causes(figures: SpeedFigures) -> List[Cause]:
    """The phases by time, largest first, each with its share of the measured time and a suggestion."""
    rows = [row for row in _rows(figures) if row[1] > 0]
    total = sum(row[1] for row in rows) or 1.0
    causes = []
    for key, value, what in sorted(rows, key=lambda row: -row[1]):
        if key.startswith(HOOK_PREFIX):
            per_step = f"{value / max(figures.steps, 1) * 1e3:.3g}"
            suggestion = _SUGGESTIONS[key].format(ms=per_step, what=what) if key in _SUGGESTIONS else \
                f"{key[len(HOOK_PREFIX):]} takes {per_step} ms per step: run it less often or move its work off the step"
        else:
            suggestion = _SUGGESTIONS.get(key, "")
        causes.append(Cause(key, value, value / total, what, suggestion))
    if figures.sync_sites:
        unpinned = [site for site in figures.sync_sites if site.startswith(UNPINNED_BATCH_SITE)]
        if unpinned:
            causes.insert(0, Cause("unpinned batch", 0.0, 0.0, "host-device syncs on the step: " + ", ".join(unpinned),
                                   _SUGGESTIONS["unpinned batch"]))
        others = [site for site in figures.sync_sites if site not in unpinned]
        if others:
            causes.insert(0, Cause("host syncs", 0.0, 0.0, "host-device syncs on the step: " + ", ".join(others),
                                   _SUGGESTIONS["host syncs"]))
    return causes


def rate_text(value: float) -> str:
    """A rate as a user reads it: whole numbers from 1000 up (``15878``, not ``1.588e+04``), four figures below."""
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def peak_text(flops_per_s: float) -> str:
    """A peak in the unit that suits it: ``68.6 GFLOP/s``, ``989.4 TFLOP/s``."""
    return f"{flops_per_s / 1e12:.4g} TFLOP/s" if flops_per_s >= 1e12 else f"{flops_per_s / 1e9:.4g} GFLOP/s"


def _headline(figures: SpeedFigures) -> str:
    parts = [f"{figures.steps} optimizer steps on {figures.world_size} rank(s)"]
    if figures.samples_per_s is not None:
        parts.append(f"{rate_text(figures.samples_per_s)} samples/s "
                     f"({rate_text(figures.samples_per_s / figures.world_size)} per rank)")
    if figures.tokens_per_s is not None:
        parts.append(f"{rate_text(figures.tokens_per_s)} tokens/s")
    if figures.mfu is not None:
        parts.append(f"MFU {100 * figures.mfu:.3g}% (peak {figures.peak_note})")
    elif figures.peak_note:
        parts.append(figures.peak_note)
    if figures.timed_steps is not None and figures.timed_steps < figures.steps:
        parts.append(f"phases timed on {figures.timed_steps} of the {figures.steps} steps")
    return "Speed report: " + ", ".join(parts)


def format_report(figures: SpeedFigures, rows: int = 6) -> str:
    """The headline (throughput, MFU), then the ``rows`` largest causes: share, seconds, cause, what to do."""
    lines = [_headline(figures)]
    if figures.cut_epochs:
        lines[0] += (f"\n  (left out: the figures of epoch {', '.join(map(str, figures.cut_epochs))}, which the metrics "
                     f"file holds only in part (the run stopped while writing them); the report covers the epochs "
                     f"recorded whole)")
    if not figures.steps:  # what was timed outside any step (a fit's end) would rank as if it were the run
        return lines[0] + ("\n  (no optimizer step measured: a fit leaves out its first steps, their one-time costs; "
                           "SpeedReportHook(warmup_steps=0) measures from the first)")
    causes = rank_causes(figures)
    if not causes:
        return lines[0] + "\n  (no time measured)"
    lines.append(f"  {'share':>6}  {'seconds':>9}  where the time went -> what to change")
    for cause in causes[:rows]:
        lines.append(f"  {100 * cause.share:5.1f}%  {cause.seconds:9.3f}  {cause.what}")
        if cause.suggestion:
            lines.append(f"  {'':>6}  {'':>9}  -> {cause.suggestion}")
    return "\n".join(lines)


def figures_from_records(records: Iterable[Mapping]) -> SpeedFigures:
    """The figures of a run from its metrics file's records (``utils.metrics_file.read_metrics``): the phase
    seconds summed over the epochs' records (``train/time/<phase>``), the time after the last one
    (``train/time_after_epochs/<phase>``) and the evaluations' (``test/time/evaluation``), the step counts summed,
    throughput and MFU over the whole run. An epoch whose figures the file holds only in part is left out (named
    in ``cut_epochs``). Raises ValueError when the run recorded no speed breakdown, or none whole."""
    records, cut_epochs = _without_cut_groups(list(records))
    sums: Dict[str, float] = {}
    last: Dict[str, float] = {}
    columns = by_name(records)
    for name, (_, values) in columns.items():
        values = [v for v in values if v == v]  # (NaN: not measured)
        if values:
            sums[name], last[name] = sum(values), values[-1]
    seconds: Dict[str, float] = {}
    for name, value in sums.items():
        if name.startswith(("train/time/", "test/time/", f"train/{TAIL}/")):
            phase = name.split("/", 2)[2]
            seconds[phase] = seconds.get(phase, 0.0) + value
    if not seconds and cut_epochs:
        raise ValueError(f"the metrics file stops inside the speed figures of epoch {cut_epochs[-1]} (the run stopped "
                         f"while writing them) and holds no epoch's figures whole: nothing to report")
    if not seconds:
        stopped = "train/samples_per_s_step" in columns
        raise ValueError("no speed breakdown in this run's metrics (no train/time/... values): " + (
            "the run recorded per-step throughput but stopped before an epoch's end recorded its figures (a crash "
            "records none)" if stopped else "run fit with hooks=[SpeedReportHook()] to record one"))
    peak = last.get("train/speed/peak_tflops")
    seconds_of = dict(zip(*columns.get("train/speed/seconds", ([], []))))

    def rate(name: str) -> Optional[float]:
        return _whole_run_rate(columns.get(name, ([], [])), seconds_of, last.get(name))

    return SpeedFigures(
        seconds=seconds, steps=int(sums.get("train/speed/steps", 0)),
        micro_batches=int(sums.get("train/speed/micro_batches", 0)),
        world_size=int(last.get("train/speed/world_size", 1)),
        samples_per_s=rate("train/samples_per_s"), tokens_per_s=rate("train/tokens_per_s"), mfu=rate("train/mfu"),
        peak_note="" if peak is None else peak_text(peak * 1e12),
        ops_per_micro_batch=last.get("train/speed/ops_per_micro_batch"),
        flops_per_micro_batch=last.get("train/speed/flops_per_micro_batch"),
        peak_flops=None if peak is None else peak * 1e12,
        timed_steps=int(sums["train/speed/timed_steps"]) if "train/speed/timed_steps" in sums else None,
        cut_epochs=cut_epochs)


def _in_epoch_group(name: str) -> bool:
    """One of the figures an epoch records together (``time_after_epochs`` is recorded apart, at the fit's end)."""
    return name in _RATES or name.startswith(("train/time/", "train/speed/"))


def _without_cut_groups(records: List[Mapping]) -> Tuple[List[Mapping], List[int]]:
    """``records`` without the epoch figures of any step whose group lacks its last figure, and those epochs."""
    complete = {r["step"] for r in records if r["name"] == LAST_FIGURE}
    cut = {r["step"]: r.get("epoch") for r in records if _in_epoch_group(r["name"]) and r["step"] not in complete}
    if not cut:
        return records, []
    kept = [r for r in records if not (r["step"] in cut and _in_epoch_group(r["name"]))]
    return kept, sorted({epoch for epoch in cut.values() if epoch is not None})


def _whole_run_rate(column, seconds_of: Mapping[int, float], last: Optional[float]) -> Optional[float]:
    """A per-epoch rate (samples/s, tokens/s, MFU; its ``(steps, values)``) over the whole run, each epoch weighed
    by the seconds its steps took (``seconds_of``: ``train/speed/seconds`` by step); ``last`` (the last epoch's)
    for a file recorded without them."""
    measured = [(step, value) for step, value in zip(*column) if value == value]  # (NaN: not measured)
    if not measured or any(seconds_of.get(step, 0) <= 0 for step, _ in measured):
        return last
    return sum(value * seconds_of[step] for step, value in measured) / sum(seconds_of[step] for step, _ in measured)
