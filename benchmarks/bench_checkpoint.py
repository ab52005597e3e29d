"""Cost of trainer checkpoints: save and load against plain torch.save / torch.load, and resuming mid-epoch.

1. Save and load. A trainer (one process, CPU) trains an MLP of ``--layers`` Linear(width, width)
   layers with Adam for 2 steps, so the checkpoint holds weights plus two Adam moments. Contestants,
   run interleaved for ``--rounds`` rounds (median reported):
   - ``save_trainer_checkpoint``: state gathering, the ``on_save_checkpoint`` event, the atomic folder
     write with fsyncs, the ``last`` pointer, retention (keep_last_n=1);
   - ``torch.save`` of the same (shared, per-rank) state to one file, without and with fsync;
   - ``save_trainer_checkpoint`` with ``CheckpointManager(async_save=True)``: the time training is blocked
     (the host copy, and the completion at a later step boundary: agreement, ``meta.json``, rename,
     ``last``, retention) and the time until the folder is complete. Between the two, the round waits
     for the background write outside the timed part, as training would go on;
   - ``load_trainer_checkpoint``: read with ``weights_only=True`` and restore into the engine,
     the scheduler, the trainer, the loader and the RNG; ``CheckpointManager.load`` (read only);
   - ``torch.load(weights_only=True)`` of the single file, and of the checkpoint's own ``shared.pt``.
   The files stay in the page cache, so the loads measure deserialisation, not the disk.
   Peak memory of a load: each kind of load once in a fresh process (``ru_maxrss`` after minus before).

2. Resume. A loader of ``--samples`` samples (batch 64): ``fit(resume_from=...)`` from a checkpoint
   taken after the epoch's 1st batch and from one taken 2 batches before its end; the time from the
   ``fit`` call to the end of the first training iteration (restore + first batch). For contrast, the
   same with a plain DataLoader, whose position the trainer can only reach by reading batches.

   The same state as a single file (``load_single_file`` against ``torch.load``) and as ZeRO 2/3's
   ``sharded/`` written by DCP in one process (sync and async saves; ``load_sharded`` against an
   unverified ``dcp.load``); peak memory of each kind of load.

    python benchmarks/bench_checkpoint.py [--layers 8] [--width 1024] [--rounds 5] [--samples 200000] [--no-resume]
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import colossal_lite
from colossal_lite.checkpoint import CheckpointManager
from colossal_lite.checkpoint.io import load_single_file
from colossal_lite.checkpoint.sharded import load_sharded
from colossal_lite.core import global_context as gpc
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.checkpointing import (
    load_trainer_checkpoint,
    save_trainer_checkpoint,
    trainer_checkpoint_state,
)
from colossal_lite.trainer.hooks import BaseHook, LossHook, LRSchedulerHook, SaveCheckpointHook
from colossal_lite.utils import get_dataloader

QUIET = logging.getLogger("bench_checkpoint")
SYNC_SAVE = "save_trainer_checkpoint (atomic folder, fsync, retention)"  # no handler: the resume messages are not printed


class Vectors(Dataset):
    """``n`` samples of 32 floats and a class, made on access (a cheap but real ``__getitem__``)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(32, generator=g), i % 10


def launch():
    gpc.destroy()
    colossal_lite.launch_from_torch(config={}, seed=0, verbose=False)


def _median_ms(xs: List[float]) -> float:
    return 1000 * statistics.median(xs)


def interleaved(contestants: Dict[str, Callable[[], None]], rounds: int) -> Dict[str, List[float]]:
    times: Dict[str, List[float]] = {name: [] for name in contestants}
    for _ in range(rounds):
        for name, fn in contestants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


# -- 1. save and load ----------------------------------------------------------------------------
def bench_save_load(layers: int, width: int, rounds: int, root: Path) -> None:
    launch()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    data = torch.utils.data.TensorDataset(torch.randn(16, width), torch.randn(16, width))
    engine, loader, _, sched = colossal_lite.initialize(model, opt, nn.MSELoss(), get_dataloader(data, batch_size=8),
                                                        lr_scheduler=sched, verbose=False)
    trainer = Trainer(engine)
    trainer.fit(loader, max_steps=2, hooks=[LossHook(), LRSchedulerHook(sched, by_epoch=False)])
    trainer._attach([LossHook(), LRSchedulerHook(sched, by_epoch=False)], "benchmark")  # hooks as in a run

    manager = CheckpointManager(root / "ck", keep_last_n=1)
    background = CheckpointManager(root / "ck-async", keep_last_n=1, async_save=True)
    shared, rank_state, _ = trainer_checkpoint_state(trainer, loader)
    single = root / "plain.pt"
    paths: Dict[str, Path] = {}

    def trainer_save():
        paths["last"] = save_trainer_checkpoint(trainer, manager, loader)

    def plain_save():
        torch.save({"shared": shared, "rank": rank_state}, single)

    def plain_save_fsync():
        with open(single, "wb") as f:
            torch.save({"shared": shared, "rank": rank_state}, f)
            f.flush()
            os.fsync(f.fileno())

    def async_save():  # timed from outside: its blocking part is measured by the manager
        save_trainer_checkpoint(trainer, background, loader)
        while not background.poll():  # step boundaries of a training that goes on meanwhile
            time.sleep(0.005)

    saves = interleaved({SYNC_SAVE: trainer_save,
                         "async_save=True, until the folder is complete": async_save,
                         "torch.save, one file, no fsync": plain_save,
                         "torch.save + fsync": plain_save_fsync}, rounds)
    saves["async_save=True, training blocked"] = [t.blocking for t in background.finished_saves]
    size = sum(p.stat().st_size for p in paths["last"].rglob("*") if p.is_file())
    shared_file = paths["last"] / "shared.pt"
    loads = interleaved({"load_trainer_checkpoint (read + restore into the run)":
                         lambda: load_trainer_checkpoint(trainer, manager, paths["last"], loader),
                         "CheckpointManager.load (read only, verified)": lambda: manager.load(paths["last"]),
                         "torch.load(weights_only=True) of its shared.pt": lambda: torch.load(shared_file,
                                                                                               weights_only=True),
                         "torch.load(weights_only=True)": lambda: torch.load(single, weights_only=True)}, rounds)
    params = sum(p.numel() for p in model.parameters())
    print(f"\n1. save / load: {layers} x Linear({width}, {width}) + Adam = {params / 1e6:.1f} M parameters, "
          f"checkpoint {size / 1e6:.0f} MB on disk; median of {rounds} interleaved rounds")
    _table(saves, "torch.save + fsync")
    blocked = _median_ms(saves["async_save=True, training blocked"])
    print(f"   async_save=True blocks training {blocked / _median_ms(saves[SYNC_SAVE]):.3f}x as long as the "
          f"synchronous save_trainer_checkpoint")
    _table(loads, "torch.load(weights_only=True) of its shared.pt")
    bench_other_formats(shared, rank_state, single, rounds, root)
    _peak_memory(paths["last"], shared_file, single, root / "ck-sharded", rounds)
    gpc.destroy()


def bench_other_formats(shared, rank_state, single: Path, rounds: int, root: Path) -> None:
    """The single file (``save_checkpoint``'s format) and the ZeRO 2/3 format (``sharded/``, written by DCP in one
    process, no process group): saves, blocking, and verified loads against their unverified reference."""
    import warnings

    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", message=".*process group.*")  # DCP runs without one here
    engine_state = shared["engine"]
    sharded = {"model": engine_state["model"], "optimizer": engine_state["optimizer"]["state"]}
    manager = CheckpointManager(root / "ck-sharded", keep_last_n=1)
    background = CheckpointManager(root / "ck-sharded-async", keep_last_n=1, async_save=True)
    paths: Dict[str, Path] = {}

    def sharded_save():
        paths["last"] = manager.save("epoch0-step1", {"n": 1}, {}, sharded_state=sharded)

    def sharded_async():
        background.save("epoch0-step1", {"n": 1}, {}, sharded_state=sharded)
        while not background.poll():
            time.sleep(0.005)

    saves = interleaved({"sharded: synchronous save": sharded_save,
                         "sharded: async_save=True, until complete": sharded_async}, rounds)
    saves["sharded: async_save=True, training blocked"] = [t.blocking for t in background.finished_saves]
    target = {k: {n: torch.zeros_like(t) for n, t in v.items()} if k == "model" else
              {i: {n: torch.zeros_like(t) for n, t in st.items()} for i, st in v.items()} for k, v in sharded.items()}
    folder = paths["last"]
    loads = interleaved({"single file: load_single_file (every record verified)": lambda: load_single_file(single),
                         "single file: torch.load(weights_only=True)": lambda: torch.load(single, weights_only=True),
                         "sharded: load_sharded (every byte verified)": lambda: load_sharded(folder, target),
                         "sharded: dcp.load, unverified": lambda: dcp.load(
                             target, storage_reader=dcp.FileSystemReader(str(folder / "sharded")))}, rounds)
    size = sum(p.stat().st_size for p in (folder / "sharded").iterdir())
    print(f"   sharded/ (DCP, one process): {size / 1e6:.0f} MB; single file {single.stat().st_size / 1e6:.0f} MB")
    _table(saves, "sharded: synchronous save")
    blocked = _median_ms(saves["sharded: async_save=True, training blocked"])
    print(f"   sharded async_save=True blocks training {blocked / _median_ms(saves['sharded: synchronous save']):.3f}x "
          f"as long as the synchronous save")
    _table({k: v for k, v in loads.items() if k.startswith("single")}, "single file: torch.load(weights_only=True)")
    _table({k: v for k, v in loads.items() if k.startswith("sharded")}, "sharded: dcp.load, unverified")


_PEAK = """
import re, sys, warnings, torch
warnings.filterwarnings("ignore")
from colossal_lite.checkpoint import CheckpointManager
from colossal_lite.checkpoint.io import load_single_file
from colossal_lite.checkpoint.sharded import load_sharded

def size(field):  # bytes
    return int(re.search(field + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

kind, target = sys.argv[1], sys.argv[2]
if kind.startswith("sharded"):  # the state to fill is there before the load, as in a run
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    state = {}
    _load_state_dict(state, dcp.FileSystemReader(target + "/sharded"), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    assert state, "the sharded state to fill is empty"
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM, what ru_maxrss reports) restarts from the present size
before = size("VmRSS")
import time
began = time.perf_counter()
if kind == "folder":
    CheckpointManager(target, cleanup=False).load(target)
elif kind == "single":
    load_single_file(target)
elif kind == "sharded":
    load_sharded(target, state)
elif kind == "sharded-dcp":
    dcp.load(state, storage_reader=dcp.FileSystemReader(target + "/sharded"))
else:
    torch.load(target, weights_only=True)
took = time.perf_counter() - began
print(size("VmHWM") - before, took)
"""


def _peak_memory(folder: Path, shared_file: Path, single: Path, sharded_dir: Path, rounds: int) -> None:
    """Time and peak process memory (resident pages, the file's mapped pages included) of one load in a fresh
    process, as a resumed run loads: the peak is reset just before the load (Linux ``/proc/self/clear_refs``); a
    sharded load fills a state that exists before it. ``rounds`` interleaved rounds, medians."""
    import subprocess
    import sys

    sharded = sharded_dir / (sharded_dir / "last").read_text().strip()
    kinds = (("folder", folder), ("torch.load", shared_file), ("single", single), ("torch.load single", single),
             ("sharded", sharded), ("sharded-dcp", sharded))
    peaks: Dict[str, List[float]] = {kind: [] for kind, _ in kinds}
    times: Dict[str, List[float]] = {kind: [] for kind, _ in kinds}
    for _ in range(rounds):
        for kind, target in kinds:
            proc = subprocess.run([sys.executable, "-c", _PEAK, kind.split()[0], str(target)],
                                  capture_output=True, text=True, check=True)
            peak, took = proc.stdout.split()[-2:]
            peaks[kind].append(int(peak) / 1e6)
            times[kind].append(float(took))
    print(f"   one load in a fresh process (as a resume loads), median of {rounds} interleaved rounds:")
    for ours, ref, what in (("folder", "torch.load", "folder: CheckpointManager.load / torch.load of its shared.pt"),
                            ("single", "torch.load single", "single file: load_single_file / torch.load"),
                            ("sharded", "sharded-dcp", "sharded: load_sharded / unverified dcp.load")):
        a, b = _median_ms(times[ours]), _median_ms(times[ref])
        print(f"   {what:<62} {a:7.1f} / {b:7.1f} ms  x{a / b:5.2f}   peak memory added "
              f"{statistics.median(peaks[ours]):.0f} / {statistics.median(peaks[ref]):.0f} MB")


def _table(times: Dict[str, List[float]], reference: str) -> None:
    ref = _median_ms(times[reference])
    for name, xs in times.items():
        m = _median_ms(xs)
        print(f"   {name:<58} {m:9.1f} ms   x{m / ref:5.2f} vs {reference}")


# -- 2. resume at the start vs near the end of an epoch -------------------------------------------
class FirstIteration(BaseHook):
    def after_train_iter(self, trainer, *args):
        if not hasattr(self, "at"):
            self.at = time.perf_counter()


def _build_resume(samples: int, resumable: bool):
    launch()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = Vectors(samples)
    loader = get_dataloader(data, shuffle=True, batch_size=64) if resumable else DataLoader(data, batch_size=64)
    engine, loader, _, _ = colossal_lite.initialize(model, opt, nn.CrossEntropyLoss(), loader, verbose=False)
    return engine, loader


def bench_resume(samples: int, rounds: int, root: Path) -> None:
    print(f"\n2. resume: {samples} samples, batch 64 ({-(-samples // 64)} batches per epoch); time from fit(resume_from=) "
          f"to the end of the first training iteration; median of {rounds} interleaved rounds")
    for resumable in (True, False):
        engine, loader = _build_resume(samples, resumable)
        iters = len(loader)
        ck = root / f"resume-{resumable}"
        trainer = Trainer(engine, logger=QUIET)
        trainer.fit(loader, max_steps=1, hooks=[SaveCheckpointHook("1ba", ck)])
        start = ck / (ck / "last").read_text().strip()
        trainer.fit(loader, max_steps=iters - 2, hooks=[SaveCheckpointHook("1000000ba", ck)])
        end = ck / (ck / "last").read_text().strip()

        def resume(path, target, resumable=resumable):
            engine, loader = _build_resume(samples, resumable)
            probe = FirstIteration()
            began = time.perf_counter()
            Trainer(engine, logger=QUIET).fit(loader, max_steps=target, hooks=[probe], resume_from=path)
            return probe.at - began

        times: Dict[str, List[float]] = {"start (after batch 1)": [], f"end (after batch {iters - 2})": []}
        for _ in range(rounds):
            times["start (after batch 1)"].append(resume(start, 2))
            times[f"end (after batch {iters - 2})"].append(resume(end, iters - 1))
        kind = "get_dataloader (the sampler skips)" if resumable else "plain DataLoader (batches read and dropped)"
        parts = ", ".join(f"{name}: {_median_ms(xs):.0f} ms" for name, xs in times.items())
        print(f"   {kind:<46} {parts}")
    gpc.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--no-resume", action="store_true", help="part 1 only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores, one thread")
    root = Path(tempfile.mkdtemp(prefix="bench-checkpoint-"))
    try:
        bench_save_load(args.layers, args.width, args.rounds, root)
        if not args.no_resume:
            bench_resume(args.samples, args.rounds, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
