"""What ``ProfilerHook`` costs a training step: idle (before its cycle or after it), recording, and the end of a
recorded cycle (the profiler stops, gathers its events and writes the trace).

Each round runs three ``fit`` calls of ``--steps`` optimizer steps on one shared model, in turn: no profiler,
``ProfilerHook`` whose cycle never comes (``skip_first`` past the run: the cost of ``prof.step()`` and the
``ProfilerStep`` mark on every step), and ``ProfilerHook`` recording every step after one warm-up step. A hook
that runs after every other one stamps the time at each step's end: the per-step figure is the mean over the
steps after the first ``SKIP`` (one warm-up, then recording) but the last; the end figure is the time the last
step took beyond that mean, with the rest of ``fit``: the profiler stops there. Figures are medians over the
rounds, and differences to the no-profiler fit of the same round. The trace's size is per recorded step.
Workload: MLP width-width-10, batch 64, SGD, fp32, CPU, one thread.

    python benchmarks/bench_profiler_hook.py [--width 512] [--steps 100] [--rounds 9] [--json]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from colossal_lite.engine.engine import Engine  # noqa: E402
from colossal_lite.trainer import Trainer  # noqa: E402
from colossal_lite.trainer.hooks import BaseHook, ProfilerHook  # noqa: E402
from colossal_lite.utils import get_dataloader  # noqa: E402

SKIP = 5  # steps left out of the per-step figure: the profiler's warm-up step and the first recorded ones
QUIET = logging.getLogger("bench_profiler_hook")
QUIET.setLevel(logging.WARNING)


class Stamps(BaseHook):
    def __init__(self):
        super().__init__(priority=10 ** 6)
        self.times = []

    def after_train_iter(self, trainer, *args):
        if trainer.state.stepped:
            self.times.append(time.perf_counter())


def one_fit(engine, loader, steps: int, hook):
    """(seconds per step after ``SKIP`` steps, seconds from the end of the last step but one to the end of
    ``fit``, less one step: the stop at the run's last step, where the profiler ends its recording)."""
    stamps = Stamps()
    Trainer(engine).fit(loader, max_steps=steps, hooks=[stamps] + ([hook] if hook is not None else []))
    end = time.perf_counter()
    t = stamps.times[:-1]  # the last step's stamp comes after the profiler stopped (the run's last step)
    step = (t[-1] - t[SKIP]) / (len(t) - 1 - SKIP)
    return step, end - t[-1] - step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, 10))
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.01), nn.CrossEntropyLoss(), verbose=False)
    data = TensorDataset(torch.randn(64 * args.steps, args.width), torch.randint(0, 10, (64 * args.steps,)))
    loader = get_dataloader(data, batch_size=64)
    per_step = {"none": [], "idle": [], "recording": []}
    ends = {"none": [], "idle": [], "recording": []}
    sizes = []
    with tempfile.TemporaryDirectory() as folder:
        for r in range(args.rounds):
            hooks = {"none": None,
                     "idle": ProfilerHook(wait=0, warmup=1, active=1, dir=folder, skip_first=10 ** 9, logger=QUIET),
                     "recording": ProfilerHook(wait=0, warmup=1, active=args.steps, dir=f"{folder}/{r}", logger=QUIET)}
            for name, hook in hooks.items():
                step, end = one_fit(engine, loader, args.steps, hook)
                per_step[name].append(step)
                ends[name].append(end)
            sizes.append(os.path.getsize(hooks["recording"].trace_files[-1]))

    def over_none(values):
        return {k: round(statistics.median([a - b for a, b in zip(v, values["none"])]) * 1e6, 1)
                for k, v in values.items() if k != "none"}

    result = {
        "per_step_us": {k: round(statistics.median(v) * 1e6, 1) for k, v in per_step.items()},
        "per_step_over_none_us": over_none(per_step),
        "end_of_fit_over_none_us": over_none(ends),
        "trace_kb_per_step": round(statistics.median(sizes) / 1024 / (args.steps - 1), 1),
        "steps": args.steps, "rounds": args.rounds, "width": args.width,
    }
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
