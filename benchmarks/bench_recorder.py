"""The Trainer's history recorder on its own: the Python its event handlers run per optimizer step (timed).

``bench_engine.py`` measures what recording the history adds to ``fit`` (paired against the same code with the
recorder taken out); this script times the recorder's own calls in one process, so the two together tell how much
of that cost is its Python and how much is elsewhere (memory, the held device values). It drives a real
``Recorder`` with one per-step metric (a 0-dim CPU tensor per step, as ``LossHook`` gives) and the LR, for
``--steps`` optimizer steps, flushing every ``Recorder.flush_every`` steps as ``fit`` does; then the parts alone
(``StepSeries`` with a tensor and with a float, ``History.add_values`` with two names). Medians of ``--runs``.

    python benchmarks/bench_recorder.py [--steps 2560] [--runs 5]
"""
from __future__ import annotations

import argparse
import statistics
import time
import types

import torch

from colossal_lite.trainer._recorder import Recorder
from colossal_lite.trainer._series import StepSeries, drain_series
from colossal_lite.trainer.history import History


class _StepMetric:
    """A train metric with a device value per step (what the recorder reads from ``LossMetric``)."""

    epoch_only = False
    value = None

    def last_step_value(self):
        return self.value


def recorder_us(steps: int) -> float:
    """us per optimizer step in ``after_optimizer_step`` + ``after_train_iter`` (flushes included)."""
    recorder, metric = Recorder(History()), _StepMetric()
    recorder._step_metrics = [(metric, StepSeries(recorder.flush_every, "train/Loss_step"))]
    recorder._optimizer = types.SimpleNamespace(param_groups=[{"lr": 0.1}])
    recorder._device = torch.device("cpu")
    state = types.SimpleNamespace(step=0, epoch=0, stepped=True)
    trainer = types.SimpleNamespace(state=state)
    values = [torch.tensor(float(i)) for i in range(steps)]
    start = time.perf_counter_ns()
    for i in range(steps):
        metric.value, state.step = values[i], i + 1
        recorder.after_optimizer_step(trainer)
        recorder.after_train_iter(trainer, None, None, None)
    recorder.flush()
    return (time.perf_counter_ns() - start) / steps / 1e3


def series_us(steps: int, value) -> float:
    """us per step of ``StepSeries.add`` and its share of the drains."""
    series = StepSeries(Recorder.flush_every, "x")
    start = time.perf_counter_ns()
    for i in range(steps):
        if series.add(value, i):
            drain_series([series])
    drain_series([series])
    return (time.perf_counter_ns() - start) / steps / 1e3


def history_us(steps: int) -> float:
    """us per step of ``History.add_values`` with the two per-step names."""
    history = History()
    start = time.perf_counter_ns()
    for i in range(steps):
        history.add_values(i, 0, 1.0, {"train/Loss_step": 0.5, "lr": 0.1})
    return (time.perf_counter_ns() - start) / steps / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2560, help="optimizer steps per run")
    parser.add_argument("--runs", type=int, default=5, help="runs; the medians are reported")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = {"recorder (after_optimizer_step + after_train_iter, flushes included)": lambda: recorder_us(args.steps),
            "StepSeries.add + drain, a 0-dim tensor": lambda: series_us(args.steps, torch.tensor(1.0)),
            "StepSeries.add + drain, a float": lambda: series_us(args.steps, 0.1),
            "History.add_values, two names": lambda: history_us(args.steps)}
    for measure in rows.values():
        measure()  # warm-up
    for name, measure in rows.items():
        runs = [measure() for _ in range(args.runs)]
        print(f"{name}: {statistics.median(runs):.2f} us per optimizer step "
              f"(runs {min(runs):.2f}..{max(runs):.2f})")


if __name__ == "__main__":
    main()
