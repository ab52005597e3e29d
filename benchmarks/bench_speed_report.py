"""What ``SpeedReportHook`` costs ``fit``: throughput against the hand-written PyTorch loop, report off and on.

Four contestants train the same MLP on the same batches, one after another in each round (interleaved, so a
noisy machine slows them alike): the hand loop (``zero_grad``, forward, ``cross_entropy``, ``backward``,
``step``), ``Trainer.fit`` with ``LossHook`` only, the same with ``SpeedReportHook(breakdown=False)``
(throughput and MFU), and with ``SpeedReportHook()`` (the phase breakdown too). Steps per second are timed
over each fit after a warm-up fit; the medians of ``--rounds`` and each Trainer's median ratio to the hand loop
of the same round (and to the fit with ``LossHook`` only) are printed, then the peak resident memory of the process (ru_maxrss) after all of them.

    python benchmarks/bench_speed_report.py [--rounds 7] [--steps 200] [--width 256]
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time
from typing import Callable, Dict, List

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import colossal_lite
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import LossHook, SpeedReportHook


def make(width: int, steps: int, batch: int = 32):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
    data = TensorDataset(torch.randn(steps * batch, width), torch.randint(0, 10, (steps * batch,)))
    return model, DataLoader(data, batch_size=batch)


def hand(width: int, steps: int) -> float:
    model, loader = make(width, steps)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = time.perf_counter()
    for x, y in loader:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return steps / (time.perf_counter() - start)


def trainer(width: int, steps: int, hooks: Callable[[], List]) -> float:
    model, loader = make(width, steps)
    engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.01),
                                                    nn.CrossEntropyLoss(), loader, verbose=False)
    start = time.perf_counter()
    Trainer(engine).fit(loader, epochs=1, hooks=hooks(), log_dir=False)
    return steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    quiet = dict(report=False, peak_tflops=1.0)  # (no CPU peak measured inside the timed fit)
    contestants: Dict[str, Callable[[], float]] = {
        "hand loop": lambda: hand(args.width, args.steps),
        "fit, LossHook": lambda: trainer(args.width, args.steps, lambda: [LossHook()]),
        "fit, + SpeedReportHook(breakdown=False)": lambda: trainer(
            args.width, args.steps, lambda: [LossHook(), SpeedReportHook(breakdown=False, **quiet)]),
        "fit, + SpeedReportHook()": lambda: trainer(
            args.width, args.steps, lambda: [LossHook(), SpeedReportHook(**quiet)]),
    }
    for run in contestants.values():
        run()  # warm-up (and the FLOP count's one-time import)
    rates: Dict[str, List[float]] = {name: [] for name in contestants}
    for _ in range(args.rounds):
        for name, run in contestants.items():
            rates[name].append(run())
    base, fit = rates["hand loop"], rates["fit, LossHook"]
    print(f"{args.steps} steps of a {args.width}-wide MLP, batch 32, 1 thread; medians of {args.rounds} "
          f"interleaved rounds (ratios: medians of each round's ratio)")
    for name, values in rates.items():
        ratio = statistics.median(v / b for v, b in zip(values, base))
        to_fit = statistics.median(v / b for v, b in zip(values, fit))
        print(f"  {name:<42} {statistics.median(values):8.1f} steps/s   x{ratio:.3f} of the hand loop, "
              f"x{to_fit:.3f} of fit with LossHook")
    print(f"peak resident memory of the process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
