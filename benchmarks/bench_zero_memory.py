"""Per-rank bytes held in parameters, gradients and optimizer state, and step time, under DDP and ZeRO 1/2/3.

Run: python benchmarks/bench_zero_memory.py [--nproc 2] [--steps 20] [--width 512]
(it starts itself under torch.distributed.run with gloo on 127.0.0.1). Step times are medians over
interleaved rounds, reported relative to DDP measured in the same run. Target: stage 3 holds at
most 0.55x the per-rank bytes of DDP.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def optimizer_state_tensors(optimizer):
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard's optimizer in .optim
    for state in inner.state.values():
        for v in state.values():
            if hasattr(v, "numel") and v.dim() > 0:
                yield v


def worker(args):
    import torch

    import colossal_lite
    from colossal_lite.core import global_context as gpc

    torch.set_num_threads(1)
    colossal_lite.launch_from_torch(config={}, verbose=False)
    rank, world = gpc.get_global_rank(), gpc.get_world_size()
    configs = {"ddp": {}, "zero1": dict(zero=dict(stage=1)), "zero2": dict(zero=dict(stage=2)),
               "zero3": dict(zero=dict(stage=3))}

    class Block(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

        def forward(self, x):
            return x + self.fc2(torch.relu(self.fc1(x)))

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[Block(args.width) for _ in range(args.depth)], torch.nn.Linear(args.width, 10))

    engines = {}
    for name, cfg in configs.items():
        gpc.load_config(cfg)
        model = build()
        engines[name] = colossal_lite.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-3),
                                                 torch.nn.CrossEntropyLoss(), verbose=False)[0]
    x = torch.randn(args.batch, args.width)
    y = torch.randint(0, 10, (args.batch,))

    def step(engine, n):
        for _ in range(n):
            engine.zero_grad()
            engine.backward(engine.criterion(engine(x), y))
            engine.step()

    for e in engines.values():
        step(e, 2)  # warm-up: optimizer state exists now
    times = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, e in engines.items():  # interleaved
            torch.distributed.barrier()
            t0 = time.perf_counter()
            step(e, args.steps)
            times[name].append((time.perf_counter() - t0) / args.steps)
    rows = {}
    for name, e in engines.items():
        params = list(e.model.parameters())
        rows[name] = dict(params=local_bytes(params), grads=local_bytes(p.grad for p in params),
                          optim=local_bytes(optimizer_state_tensors(e.optimizer)),
                          step_ms=statistics.median(times[name]) * 1e3)
    if rank == 0:
        base = rows["ddp"]
        base_total = base["params"] + base["grads"] + base["optim"]
        print(f"world size {world}, model {sum(p.numel() for p in build().parameters()):,} parameters, Adam, "
              f"median of {args.rounds} interleaved rounds x {args.steps} steps")
        print(f"{'':8}{'params MiB':>12}{'grads MiB':>12}{'optim MiB':>12}{'total MiB':>12}{'x DDP':>8}"
              f"{'step ms':>10}{'x DDP':>8}")
        for name, r in rows.items():
            total = r["params"] + r["grads"] + r["optim"]
            print(f"{name:8}{r['params'] / 2**20:12.2f}{r['grads'] / 2**20:12.2f}{r['optim'] / 2**20:12.2f}"
                  f"{total / 2**20:12.2f}{total / base_total:8.2f}{r['step_ms']:10.2f}{r['step_ms'] / base['step_ms']:8.2f}")
        ratio = (rows["zero3"]["params"] + rows["zero3"]["grads"] + rows["zero3"]["optim"]) / base_total
        print(f"summary: stage 3 holds {ratio:.2f}x the per-rank bytes of DDP (target <= 0.55): "
              f"{'PASS' if ratio <= 0.55 else 'FAIL'}")
    gpc.destroy()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}", "--master_addr=127.0.0.1",
           f"--master_port={port}", __file__, *sys.argv[1:]]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
