"""Checkpoint cost: CheckpointManager save/load against plain torch.save/torch.load of the same tensors, and the time
to resume (restore the loader + first batch) at the start versus near the end of an epoch.

Run: python benchmarks/bench_checkpoint.py [--mb 200] [--rounds 5]   (medians of interleaved rounds)
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200, help="checkpoint size in MiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=200_000, help="dataset size for the resume timing")
    args = parser.parse_args()
    from colossal_lite.checkpoint.manager import CheckpointManager
    from colossal_lite.utils import get_dataloader

    n = args.mb * 2**20 // 4 // 8
    state = {"engine": {"model": {f"w{i}": torch.randn(n) for i in range(8)}}}
    times = {"manager save": [], "torch.save": [], "manager load": [], "torch.load": []}
    with tempfile.TemporaryDirectory() as tmp:
        manager = CheckpointManager(Path(tmp) / "ckpt", keep_last_n=1)
        for r in range(args.rounds):  # interleaved: manager, plain, manager, plain ...
            t0 = time.perf_counter()
            manager.save(f"epoch{r}-step{r}", state, {})
            times["manager save"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            torch.save(state, Path(tmp) / "plain.pt")
            times["torch.save"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            manager.load("last")
            times["manager load"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            torch.load(Path(tmp) / "plain.pt", weights_only=True)
            times["torch.load"].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"checkpoint of {args.mb} MiB, median of {args.rounds} interleaved rounds:")
    for k, v in med.items():
        print(f"  {k:>13}: {v:.3f} s")
    print(f"  save ratio {med['manager save'] / med['torch.save']:.2f}x, load ratio {med['manager load'] / med['torch.load']:.2f}x")

    data = torch.utils.data.TensorDataset(torch.arange(args.samples).float())
    resume = {"start": [], "end": []}
    for _ in range(args.rounds):
        for where, offset in (("start", 0), ("end", args.samples - 100)):
            loader = get_dataloader(data, shuffle=True, batch_size=10)
            saved = loader.sampler.state_dict()
            saved["offset"] = offset
            t0 = time.perf_counter()
            fresh = get_dataloader(data, shuffle=True, batch_size=10)
            fresh.sampler.load_state_dict(saved)
            next(iter(fresh))
            resume[where].append(time.perf_counter() - t0)
    s, e = (statistics.median(resume[k]) * 1e3 for k in ("start", "end"))
    print(f"resume + first batch ({args.samples:,} samples): start of epoch {s:.1f} ms, "
          f"{args.samples - 100:,} samples in {e:.1f} ms (ratio {e / s:.2f}x)")
    print(f"summary: save {med['manager save'] / med['torch.save']:.2f}x torch.save, load "
          f"{med['manager load'] / med['torch.load']:.2f}x torch.load, resume near the end {e / s:.2f}x the start")


if __name__ == "__main__":
    main()
