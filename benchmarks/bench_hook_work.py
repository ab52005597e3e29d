"""What the hooks' own torch work costs inside a training loop, written by hand (no Trainer involved).

``bench_engine.py`` puts the Trainer with LossHook and LRSchedulerHook against the plain hand-written loop.
Part of that difference is work any loop with those features does: add each loss to a running sum, step the
LR scheduler after each update. This script adds each piece alone to the hand-written loop and times the
variants against it, alternating every ``--block`` micro-steps, so the figures show how much of the Trainer's
budget that work takes by itself, on the same workload (MLP, batch 64, SGD, accumulation 2, clipping 1.0,
fp32, CPU, one thread).

    python benchmarks/bench_hook_work.py [--width 512] [--batch-size 64] [--rounds 30] [--block 200]

Variants (each the hand loop plus one thing; the figure is the median of the paired per-round differences):
``add_detach`` / ``add_data``: ``running.add_(loss.detach())`` / ``(loss.data)`` into a float32 sum, as
LossHook does; ``add_f64``: the same into a float64 sum (a dtype conversion per add); ``keep``: only keep a
reference to the loss (no kernel); ``sched``: ``LambdaLR.step()`` after each optimizer step.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, Dict, Optional

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_engine as be  # noqa: E402


def make_loop(w: be.Workload, model: nn.Module, optimizer, sched, extra: Optional[str]) -> Callable:
    criterion = nn.CrossEntropyLoss()
    params = list(model.parameters())
    counter = [0]
    sums = {"f32": torch.zeros(()), "f64": torch.zeros((), dtype=torch.float64)}
    kept = [None]

    def micro_step(batch):
        x, y = batch
        if counter[0] == 0:
            optimizer.zero_grad()
        loss = criterion(model(x), y)
        (loss / w.accumulation).backward()
        if extra == "add_detach":
            sums["f32"].add_(loss.detach())
        elif extra == "add_data":
            sums["f32"].add_(loss.data)
        elif extra == "add_f64":
            sums["f64"].add_(loss.detach())
        elif extra == "keep":
            kept[0] = loss.data
        counter[0] += 1
        if counter[0] == w.accumulation:
            torch.nn.utils.clip_grad_norm_(params, w.clip)
            optimizer.step()
            if extra == "sched":
                sched.step()
            counter[0] = 0

    return micro_step


VARIANTS = (None, "add_detach", "add_data", "add_f64", "keep", "sched")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=be.Workload.in_features)
    parser.add_argument("--batch-size", type=int, default=be.Workload.batch_size)
    parser.add_argument("--rounds", type=int, default=30, help="rounds; each runs every variant for --block steps")
    parser.add_argument("--block", type=int, default=200, help="micro-steps per variant per round (even)")
    args = parser.parse_args()
    if args.block % 2 or args.block < 2 or args.rounds < 3:
        parser.error("--block must be even and --rounds at least 3")
    torch.set_num_threads(1)
    w = be.Workload(in_features=args.width, hidden=args.width, batch_size=args.batch_size)
    model = w.model()
    optimizer = w.optimizer(model)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)  # one model, one optimizer for all
    loops = {name or "hand": make_loop(w, model, optimizer, sched, name) for name in VARIANTS}
    batches = w.batches()
    for step in loops.values():  # warm-up
        for i in range(args.block):
            step(batches[i % len(batches)])
    us: Dict[str, list] = {name: [] for name in loops}
    for _ in range(args.rounds):
        for name, step in loops.items():
            start = time.perf_counter()
            for i in range(args.block):
                step(batches[i % len(batches)])
            us[name].append((time.perf_counter() - start) / args.block * 1e6)
    print(f"workload: MLP {w.in_features}->{w.hidden}->{w.classes}, batch {w.batch_size}, accumulation "
          f"{w.accumulation}, clip {w.clip}, fp32, CPU, 1 thread; {args.rounds} rounds x {args.block} micro-steps")
    print(f"  hand: median {statistics.median(us['hand']):.1f} us per micro-step")
    for name in loops:
        if name == "hand":
            continue
        diff = statistics.median(a - b for a, b in zip(us[name], us["hand"]))
        print(f"  + {name:10s}: {diff:+.2f} us per micro-step")


if __name__ == "__main__":
    main()
