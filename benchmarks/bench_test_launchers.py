"""The tests' two ways to start N ranks, side by side: ``run_torchrun`` (``python -m torch.distributed.run``) and
``run_ranks`` (``tests/rank_forker.py``: one fresh interpreter imports torch once and forks the ranks).

Each round runs the same two-rank script once with each launcher, in turn (interleaved, so a change of the machine's
load reaches both), and records the CPU seconds of the launch and all its processes (``RUSAGE_CHILDREN``, which
the machine's load changes far less than wall time), the wall time and the exit status. The script trains a small
model under DDP with the Trainer and leaves without destroying its group, the case where a gloo teardown race can
abort a process at exit: an abort shows as a non-zero status.

    python benchmarks/bench_test_launchers.py [--rounds 10]
"""
from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from dist_helpers import run_ranks, run_torchrun  # noqa: E402

# the Trainer run of the clean-exit test, which leaves without destroying its group
from test_clean_exit import FIT as SCRIPT  # noqa: E402


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_launch(launcher, script: Path) -> tuple:
    """(CPU s, wall s, exit status, the output's last lines when it failed)."""
    cpu, wall = children_cpu(), time.perf_counter()
    proc = launcher(script, nproc=2, timeout=300, check=False)
    tail = "" if proc.returncode == 0 else (proc.stdout + proc.stderr)[-1500:]
    return children_cpu() - cpu, time.perf_counter() - wall, proc.returncode, tail


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    launchers = {"run_torchrun": run_torchrun, "run_ranks": run_ranks}
    records = {name: [] for name in launchers}
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "fit.py"
        script.write_text(SCRIPT)
        for _ in range(args.rounds):
            for name, launcher in launchers.items():
                records[name].append(one_launch(launcher, script))
    for name, runs in records.items():
        cpu, wall = [r[0] for r in runs], [r[1] for r in runs]
        failed = [r for r in runs if r[2] != 0]
        print(f"{name}: {len(runs)} launches, CPU median {statistics.median(cpu):.2f} s "
              f"(min {min(cpu):.2f}, max {max(cpu):.2f}), wall median {statistics.median(wall):.2f} s, "
              f"non-zero exits {len(failed)} {[r[2] for r in failed]}")
        for r in failed:
            print(f"--- {name} exit {r[2]}:\n{r[3]}")


if __name__ == "__main__":
    main()
