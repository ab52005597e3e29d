"""SpeedReportHook: throughput and MFU in the history, the metrics file and the logs; where the time went, proved by
injected bottlenecks (each report names its cause first); ``colossal-lite report`` reads the same from the file."""
import json
import logging
import re
import time
import warnings

import pytest
import torch
from hook_helpers import crash_at
from sync_counter import count_syncs
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import colossal_lite
import colossal_lite.engine.batch as batch_module
from colossal_lite.cli import main as cli_main
from colossal_lite.core.global_context import global_context as gpc
from colossal_lite.trainer import Trainer
from colossal_lite.trainer._timeline import DeviceClock, HostClock, Timeline
from colossal_lite.trainer.history import is_measured
from colossal_lite.trainer.hooks import (
    BaseHook,
    LogMetricByEpochHook,
    LogMetricByStepHook,
    LossHook,
    SaveCheckpointHook,
    SpeedReportHook,
    ThroughputHook,
)
from colossal_lite.trainer.hooks._speed import SyncWatch, sync_site
from colossal_lite.trainer.speed_report import SpeedFigures, figures_from_records, format_report, rank_causes
from colossal_lite.utils.metrics_file import read_metrics

PEAK = 1.0  # TFLOP/s given to the hook, so no CPU peak is measured in these tests
FLOPS = 1000.0  # training FLOPs per sample given to the hook in the fast tests (see COUNTS)
#: Counting the FLOPs runs the model under torch dispatch modes, whose first use in a process imports torch's
#: compiler front end (seconds): the tests that count are in the slow tier.
COUNTS = pytest.mark.slow


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: on a shared machine two threads spin against each other and a tiny step's time is
    then mostly waiting, which no report should be asked to explain."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_data(n=32, features=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, features, generator=g), torch.randint(0, 2, (n,), generator=g))


class SlowData(torch.utils.data.Dataset):
    """A dataset whose every sample takes ``delay`` seconds to read."""

    def __init__(self, n=16, delay=0.01):
        self.data, self.delay = make_data(n), delay

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        time.sleep(self.delay)
        return self.data[i]


class SleepyHook(BaseHook):
    def __init__(self, delay=0.05):
        super().__init__()
        self.delay, self.slept = delay, []  # seconds each call really took

    def after_train_iter(self, trainer, *args):
        start = time.perf_counter()
        time.sleep(self.delay)
        self.slept.append(time.perf_counter() - start)


#: The events a training run fires on every micro-step or epoch (``CountingHook`` counts them).
COUNTED_EVENTS = ("before_train_epoch", "after_train_epoch", "before_train_iter", "before_zero_grad",
                  "after_batch_loaded", "before_forward", "after_forward", "after_loss", "before_backward",
                  "after_backward", "before_optimizer_step", "after_optimizer_step", "after_train_iter")


class CountingHook(BaseHook):
    """Counts its calls of each event in ``COUNTED_EVENTS``."""

    def __init__(self):
        super().__init__()
        self.calls = dict.fromkeys(COUNTED_EVENTS, 0)


for _name in COUNTED_EVENTS:
    def _count(self, trainer, *args, _name=_name):
        self.calls[_name] += 1
    setattr(CountingHook, _name, _count)


def build(model=None, data=None, batch_size=8, config=None):
    torch.manual_seed(0)
    model = model if model is not None else nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
    engine, loader, _, _ = colossal_lite.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
        DataLoader(data if data is not None else make_data(), batch_size=batch_size), verbose=False, config=config)
    return engine, loader


def fit(hooks, model=None, data=None, epochs=1, log_dir=False, count_flops=False, display=False, first=None,
        config=None, **kwargs):
    """A fit with ``SpeedReportHook`` first in the hooks (``first``: its ``breakdown_first``)."""
    engine, loader = build(model, data, config=config)
    speed = SpeedReportHook(peak_tflops=PEAK, report=False, flops_per_sample=None if count_flops else FLOPS, **kwargs)
    if first is not None:
        speed.breakdown_first = first
    trainer = Trainer(engine)
    trainer.fit(loader, epochs=epochs, hooks=[speed] + list(hooks), log_dir=log_dir, display_progress=display)
    return speed, trainer, engine


def users_step(engine):
    """A step of the user's own (``fit(step=...)``) that trains as the Trainer's own step does."""
    def step(trainer, batch):
        engine.zero_grad()
        loss = engine.criterion(engine(batch[0]), batch[1])
        engine.backward(loss)
        engine.step()
        return loss
    return step


def first_cause(speed):
    return rank_causes(speed.figures)[0]


# -- injected bottlenecks: each report names its cause first ----------------------------------------------------
def test_a_loader_that_sleeps_is_named_first():
    speed, _, _ = fit([LossHook()], data=SlowData(n=16, delay=0.01))
    cause = first_cause(speed)
    assert cause.key == "data", format_report(speed.figures)
    assert "num_workers" in cause.suggestion and "pin_memory=True" in cause.suggestion
    assert cause.share > 0.5


def test_a_hook_that_sleeps_is_named_first_by_its_class():
    speed, _, _ = fit([LossHook(), SleepyHook()])
    cause = first_cause(speed)
    assert cause.key == "hook:SleepyHook", format_report(speed.figures)
    assert cause.what == "the hook SleepyHook"
    assert cause.suggestion.startswith("SleepyHook takes ") and "ms per step" in cause.suggestion
    assert speed.figures.seconds["hook:SleepyHook"] >= 4 * 0.05


@COUNTS
def test_many_tiny_layers_are_named_as_small_kernels_with_compile():
    layers = [m for _ in range(60) for m in (nn.Linear(4, 4), nn.Tanh())]
    speed, _, _ = fit([LossHook()], model=nn.Sequential(*layers, nn.Linear(4, 2)), count_flops=True)
    cause = first_cause(speed)
    assert cause.key == "small kernels", format_report(speed.figures)
    assert "compile=True" in cause.suggestion
    assert speed.flops.ops > 200  # counted once on meta tensors: forward and backward of 121 layers


def test_a_checkpoint_every_step_is_named_first(tmp_path):
    saver = SaveCheckpointHook(interval="1ba", checkpoint_dir=str(tmp_path / "ck"))
    speed, _, _ = fit([LossHook(), saver], model=nn.Sequential(nn.Linear(4, 256), nn.Tanh(), nn.Linear(256, 2)))
    cause = first_cause(speed)
    assert cause.key == "checkpoint", format_report(speed.figures)
    assert "async_save=True" in cause.suggestion and "less often" in cause.suggestion


# -- the figures a user reads -------------------------------------------------------------------------------------
def test_throughput_and_mfu_in_history_metrics_file_logs_and_the_cli_report(tmp_path, caplog, capsys):
    caplog.set_level(logging.INFO)
    logger = logging.getLogger("speed-test")
    speed, trainer, _ = fit([LossHook(), LogMetricByStepHook(), LogMetricByEpochHook(logger=logger), SleepyHook()],
                            epochs=2, log_dir=tmp_path, display=True)
    history = trainer.history
    sps = history["train/samples_per_s"]
    assert len(sps) == 2 and all(v > 0 for v in sps)
    assert len(history["train/samples_per_s_step"]) == 7  # one per optimizer step after the warm-up step
    # per step the history keeps the all-ranks figure only (the per-rank one and MFU are it times a constant)
    assert "train/mfu_step" not in history.names and "train/samples_per_s_per_rank_step" not in history.names
    assert history["train/samples_per_s_per_rank"] == sps  # one rank
    # MFU is the FLOPs per sample times the samples per second over the peak given
    mfu = history["train/mfu"][-1]
    assert mfu == pytest.approx(FLOPS * sps[-1] / (PEAK * 1e12), rel=1e-9)
    epoch_lines = [r.getMessage() for r in caplog.records if "/ Train]" in r.getMessage()]
    assert epoch_lines and "samples_per_s = " in epoch_lines[-1] and "mfu = " in epoch_lines[-1]
    assert "time/" not in epoch_lines[-1]  # the phase seconds stay out of the log line
    names = {r["name"] for r in read_metrics(tmp_path / "metrics.jsonl")}
    assert {"train/samples_per_s", "train/samples_per_s_step", "train/mfu", "train/time/data",
            "train/time/hook:SleepyHook", "train/speed/steps"} <= names
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[Epoch 1 / Train]")]
    assert progress and re.search(r" samples_per_s=[\d.e+]+ samples_per_s_per_rank=[\d.e+]+ mfu=", progress[-1])
    # the command line reads the same run and names the same first cause
    assert cli_main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Speed report: 7 optimizer steps on 1 rank(s)")  # (the first is the warm-up)
    lines = out.splitlines()
    assert "the hook SleepyHook" in lines[2], out
    assert figures_from_records(read_metrics(tmp_path / "metrics.jsonl")).steps == 7


def test_the_report_is_logged_at_the_end_of_fit(capsys):
    engine, loader = build(data=SlowData(n=24, delay=0.01))
    Trainer(engine).fit(loader, epochs=1, hooks=[SpeedReportHook(peak_tflops=PEAK, flops_per_sample=FLOPS),
                                                 LossHook()], log_dir=False)
    text = capsys.readouterr().out
    assert "Speed report: 2 optimizer steps on 1 rank(s)" in text  # (3 steps, the first one the warm-up)
    assert "waiting for data\n" in text and "-> data-bound: raise the DataLoader's num_workers" in text


def test_the_report_changes_no_parameter_or_buffer():
    """Training with the report on is bitwise the training without it (parameters and BatchNorm's buffers)."""
    def model():
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))
    _, _, with_report = fit([LossHook()], model=model(), epochs=2)
    engine, loader = build(model())
    Trainer(engine).fit(loader, epochs=2, hooks=[LossHook()], log_dir=False)
    for a, b in zip(with_report.unwrapped_model.state_dict().values(), engine.unwrapped_model.state_dict().values()):
        assert torch.equal(a, b)


def test_per_step_path_has_no_host_sync_with_the_report_on():
    """The syncs from package code do not grow with the steps: they are the epoch's reads only (the FLOPs,
    counted once on meta tensors, are given here: see COUNTS). The breakdown samples from the second step on, so
    its functions are put in place and taken out again many times."""
    def syncs(batches):
        with count_syncs() as calls:
            fit([LossHook(), LogMetricByStepHook()], data=make_data(8 * batches), epochs=2, first=1, breakdown_every=2)
        return {name: len(sites) for name, sites in calls.items()}
    assert syncs(3) == syncs(12)


# -- the sampled breakdown ----------------------------------------------------------------------------------------
def test_a_sampled_breakdown_calls_every_handler_once_and_trains_bitwise_the_same():
    """Switching the timed functions in and out between steps neither skips nor repeats a hook's handler, and
    the parameters and BatchNorm's buffers equal those of the same fit without the report."""
    def model():
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))
    accumulate = dict(gradient_accumulation=2)
    counted = CountingHook()
    speed, _, with_report = fit([LossHook(), counted], model=model(), data=make_data(8 * 40), epochs=2, first=2,
                                breakdown_every=3, config=accumulate)
    engine, loader = build(model(), make_data(8 * 40), config=accumulate)
    alone = CountingHook()
    Trainer(engine).fit(loader, epochs=2, hooks=[LossHook(), alone], log_dir=False)
    assert counted.calls == alone.calls and alone.calls["before_forward"] == 80
    assert alone.calls["after_optimizer_step"] == 40
    for a, b in zip(with_report.unwrapped_model.state_dict().values(), engine.unwrapped_model.state_dict().values()):
        assert torch.equal(a, b)
    # 39 steps after the warm-up: the first 2 timed, then about one in 3
    assert speed.figures.steps == 39 and 2 + 5 <= speed.figures.timed_steps <= 2 + 25, speed.figures.timed_steps


def test_a_sampled_breakdown_names_a_slow_hook_and_estimates_its_whole_time(tmp_path, capsys):
    """A hook that sleeps 5 ms every step, phases timed on about one step in four: the report still names it
    first, its seconds are the whole run's (the untimed steps' time shared out as the timed ones measured), and
    the headline says how many steps were timed; the metrics file gives the same to ``colossal-lite report``."""
    sleepy = SleepyHook(delay=0.005)
    speed, _, _ = fit([LossHook(), sleepy], data=make_data(8 * 40), first=2, breakdown_every=4, log_dir=tmp_path)
    figures = speed.figures
    assert first_cause(speed).key == "hook:SleepyHook", format_report(figures)
    assert figures.steps == 39 and figures.timed_steps < 30
    slept = sum(sleepy.slept[1:])  # (the first step is the warm-up)
    assert 0.6 * slept <= figures.seconds["hook:SleepyHook"] <= 1.6 * slept, (slept, format_report(figures))
    assert f"phases timed on {figures.timed_steps} of the 39 steps" in format_report(figures).splitlines()[0]
    assert figures_from_records(read_metrics(tmp_path / "metrics.jsonl")).timed_steps == figures.timed_steps


def test_the_cpu_peak_is_measured_once_per_process():
    """The matrix product runs once: a second fit's peak is the first one's to the bit (two measurements differ)."""
    from colossal_lite.utils.flops import peak_flops

    first = peak_flops(torch.device("cpu"), "fp32")
    start = time.perf_counter()
    assert peak_flops(torch.device("cpu"), "fp32") == first
    assert time.perf_counter() - start < 0.05  # (a measurement takes 0.2 s)


def test_measuring_the_cpu_peak_leaves_the_global_random_state_as_it_was():
    """The measurement's matrices come from a generator of its own: it drew from torch's global one, so adding
    ``SpeedReportHook()`` moved every later shuffle and dropout mask of the run (its parameters differed)."""
    from colossal_lite.utils.flops import measure_cpu_peak

    torch.manual_seed(3)
    before = torch.get_rng_state()
    assert measure_cpu_peak(seconds=0.01, size=64) > 0
    assert torch.equal(torch.get_rng_state(), before)


def test_tokens_per_second_with_the_per_token_reduction():
    gpc.destroy()
    colossal_lite.launch_from_torch(config=dict(grad_reduction="per-token-mean"), seed=0, verbose=False)
    try:
        def criterion(logits, y):  # every sample holds 5 real tokens
            loss = nn.functional.cross_entropy(logits, y, reduction="sum")
            return loss, torch.tensor(5.0 * y.shape[0])
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), criterion,
                                                        DataLoader(make_data(), batch_size=8), verbose=False)
        trainer = Trainer(engine)
        speed = SpeedReportHook(peak_tflops=PEAK, report=False, flops_per_sample=FLOPS)
        trainer.fit(loader, epochs=1, hooks=[speed, LossHook()], log_dir=False)

        own = Trainer(engine)  # the same training as a step of the user's own
        own_speed = SpeedReportHook(peak_tflops=PEAK, report=False, flops_per_sample=FLOPS)
        own.fit(loader, epochs=1, hooks=[own_speed, LossHook()], log_dir=False, step=users_step(engine))

        # automatic micro-batching counts each batch's tokens as a fixed accumulation does (it counted none)
        auto_engine, auto_loader, _, _ = colossal_lite.initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.1), criterion, DataLoader(make_data(), batch_size=8),
            config=dict(gradient_accumulation="auto"), verbose=False)
        auto = Trainer(auto_engine)
        auto.fit(auto_loader, epochs=1, hooks=[SpeedReportHook(peak_tflops=PEAK, report=False,
                                                               flops_per_sample=FLOPS)], log_dir=False)
    finally:
        gpc.destroy()
    assert auto.history["train/tokens_per_s"][-1] == pytest.approx(5 * auto.history["train/samples_per_s"][-1],
                                                                   rel=1e-6)
    # a step of the user's own fires no backward event, where the window's tokens are read: no token figures
    # rather than a count of none
    assert not any(name.startswith("train/tokens") for name in own.history.names), own.history.names
    assert own_speed.figures.tokens_per_s is None and own.history["train/samples_per_s"]
    h = trainer.history
    assert h["train/tokens_per_s"][-1] == pytest.approx(5 * h["train/samples_per_s"][-1], rel=1e-6)
    steps = h["train/tokens_per_s_step"]
    assert steps == pytest.approx([5 * v for v in h["train/samples_per_s_step"]], rel=1e-5)
    assert speed.figures.tokens_per_s == pytest.approx(5 * speed.figures.samples_per_s, rel=1e-6)


def test_bad_options_say_what_to_give():
    with pytest.raises(ValueError, match=r"peak_tflops=-1\): give the device's dense peak in TFLOP/s"):
        SpeedReportHook(peak_tflops=-1)
    with pytest.raises(ValueError, match=r"flops_per_sample='x'\): give the training FLOPs of one sample"):
        SpeedReportHook(flops_per_sample="x")
    with pytest.raises(ValueError, match=r"warmup_steps=-1\): give the optimizer steps to leave out at the start "
                                         r"of fit as an int >= 0"):
        SpeedReportHook(warmup_steps=-1)
    # twice in one fit: each would take the run's event points over, and the first would measure nothing
    engine, loader = build()
    with pytest.raises(ValueError, match=r"SpeedReportHook is in fit's hooks more than once: keep one"):
        Trainer(engine).fit(loader, epochs=1, hooks=[SpeedReportHook(peak_tflops=PEAK), SpeedReportHook(peak_tflops=PEAK)],
                            log_dir=False)


def test_cli_report_of_a_run_without_the_hook_says_how_to_record_one(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "epoch": 0, "name": "train/Loss", "value": 1.0,
                                                        "time": None}) + "\n")
    assert cli_main(["report", str(tmp_path)]) == 1
    assert "run fit with hooks=[SpeedReportHook()] to record one" in capsys.readouterr().err


def epoch_records(step, epoch, samples_per_s, cut_after=None):
    """The records one epoch's end writes with the breakdown on, in the order the hook records them (cut after
    ``cut_after`` of them: a run stopped while writing its metrics file)."""
    figures = [("train/Loss", 0.5), ("train/samples_per_s", samples_per_s), ("train/mfu", 1e-5),
               ("train/time/data", 0.25), ("train/time/forward", 0.5), ("train/speed/steps", 8.0),
               ("train/speed/seconds", 1.0), ("train/speed/world_size", 1.0), ("train/speed/peak_tflops", 0.1)]
    return [{"step": step, "epoch": epoch, "name": name, "value": value, "time": None}
            for name, value in figures[:cut_after]]


def test_cli_report_of_a_file_cut_inside_an_epochs_figures_leaves_that_epoch_out(tmp_path, capsys):
    """It reported '0 optimizer steps ... 1717 samples/s, MFU ... (peak )' from the cut epoch's first figures."""
    def write(records):
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    write(epoch_records(8, 0, 1000.0) + epoch_records(16, 1, 3000.0, cut_after=5))
    assert cli_main(["report", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("Speed report: 8 optimizer steps on 1 rank(s), 1000 samples/s (1000 per rank), MFU 0.001% "
                        "(peak 100 GFLOP/s)")  # epoch 0's alone
    assert lines[1] == ("  (left out: the figures of epoch 1, which the metrics file holds only in part (the run "
                        "stopped while writing them); the report covers the epochs recorded whole)")
    write(epoch_records(8, 0, 1000.0, cut_after=5))
    assert cli_main(["report", str(tmp_path)]) == 1
    assert capsys.readouterr().err == (f"error: {tmp_path}: the metrics file stops inside the speed figures of epoch 0 "
                                       f"(the run stopped while writing them) and holds no epoch's figures whole: "
                                       f"nothing to report\n")


@pytest.mark.parametrize("rows, why", [("0", "the report lists 1 cause or more, got '0'"),
                                       ("-2", "the report lists 1 cause or more, got '-2'"),
                                       ("x", "expected a whole number of causes to list, such as 6; got 'x'")])
def test_cli_report_refuses_rows_below_one(tmp_path, capsys, rows, why):
    with pytest.raises(SystemExit) as caught:
        cli_main(["report", str(tmp_path), "--rows", rows])
    assert caught.value.code == 2 and f"argument --rows: {why}" in capsys.readouterr().err


# -- the parts ----------------------------------------------------------------------------------------------------
def test_timeline_on_the_host_clock_gives_each_phase_its_time():
    timeline = Timeline(HostClock())
    timeline.switch("a")
    time.sleep(0.02)
    assert timeline.switch("b") == "a"
    middle = timeline.clock.mark()
    time.sleep(0.03)
    timeline.split(middle, "c")  # b ended at ``middle``; c ran since
    timeline.switch(None)
    totals = timeline.settle()
    assert 0.02 <= totals["a"] < 0.2 and totals["b"] < 0.01 and 0.03 <= totals["c"] < 0.2
    assert timeline.settle() is totals and totals["a"] == totals["a"]  # settled spans are not counted twice


def test_a_long_epoch_keeps_a_bounded_number_of_marks_and_reuses_none_still_in_use():
    """The spans of an epoch were all kept until its end (one a step: on a GPU, a CUDA event each; found by the
    memory probe). Past ``Timeline.cap`` the spans the device has finished are read without waiting; a mark a span
    not yet read or the running phase uses is never handed back for reuse. The device is a clock whose marks are
    done once the host is ``lag`` marks past them (CUDA cannot run here): 40 behind, then caught up."""

    class Lagging(HostClock):
        def __init__(self):
            self.made, self.free, self.lag = 0, [], 40

        def mark(self):
            self.made += 1
            return (self.made, float(self.made))

        def done(self, mark):
            return mark[0] <= self.made - self.lag

        def seconds(self, start, end):
            return end[1] - start[1]

        def release(self, spans, keep):
            kept = {id(m) for m in keep}
            released = [m for _, a, b in spans for m in (a, b) if id(m) not in kept]
            assert not kept & {id(m) for m in released}
            assert all(m not in (a, b) for m in released for _, a, b in timeline._spans), "a mark in use was freed"
            self.free += released

    timeline = Timeline(Lagging())
    peak = 0
    for i in range(3000):
        timeline.clock.lag = 40 if i < 1500 else 0
        timeline.switch("ab"[i % 2])
        peak = max(peak, len(timeline._spans))
        assert all(m is not timeline._start for m in timeline.clock.free), "the running phase's start was freed"
    assert peak <= Timeline.cap + 1 and timeline.clock.free
    totals = timeline.settle()
    assert totals["a"] + totals["b"] == 2999.0  # every span read once: the marks are 1 apart


def test_a_device_clock_reuses_each_read_mark_once_and_never_the_running_phases_start():
    class Watched(HostClock):  # the host clock, telling what the timeline hands back
        released = []

        def release(self, spans, keep):
            self.released.append((list(spans), list(keep)))

    timeline = Timeline(Watched())
    for phase in ("a", "b", "c"):
        timeline.switch(phase)
    timeline.settle()
    (spans, keep), = Watched.released
    assert [phase for phase, _, _ in spans] == ["a", "b"] and keep == [spans[-1][2]]  # c runs from there
    clock = DeviceClock(torch.device("cuda"))  # (no CUDA call until a mark is made: these marks stand in for events)
    marks = [object() for _ in range(4)]
    clock.release([("a", marks[0], marks[1]), ("b", marks[1], marks[2]), ("c", marks[2], marks[3])], [marks[3]])
    assert sorted(map(id, clock._free)) == sorted(map(id, marks[:3]))  # each once; the open one is still in use


def test_causes_are_ranked_with_one_suggestion_each():
    figures = SpeedFigures(seconds={"communication": 3.0, "forward": 1.0, "backward": 2.0, "hook:EMAHook": 0.5},
                           steps=10, micro_batches=10, world_size=2, samples_per_s=100.0)
    causes = rank_causes(figures)
    assert [c.key for c in causes] == ["communication", "backward", "forward", "hook:EMAHook"]
    assert causes[0].share == pytest.approx(3.0 / 6.5)
    assert "gradient_accumulation" in causes[0].suggestion and "bucket_cap_mb" in causes[0].suggestion
    assert causes[3].suggestion.startswith("EMAHook takes 50 ms per step")
    text = format_report(figures)
    assert text.splitlines()[0] == "Speed report: 10 optimizer steps on 2 rank(s), 100 samples/s (50 per rank)"


def test_the_librarys_own_parts_are_named_for_what_a_user_can_change():
    """What the first GPU run's report said in the library's own words: a sync at ``batch.py:19`` with "remove the
    .item()" (it was the copy of a batch from memory that is not pinned), and "the hook Recorder" (the Trainer's
    history, which the user never added)."""
    unpinned = sync_site(batch_module.__file__, 19)
    assert unpinned == "the batch's copy to the device from memory that is not pinned (batch.py:19)"
    assert sync_site("/home/me/train.py", 42) == "train.py:42"
    figures = SpeedFigures(seconds={"forward": 1.0, "hook:Recorder": 0.2}, steps=10, micro_batches=10, world_size=1,
                           samples_per_s=100.0, sync_sites=[f"{unpinned} (6x)", "train.py:42 (10x)"])
    causes = rank_causes(figures)
    assert [c.key for c in causes] == ["host syncs", "unpinned batch", "forward", "hook:Recorder"]
    assert causes[0].what == "host-device syncs on the step: train.py:42 (10x)" and ".item()" in causes[0].suggestion
    assert "(batch.py:19) (6x)" in causes[1].what and "pin_memory=True" in causes[1].suggestion
    assert causes[3].what == "the Trainer's metric history and trackers"
    assert causes[3].suggestion.startswith("the Trainer's metric history and trackers take 20 ms per step")
    assert "Recorder" not in format_report(figures)


class Recorder(SleepyHook):
    """A hook of the user's that has the name of the part the Trainer adds to every fit."""


def test_a_users_hook_named_as_the_trainers_own_part_is_timed_and_named_apart_from_it():
    speed, trainer, _ = fit([LossHook(), Recorder()])
    mine = f"hook:{__name__}.Recorder"
    seconds = speed.figures.seconds
    assert seconds[mine] >= 4 * 0.05 and seconds["hook:Recorder"] < 0.05, format_report(speed.figures)
    cause = first_cause(speed)
    assert cause.key == mine and cause.what == f"the hook {__name__}.Recorder", format_report(speed.figures)
    assert trainer.history[f"train/time/{mine}"] and sum(trainer.history["train/time/hook:Recorder"]) < 0.05


def _a_sync():
    warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)  # the sync debug mode's


def test_watching_for_syncs_keeps_every_other_warning():
    """The watch catches every warning to find the sync debug mode's (GPU runs only): the user's own, torch's and
    a checkpoint writer's were dropped for its steps (found by reading the CUDA-only paths). They are shown again
    when it stops, once each; the syncs are counted by line."""
    with pytest.warns(RuntimeWarning, match="the user's own warning") as shown:
        watch = SyncWatch()
        for _ in range(3):
            _a_sync()
            warnings.warn("the user's own warning", RuntimeWarning, stacklevel=1)
        assert not shown.list  # (held while the watch runs)
        counts = watch.stop()
    assert len([w for w in shown if "user's own" in str(w.message)]) == 1
    assert list(counts.values()) == [3] and next(iter(counts)).startswith("test_speed_report.py:")


def test_a_fit_too_short_to_measure_a_step_says_so_instead_of_ranking_its_end():
    """A fit of one optimizer step has only the warm-up, which is left out: the report says how to measure it,
    rather than ranking what was timed outside any step (its end) as where the run's time went."""
    for warmup in (1, 0):
        engine, loader = build()
        speed = SpeedReportHook(peak_tflops=PEAK, report=False, flops_per_sample=FLOPS, warmup_steps=warmup)
        Trainer(engine).fit(loader, max_steps=1, hooks=[speed, LossHook()], log_dir=False)
        assert speed.figures.steps == 1 - warmup, speed.report_text
        if warmup:
            assert len(speed.report_text.splitlines()) == 2, speed.report_text
            assert "no optimizer step measured" in speed.report_text and "warmup_steps=0" in speed.report_text
        else:
            assert "where the time went" in speed.report_text


@COUNTS
def test_the_docs_example_runs_and_names_the_loader(tmp_path, monkeypatch, capsys):
    from dist_helpers import doc_python_blocks

    (snippet,) = [block for block in doc_python_blocks("docs/throughput.md") if "SpeedReportHook()" in block]
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet, "docs/throughput.md", "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out
    assert "first cause: data" in out and "Speed report: 7 optimizer steps on 1 rank(s)" in out
    assert cli_main(["report", "run"]) == 0
    assert capsys.readouterr().out.splitlines()[2].endswith("waiting for data")


def test_the_bar_shortens_the_throughput_names():
    from colossal_lite.trainer.progress import info_candidates

    full, compact = list(info_candidates("10 batch/s", "", {"samples_per_s": 12345.6, "tokens_per_s_per_rank": 3.5}))[:2]
    assert full == "10 batch/s samples_per_s=12346 tokens_per_s_per_rank=3.5"
    assert compact == "10 batch/s samples/s=12346 tokens/s/rank=3.5"


def test_two_runs_of_the_same_training_differ_only_in_the_clock_measured_values():
    """``History.without_measured()`` compares two runs: what it leaves out (``MEASURED_NAMES``) is every value that
    a clock measured, and only those (the counts of steps, micro-batches and FLOPs stay in)."""
    runs = [fit([LossHook(), ThroughputHook()], epochs=2)[1].history for _ in range(2)]
    assert runs[0].without_measured() == runs[1].without_measured()  # (no NaN record: NaN != NaN)
    assert len(runs[0].epochs) == 2  # (the end of fit's record of the time after the epochs has no epoch of its own)
    assert "train/speed/ops_per_micro_batch" not in runs[0]  # (the FLOPs were given: no operators counted)
    names = set(runs[0].names)
    measured = {name for name in names if is_measured(name)}
    assert {"train/time/forward", "train/samples_per_s_step", "train/samples_per_s_per_rank", "train/mfu",
            "train/speed/peak_tflops", "train/Throughput", "train/time_after_epochs/loop"} <= measured
    assert {"train/Loss_step", "train/speed/world_size", "train/speed/flops_per_micro_batch"} <= names - measured
    differ = {name for name in measured if runs[0].series(name) != runs[1].series(name)}
    assert {"train/time/forward", "train/samples_per_s_step"} <= differ


@pytest.mark.slow  # (three fits with checkpoints: a few seconds)
def test_a_resumed_run_with_the_report_shares_all_but_the_measured_values_with_the_uninterrupted_one(tmp_path):
    """The step counts the figures cover restart at a resume (its first step is a warm-up again), so they are
    measured values too: without them, and the clocks', a resumed run's history is the uninterrupted run's."""
    def run(folder, *extra, **kwargs):
        engine, loader = build()  # (the same seed each time: the same model, data and order)
        speed = SpeedReportHook(peak_tflops=PEAK, report=False, flops_per_sample=FLOPS)
        trainer = Trainer(engine)
        trainer.fit(loader, epochs=2, hooks=[speed, LossHook(), SaveCheckpointHook("2ba", folder), *extra],
                    log_dir=False, **kwargs)
        return trainer

    reference = run(tmp_path / "ref").history
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(tmp_path / "run", crash_at(7))
    resumed = run(tmp_path / "run", resume_from="last")
    assert resumed.restored_from.name == "epoch1-step6"  # inside the second epoch: its counts restarted
    assert resumed.history.series("train/speed/steps")[-1][1] < reference.series("train/speed/steps")[-1][1]
    assert resumed.history.without_measured() == reference.without_measured()


def test_a_step_of_the_users_own_is_one_phase_named_as_such():
    """``fit(step=...)`` fires no events between its forward, backward and optimizer step: the report names the
    step function as one phase instead of calling all of it "forward and loss"."""
    engine, loader = build()

    def train(trainer, batch):
        x, y = batch
        engine.zero_grad()
        time.sleep(0.01)
        loss = engine.criterion(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss

    speed = SpeedReportHook(peak_tflops=PEAK, report=False, flops_per_sample=FLOPS)
    trainer = Trainer(engine)
    trainer.fit(loader, epochs=1, hooks=[speed, LossHook()], step=train, log_dir=False)
    assert trainer.user_step is None  # (after fit: no step runs)
    assert first_cause(speed).key == "step", speed.report_text
    assert speed.figures.seconds.keys().isdisjoint({"forward", "backward", "optimizer"}), speed.figures.seconds
    assert "your step function (fit(step=...)" in speed.report_text


class SlowForward(nn.Sequential):
    """A small MLP whose forward takes ``delay`` seconds more."""

    def __init__(self, delay=0.005):
        super().__init__(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
        self.delay = delay

    def forward(self, x):
        time.sleep(self.delay)
        return super().forward(x)


def test_automatic_micro_batching_is_one_phase_named_as_such(tmp_path, capsys):
    """``gradient_accumulation='auto'`` runs forward, loss and backward as one retriable unit that fires no event
    inside: the report names the three as one phase (it called all of it "forward and loss"), and so does the
    command line from the metrics file."""
    speed, trainer, _ = fit([LossHook()], model=SlowForward(), config=dict(gradient_accumulation="auto"),
                            log_dir=tmp_path, breakdown_every=1)
    assert trainer.engine.auto_batcher is not None
    assert first_cause(speed).key == "auto", speed.report_text
    assert speed.figures.seconds.keys().isdisjoint({"forward", "backward", "step"}), speed.figures.seconds
    assert "forward, loss and backward (gradient_accumulation='auto'" in speed.report_text
    assert cli_main(["report", str(tmp_path)]) == 0
    assert "forward, loss and backward (gradient_accumulation='auto'" in capsys.readouterr().out.splitlines()[2]


class SlowSave(SaveCheckpointHook):
    """Saves at each epoch's end, 50 ms longer (its own handler's time): timed after the epoch's own record."""

    def on_save_checkpoint(self, trainer, checkpoint):
        time.sleep(0.05)


def test_the_cli_report_is_the_fits_own_including_a_save_at_the_last_epochs_end(tmp_path, capsys):
    """The command line's headline is the whole fit's throughput and MFU (it showed the last epoch's), and its
    table holds the checkpoint saved at the last epoch's end, timed after that epoch's record (it lost it)."""
    # (the epochs' rates differ, the last not the fit's; by a sleep long enough that a loaded machine's slower steps
    # do not even them out: with 4 ms the last epoch was faster than the fit by less than the 1.5 asked, at load 6)
    model = SlowForward(delay=0.02)

    class FasterAfterTheFirstEpoch(BaseHook):
        def after_train_epoch(self, trainer):
            model.delay = 0.0

    speed, trainer, _ = fit([SlowSave(1, str(tmp_path / "ck")), FasterAfterTheFirstEpoch()], model=model, epochs=2,
                            log_dir=tmp_path, breakdown_every=1)
    fit_figures = speed.figures
    assert trainer.history["train/samples_per_s"][-1] > 1.5 * fit_figures.samples_per_s
    read = figures_from_records(read_metrics(tmp_path / "metrics.jsonl"))
    assert read.samples_per_s == pytest.approx(fit_figures.samples_per_s, rel=1e-9)
    assert read.mfu == pytest.approx(fit_figures.mfu, rel=1e-9)
    assert (read.steps, read.micro_batches) == (fit_figures.steps, fit_figures.micro_batches)
    for phase in ("checkpoint", "hook:SlowSave"):
        assert read.seconds[phase] == pytest.approx(fit_figures.seconds[phase], rel=1e-6), phase
    assert fit_figures.seconds["hook:SlowSave"] > 0.09  # both saves, each 50 ms longer (the hook's own time)
    assert sum(trainer.history["train/time/hook:SlowSave"]) < 0.06  # the epochs' records hold the first only
    capsys.readouterr()
    assert cli_main(["report", str(tmp_path)]) == 0
    headline = capsys.readouterr().out.splitlines()[0]  # (up to the peak's note: the file holds its value only)
    assert headline.split(" (peak ")[0] == speed.report_text.splitlines()[0].split(" (peak ")[0], headline


def test_a_preempted_epoch_is_recorded_for_the_cli_report(tmp_path):
    """Preemption ends a fit inside an epoch, which then makes no record of its own: its figures are recorded at
    the fit's end, so the command line reads the steps that ran (it said the run had no speed breakdown)."""
    from hook_helpers import sigterm_at

    from colossal_lite.trainer.checkpointing import TrainingPreempted
    engine, loader = build()
    speed = SpeedReportHook(peak_tflops=PEAK, report=False, flops_per_sample=FLOPS)
    trainer = Trainer(engine)
    with pytest.raises(TrainingPreempted):
        trainer.fit(loader, epochs=1, hooks=[speed, SaveCheckpointHook("2ba", str(tmp_path / "ck")), sigterm_at(3)],
                    log_dir=tmp_path)
    assert trainer.state.step == 3 and speed.figures.steps == 2  # (the first is the warm-up)
    read = figures_from_records(read_metrics(tmp_path / "metrics.jsonl"))
    assert read.steps == 2 and read.samples_per_s == pytest.approx(speed.figures.samples_per_s, rel=1e-9)


def test_a_step_of_the_users_own_counts_each_batchs_samples():
    """``fit(step=...)`` counted one sample per batch (the batch size was read from the engine's schedule, which
    the user's step does not load through), so samples/s and MFU were too low by the batch size; it cannot count
    the FLOPs of a step it does not run, and says so."""
    engine, loader = build()
    train = users_step(engine)
    trainer = Trainer(engine)
    speed = SpeedReportHook(peak_tflops=PEAK, report=False, flops_per_sample=FLOPS)
    trainer.fit(loader, epochs=1, hooks=[speed], step=train, log_dir=False)
    h = trainer.history
    assert h["train/samples_per_s"][-1] * h["train/speed/seconds"][-1] == pytest.approx(24)  # 3 steps of 8
    counted = SpeedReportHook(peak_tflops=PEAK, report=False)
    Trainer(engine).fit(loader, epochs=1, hooks=[counted], step=train, log_dir=False)
    assert counted.figures.mfu is None and "a step of your own" in counted.figures.peak_note


def test_an_epoch_with_no_measured_step_reads_n_a_in_the_log_line(caplog):
    caplog.set_level(logging.INFO)
    fit([LogMetricByEpochHook(logger=logging.getLogger("speed-na"))], data=make_data(n=8))  # one step: the warm-up
    (line,) = [r.getMessage() for r in caplog.records if "/ Train]" in r.getMessage()]
    assert "samples_per_s = n/a" in line and "mfu = n/a" in line and "nan" not in line, line


def test_test_mode_with_the_report_leaves_the_history_as_it_was(tmp_path):
    """The report records the time after the last epoch's record at the end of every fit; test mode records
    nothing (it added ten ``train/time_after_epochs/*`` records)."""
    engine, loader = build()
    trainer = Trainer(engine)
    speed = SpeedReportHook(peak_tflops=PEAK, report=False, flops_per_sample=FLOPS)
    trainer.fit(loader, epochs=1, hooks=[speed, LossHook(), SaveCheckpointHook("1ba", str(tmp_path / "ck"))],
                test_mode=True, log_dir=False)
    assert trainer.test_mode_result.ok and len(trainer.history) == 0, trainer.history.names


class SequenceFirst(nn.Module):
    """word_language_model's layout: inputs ``[T, B, F]``, one label per sequence (``[B]``)."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(x.mean(0))


def sequence_first(samples):
    x = torch.stack([s[0] for s in samples])  # [B, F]
    return x.unsqueeze(0).expand(20, *x.shape).contiguous(), torch.stack([s[1] for s in samples])  # [20, B, F], [B]


def test_a_sequence_first_batch_counts_its_sequences_as_the_loss_weighs_them():
    """The samples of a batch are its label's rows (as ``LossHook`` weighs the loss), not the first dimension of
    the first input: 8 sequences of 20 steps are 8 samples, not 20."""
    torch.manual_seed(0)
    model = SequenceFirst()
    engine, loader, _, _ = colossal_lite.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
        DataLoader(make_data(), batch_size=8, collate_fn=sequence_first), verbose=False)
    speed = SpeedReportHook(peak_tflops=PEAK, report=False, flops_per_sample=FLOPS, warmup_steps=1)
    Trainer(engine).fit(loader, epochs=1, hooks=[speed], display_progress=False)
    assert speed.flops.samples == 8  # the first micro-batch, as the FLOPs per sample are counted
    assert speed.flops.flops == FLOPS * 8
    totals = speed._fit
    totals.add(speed._epoch_totals)
    assert totals.samples == 3 * 8  # 4 steps of 8 sequences, the warm-up step left out


class OwnLoss(nn.Module):
    """A model that computes its own loss (no criterion), returned in a dict as Hugging Face models return it."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))

    def forward(self, x):
        out = self.net(x)
        return {"loss": out.pow(2).mean(), "logits": out}


@COUNTS
def test_a_model_that_computes_its_own_loss_gets_its_flops_counted():
    from colossal_lite.utils.flops import count_step_flops

    torch.manual_seed(0)
    model = OwnLoss()
    engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), None,
                                                    DataLoader(make_data(), batch_size=8), verbose=False)
    speed = SpeedReportHook(peak_tflops=PEAK, report=False)
    Trainer(engine).fit(loader, epochs=1, hooks=[speed], display_progress=False)
    assert not speed.flops_note, speed.flops_note
    x, y = make_data()[:8]
    by_hand = count_step_flops(model, x, y, lambda out, label: out["loss"], 8)
    assert speed.flops is not None and speed.flops.flops == by_hand.flops > 0
    assert speed.figures.mfu is not None


def test_operators_that_take_milliseconds_are_not_called_small_kernels():
    """A forward that spends its time outside arithmetic (Python, a sleep, memory traffic) has few FLOPs per
    operator, yet its operators are not waiting on their launches: the report names the phase, not compile=True."""
    figures = SpeedFigures(seconds={"forward": 0.2, "backward": 0.05, "data": 0.01}, steps=10, micro_batches=10,
                           ops_per_micro_batch=8, flops_per_micro_batch=1e3, peak_flops=1e12)
    assert first_cause_of(figures).key == "forward"
    tiny = SpeedFigures(seconds={"forward": 0.002, "backward": 0.002, "data": 0.0001}, steps=10, micro_batches=10,
                        ops_per_micro_batch=200, flops_per_micro_batch=1e3, peak_flops=1e12)
    assert first_cause_of(tiny).key == "small kernels"


def first_cause_of(figures):
    return rank_causes(figures)[0]
