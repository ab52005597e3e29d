"""Per-rank memory under DDP and ZeRO 1/2/3: peak process memory as the user sees it, next to tensor bytes.

Run: python benchmarks/bench_zero_memory.py [--nproc 2] [--runs 3] [--hidden 1536] [--layers 11] [--batch 8]
                                            [--glibc-malloc] [--malloc-trim]

Each configuration runs in its own 2-rank torchrun launch (gloo on 127.0.0.1), ``--runs`` times, and the figures
are medians over the runs of the largest rank's value. The model is ``--layers`` x (Linear(hidden, hidden) + Tanh)
then Linear(hidden, 10), trained with Adam on ``--batch`` samples per rank, built and handed to ``initialize`` the
way a user script does (its ``model`` and ``optimizer`` stay referenced).

- peak RSS growth: ``ru_maxrss`` at the end of step N minus ``ru_maxrss`` just after launch (MiB), so it counts
  everything the process holds (tensors, allocator overhead, buffers kept between steps, code paged in);
  on CUDA ``torch.cuda.max_memory_allocated`` is reported as well.
- tensor MiB: bytes of this rank's parameters, gradients and optimizer state after the last step.
- step ms: median time of the steps after the measured ones; faults/step: the minor page faults (``ru_minflt``)
  per step over those steps: fresh pages the kernel maps (and zeroes) for memory the allocator took anew.

``--glibc-malloc`` leaves glibc's allocator as it is (the library keeps its hands off when a ``glibc.malloc``
tunable is set; ``glibc.malloc.check=0`` is glibc's default), to see what ZeRO's ``mallopt`` setting (stages 2, 3) changes.
Other glibc settings are measured the same way, through ``GLIBC_TUNABLES`` in the environment (for example
``glibc.malloc.arena_max=1``); ``--malloc-trim`` calls glibc's ``malloc_trim(0)`` after every step.

Targets (peak growth relative to DDP in the same run): stage 1 <= 0.85x, stage 2 <= 0.70x, stage 3 <= 0.60x,
and flat across the steps after the first (the optimizer state is created at the end of step 1, so step 2 is the
first to hold everything at once).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time

CONFIGS = {"ddp": {}, "zero1": dict(zero=dict(stage=1)), "zero2": dict(zero=dict(stage=2)),
           "zero3": dict(zero=dict(stage=3))}
TARGETS = {"zero1": 0.85, "zero2": 0.70, "zero3": 0.60}
FLAT_MIB = 16  # growth of the peak across steps 2..N that still counts as flat (page-level noise)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


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
    colossal_lite.launch_from_torch(config=CONFIGS[args.config], verbose=False)
    base = peak_rss_mib()
    cuda = gpc.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        cuda_base = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(args.hidden, 10))
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine = colossal_lite.initialize(model, optimizer, torch.nn.CrossEntropyLoss(), verbose=False)[0]
    x = torch.randn(args.batch, args.hidden, device=gpc.device)
    y = torch.randint(0, 10, (args.batch,), device=gpc.device)

    trim = ctypes.CDLL("libc.so.6").malloc_trim if args.malloc_trim else None

    def step():
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        engine.step()
        if trim:
            trim(0)  # hands the heap's free pages back to the system

    per_step = []
    for _ in range(args.steps):
        step()
        per_step.append(peak_rss_mib() - base)
    cuda_peak = (torch.cuda.max_memory_allocated() - cuda_base) / 2**20 if cuda else None
    times, faults = [], resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(args.time_steps):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / max(args.time_steps, 1)
    params = list(engine.model.parameters())
    tensors = local_bytes(params) + local_bytes(p.grad for p in params) + local_bytes(
        optimizer_state_tensors(engine.optimizer))
    result = dict(rank=gpc.get_global_rank(), per_step=per_step, tensors=tensors / 2**20, n_params=n_params,
                  step_ms=statistics.median(times) * 1e3 if times else float("nan"), cuda_peak=cuda_peak,
                  faults=faults)
    with open(os.path.join(args.out, f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)
    gpc.destroy()


def launch(args, config: str) -> list:
    """One torchrun launch of ``config``; the rank results."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}", "--master_addr=127.0.0.1",
           f"--master_port={port}", __file__, "--config", config, "--hidden", str(args.hidden), "--layers",
           str(args.layers), "--batch", str(args.batch), "--steps", str(args.steps), "--time-steps",
           str(args.time_steps)] + (["--malloc-trim"] if args.malloc_trim else [])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if args.glibc_malloc:
        env["GLIBC_TUNABLES"] = "glibc.malloc.check=0"
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run(cmd + ["--out", out], env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            sys.exit(f"{config}: torchrun exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        rows = []
        for rank in range(args.nproc):
            with open(os.path.join(out, f"rank{rank}.json")) as f:
                rows.append(json.load(f))
    return rows


def summarise(runs: list) -> dict:
    """Medians over runs of the largest rank's figures."""
    def med(key):
        return statistics.median(max(r[key] for r in ranks) for ranks in runs)
    steps = len(runs[0][0]["per_step"])
    per_step = [statistics.median(max(r["per_step"][i] for r in ranks) for ranks in runs) for i in range(steps)]
    cuda = None if runs[0][0]["cuda_peak"] is None else med("cuda_peak")
    return dict(per_step=per_step, peak=per_step[-1], tensors=med("tensors"), step_ms=med("step_ms"), cuda=cuda,
                faults=med("faults"), n_params=runs[0][0]["n_params"])


def allocator(args) -> str:
    """The allocator settings the ranks ran under, in words."""
    trim = ", malloc_trim(0) after every step" if args.malloc_trim else ""
    if os.environ.get("LD_PRELOAD"):
        trim += f", LD_PRELOAD={os.environ['LD_PRELOAD']!r} (an allocator in glibc's place)"
    if args.glibc_malloc:
        return "glibc default" + trim
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc" in tunables or any(v in os.environ for v in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return f"the environment's (GLIBC_TUNABLES={tunables!r}; ZeRO leaves it alone)" + trim
    return "as ZeRO sets it" + trim


def report(args, rows: dict) -> bool:
    base = rows["ddp"]
    print(f"world size {args.nproc}, model {base['n_params']:,} parameters ({args.layers} x Linear({args.hidden}, "
          f"{args.hidden}) + Tanh, Linear({args.hidden}, 10)), Adam, batch {args.batch} per rank; medians of "
          f"{args.runs} runs of the largest rank; malloc: {allocator(args)}")
    cuda = base["cuda"] is not None
    print(f"{'':7}{'tensor MiB':>11}{'x DDP':>7}{'peak RSS growth MiB':>21}{'x DDP':>7}"
          f"{'  peak growth after each step, MiB':<40}" + (f"{'CUDA peak MiB':>15}{'x DDP':>7}" if cuda else "")
          + f"{'step ms':>9}{'x DDP':>7}{'faults/step':>13}")
    ok = True
    for name, r in rows.items():
        steps = " ".join(f"{v:.0f}" for v in r["per_step"])
        line = (f"{name:7}{r['tensors']:11.1f}{r['tensors'] / base['tensors']:7.2f}{r['peak']:21.0f}"
                f"{r['peak'] / base['peak']:7.2f}  {steps:<38}")
        if cuda:
            line += f"{r['cuda']:15.1f}{r['cuda'] / base['cuda']:7.2f}"
        print(line + f"{r['step_ms']:9.1f}{r['step_ms'] / base['step_ms']:7.2f}{r['faults']:13.0f}")
    for name, target in TARGETS.items():
        r = rows[name]
        # the optimizer state first exists during step 2, so steps 2 to N must hold the same peak
        ratio, rise = r["peak"] / base["peak"], r["per_step"][-1] - r["per_step"][min(1, len(r["per_step"]) - 1)]
        flat = rise <= FLAT_MIB
        ok = ok and ratio <= target and flat
        print(f"summary: {name} peak RSS growth {ratio:.2f}x DDP (target <= {target}), "
              f"{rise:+.0f} MiB from step 2 to step {len(r['per_step'])} ({'flat' if flat else 'NOT flat'}): "
              f"{'PASS' if ratio <= target and flat else 'FAIL'}")
    return ok


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3, help="launches per configuration (medians are reported)")
    parser.add_argument("--hidden", type=int, default=1536, help="width of the MLP (1536: 26 M parameters)")
    parser.add_argument("--layers", type=int, default=11, help="hidden Linear + Tanh layers")
    parser.add_argument("--batch", type=int, default=8, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=4, help="steps whose peak memory is measured")
    parser.add_argument("--time-steps", type=int, default=3, help="timed steps after the measured ones")
    parser.add_argument("--glibc-malloc", action="store_true", help="without ZeRO's mallopt setting")
    parser.add_argument("--malloc-trim", action="store_true", help="glibc's malloc_trim(0) after every step")
    parser.add_argument("--config", choices=sorted(CONFIGS), help=argparse.SUPPRESS)  # set in the ranks
    parser.add_argument("--out", help=argparse.SUPPRESS)  # the folder the ranks write their results to
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    runs = {name: [] for name in CONFIGS}
    for _ in range(args.runs):
        for name in CONFIGS:  # interleaved, so a slow moment of the machine touches every configuration alike
            runs[name].append(launch(args, name))
    sys.exit(0 if report(args, {name: summarise(r) for name, r in runs.items()}) else 1)


if __name__ == "__main__":
    main()
