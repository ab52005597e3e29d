"""One command that proves colossal_lite on a CUDA GPU: correctness, host syncs, distributed, memory and speed.

    python benchmarks/gpu_check.py --out runs/gpu_check            # on a machine with one NVIDIA GPU, <= 8 minutes
    python benchmarks/gpu_check.py --out /tmp/gc --dry-run         # anywhere: the same path on the CPU, tiny sizes

Run from the repository root with the library on ``PYTHONPATH`` (nothing installed). Every section runs on its own,
inside a time budget (seconds) and a try/except: a failing, crashing or slow section records its error and the
next one runs. An overall ``--deadline`` (seconds from start) skips what no longer fits. Everything measured goes to
``OUT/gpu_check.json``, rewritten after each section, so a run cut short keeps what it measured; a short table is
printed last. Exit status 0 when no section failed or errored.

Sections (the dry run does each on the CPU at tiny sizes, and marks what needs CUDA as skipped with the reason):
  env                  card, torch, CUDA, cuDNN and NCCL versions, date
  gpu_tests            the test suite's ``gpu``-marked tests, through pytest
  equivalence          engine loop and Trainer against the hand-written device loop (autocast, GradScaler,
                       clip_grad_norm_), fp32 / bf16 / fp16 x accumulation 1 and 3 (partial window): parameters and
                       buffers torch.equal, losses equal (tests/exact_loop.py, on the device)
  host_sync            torch.cuda.set_sync_debug_mode("error") over the engine loop (fp32, bf16); "warn" counted over
                       Trainer.fit with its common hooks and progress (syncs inside steps, and where the others are);
                       syncs per optimizer update for fp16
  offload              CheckpointModule(offload=True): device memory after forward and peak, with and without
  checkpoint_resume    Trainer checkpoint save, then resume mid-epoch: parameters, buffers and optimizer state equal
  nccl_one_rank        torchrun, 1 rank on NCCL: an all-reduce, then FSDP2 (zero stages 2 and 3) and DDP-kind cases
                       against the hand loop on the device
  two_ranks            torchrun, 2 ranks on the one GPU: NCCL where it allows, else gloo on CUDA tensors; DDP,
                       gradient handler and ZeRO-1 against the hand loop
  speed_report         SpeedReportHook on the device (CUDA events): a bf16 MLP's MFU against the peak table, and a
                       loader that sleeps named first; the reports' text, MFU and the syncs the hook found
  speed_*              ResNet-18 (224x224, bf16, channels-last) and a GPT-2-small-sized transformer (bf16): hand
                       loop, engine loop, Trainer (and Lightning Fabric when installed) interleaved on one model,
                       samples/s, paired ratios to the hand loop, peak memory; ``*_compile``: the same with compile

Targets (benchmarks/RESULTS.md): engine loop and Trainer >= 0.99x the hand loop's throughput, zero host syncs per
step for fp32 and bf16, peak memory within 2% of the hand loop's.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
for _p in (str(REPO), str(TESTS), str(Path(__file__).resolve().parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

TORCH_DIR = os.path.dirname(torch.__file__)
DEFAULT_DEADLINE_S = 450.0  # 7.5 minutes: with start-up and the last write, the command ends inside 8
RESERVE_S = 5.0  # kept back from the deadline for writing the JSON and printing the table


class SectionTimeout(Exception):
    """A section ran past its budget (raised in the main thread by SIGALRM)."""


@dataclass
class Ctx:
    """What every section gets: where to write, whether this is the dry run, the device, the clock."""

    out: Path
    dry: bool
    device: torch.device
    deadline: float  # time.monotonic() by which the whole command must be done
    section_end: float = 0.0
    rounds: Optional[int] = None  # the speed sections' timed rounds (None: each workload's own)
    notes: List[str] = field(default_factory=list)

    def left(self) -> float:
        """Seconds left to the current section (its budget, cut by the overall deadline)."""
        return max(0.0, self.section_end - time.monotonic())

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def sync(ctx: Ctx) -> None:
    if ctx.cuda:
        torch.cuda.synchronize()


# -- running commands and sections ---------------------------------------------------------------------------
def run_cmd(cmd: List[str], timeout: float, env: Optional[dict] = None) -> Dict[str, object]:
    """Run ``cmd`` in its own process group from the repository root; on timeout (or this process's section
    timeout) kill that group. -> {returncode, stdout tail, stderr tail, seconds, timed_out}."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO), *[p for p in full_env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    full_env["PYTHONUNBUFFERED"] = "1"
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(k, None)
    full_env.update(env or {})
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return dict(cmd=" ".join(cmd), returncode=proc.returncode, timed_out=timed_out,
                seconds=round(time.monotonic() - start, 1), stdout_tail=out[-3000:], stderr_tail=err[-3000:])


@contextlib.contextmanager
def alarm(seconds: float):
    """Raise SectionTimeout in the main thread after ``seconds``."""
    def on_alarm(signum, frame):
        raise SectionTimeout(f"section ran past its budget of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(0.01, seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_section(ctx: Ctx, name: str, budget: float, fn: Callable[[Ctx], dict]) -> dict:
    """One section inside its budget; never raises. -> its record (status, seconds, summary, data or error)."""
    left = ctx.deadline - RESERVE_S - time.monotonic()
    if left < min(budget, 10.0):
        return dict(status="skipped", seconds=0.0, summary=f"the overall deadline left {max(left, 0):.0f} s",
                    reason="deadline")
    budget = min(budget, left)
    ctx.section_end = time.monotonic() + budget
    start = time.monotonic()
    try:
        with alarm(budget):
            record = fn(ctx)
        record.setdefault("status", "passed")
    except SectionTimeout as e:
        record = dict(status="timeout", summary=str(e), error=str(e), trace=traceback.format_exc()[-4000:])
    except Exception as e:  # noqa: BLE001 - one section's failure must not lose the others
        record = dict(status="error", summary=f"{type(e).__name__}: {str(e)[:150]}", error=f"{type(e).__name__}: {e}",
                      trace=traceback.format_exc()[-4000:])
    finally:
        _clean_up(ctx)
    record["seconds"] = round(time.monotonic() - start, 1)
    record["budget_s"] = round(budget, 1)
    return record


def _clean_up(ctx: Ctx) -> None:
    """What one section leaves must not reach the next: the launched context, cached device memory, debug mode."""
    from colossal_lite.core import global_context as gpc

    with contextlib.suppress(Exception):
        gpc.destroy()
    import gc

    gc.collect()
    if ctx.cuda:
        with contextlib.suppress(Exception):
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.empty_cache()


def launch_here(config: Optional[dict] = None, seed: int = 1024):
    """colossal_lite launched as this one process (the device is CUDA when there is one)."""
    import colossal_lite
    from colossal_lite.core import global_context as gpc

    gpc.destroy()
    colossal_lite.launch_from_torch(config=config or {}, seed=seed, verbose=False)
    return gpc


def verdict(ok: bool, summary: str, **data) -> dict:
    return dict(status="passed" if ok else "failed", summary=summary, **data)


# -- env -------------------------------------------------------------------------------------------------------
def section_env(ctx: Ctx) -> dict:
    import colossal_lite

    info = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), python=platform.python_version(),
                torch=torch.__version__, colossal_lite=colossal_lite.__version__, platform=platform.platform(),
                cpu_count=os.cpu_count(), dry_run=ctx.dry, device=str(ctx.device))
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        info.update(card=props.name, memory_gib=round(props.total_memory / 2**30, 1), capability=f"{props.major}.{props.minor}",
                    cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                    nccl=".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None,
                    bf16=torch.cuda.is_bf16_supported())
    card = info.get("card", "no GPU (CPU)")
    return dict(status="passed", summary=f"{card}, torch {torch.__version__}", **info)


# -- gpu_tests -------------------------------------------------------------------------------------------------
def section_gpu_tests(ctx: Ctx) -> dict:
    """The suite's ``gpu``-marked tests (``-m gpu``); the dry run collects one file only (collecting the whole suite
    costs more than its minute)."""
    where = ["tests/nn/test_checkpoint_module.py"] if ctx.dry else ["tests"]
    report = ctx.out / "gpu_tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", f"--junitxml={report}", *where]
    res = run_cmd(cmd, timeout=ctx.left() - 2)
    counts = _junit_counts(report)
    ok = res["returncode"] == 0 and counts.get("failures", 0) == 0 and counts.get("errors", 0) == 0
    if not ctx.dry:
        ok = ok and counts.get("tests", 0) > counts.get("skipped", 0)  # on a GPU the marked tests must really run
    summary = ", ".join(f"{k} {v}" for k, v in counts.items()) or f"pytest exit {res['returncode']}"
    return verdict(ok, summary, counts=counts, **res)


def _junit_counts(report: Path) -> Dict[str, int]:
    import xml.etree.ElementTree as ET

    if not report.exists():
        return {}
    root = ET.parse(report).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")} if suite is not None else {}


# -- equivalence -------------------------------------------------------------------------------------------------
def section_equivalence(ctx: Ctx) -> dict:
    """tests/exact_loop.py's single-process matrix on this device: the library against the hand-written loop."""
    import exact_loop

    if ctx.dry:
        cases = [("fp16", 3, "engine"), ("bf16", 3, "trainer")]
    else:
        cases = [(p, a, loop) for p in exact_loop.PRECISIONS for a in exact_loop.ACCUMULATIONS for loop in exact_loop.LOOPS]
    results = {}
    for prec, acc, loop in cases:
        launch_here()
        key = f"{prec}/acc{acc}/{loop}"
        try:
            r = exact_loop.compare(prec, "single", acc, loop, rank=0)
            results[key] = dict(bitwise=not r["differ"], max_abs_diff=r["differ"], losses_equal=r["lib_losses"] == r["hand_losses"])
        except Exception as e:  # noqa: BLE001 - the next case still runs
            results[key] = dict(error=f"{type(e).__name__}: {e}")
    good = [k for k, r in results.items() if r.get("bitwise") and r.get("losses_equal")]
    return verdict(len(good) == len(results), f"{len(good)}/{len(results)} cases bitwise on {ctx.device.type}",
                   cases=results)


# -- host_sync -------------------------------------------------------------------------------------------------------
class SyncWatch:
    """Counts host-device synchronisations, with where each came from.

    On CUDA: ``torch.cuda.set_sync_debug_mode('warn')`` and every warning it gives, located by the innermost frame
    outside torch. On the CPU (dry run) no operation synchronises, so it counts what would on a GPU: ``.item()``,
    ``.cpu()``, ``.tolist()``, tensor-to-bool and ``.numpy()`` called from colossal_lite (tests/sync_counter.py).
    """

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.sites: List[str] = []

    def count(self) -> int:
        return len(self.sites) if self.cuda else sum(len(v) for v in self._calls.values())

    def where(self) -> Dict[str, int]:
        sites = self.sites if self.cuda else [s for v in self._calls.values() for s in v]
        return dict(Counter(_short(s) for s in sites).most_common(10))

    @contextlib.contextmanager
    def watching(self):
        if not self.cuda:
            from sync_counter import count_syncs

            with count_syncs() as calls:
                self._calls = calls
                yield self
            return
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            shown = warnings.showwarning

            def show(message, category, filename, lineno, file=None, line=None):
                if "synchroniz" in str(message):
                    self.sites.append(_outside_torch(traceback.extract_stack()[:-1]))
                else:
                    shown(message, category, filename, lineno, file, line)
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield self
            finally:
                torch.cuda.set_sync_debug_mode("default")


def _outside_torch(stack) -> str:
    for frame in reversed(stack):
        if not frame.filename.startswith(TORCH_DIR) and "warnings" not in os.path.basename(frame.filename):
            return f"{frame.filename}:{frame.lineno} {frame.name}"
    return "?"


def _short(site: str) -> str:
    return site.replace(str(REPO) + os.sep, "")


def _sync_setup(prec: str, accumulation: int, n: int, ctx: Ctx, loader_for_trainer: bool = False):
    """A small model through initialize -> (engine, loader, scheduler, batches); batches in pinned host memory."""
    import colossal_lite
    from colossal_lite.amp import AMP_TYPE

    config = dict(gradient_accumulation=accumulation, clip_grad_norm=1.0)
    if prec != "fp32":
        config["fp16"] = dict(mode=AMP_TYPE.BF16 if prec == "bf16" else AMP_TYPE.TORCH)
    launch_here(config)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=ctx.cuda)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(n)]
    if ctx.cuda:
        batches = [(x.pin_memory(), y.pin_memory()) for x, y in batches]
    engine, loader, _, sched = colossal_lite.initialize(model, optimizer, nn.CrossEntropyLoss(), batches,
                                                        lr_scheduler=sched, verbose=False)
    return engine, loader, sched


def _engine_steps(engine, loader, sched, ctx: Ctx) -> None:
    for x, y in loader:
        engine.zero_grad()
        out = engine(x.to(engine.device, non_blocking=True))
        engine.backward(engine.criterion(out, y.to(engine.device, non_blocking=True)))
        if engine.step():
            sched.step()


def engine_sync_case(prec: str, ctx: Ctx, steps: int) -> dict:
    """The engine loop: fp32/bf16 under sync debug mode 'error' (CUDA); fp16 counted with 'warn'."""
    engine, loader, sched = _sync_setup(prec, 2, steps, ctx)
    warm = list(loader)[:4]
    _engine_steps(engine, warm, sched, ctx)  # first steps create optimizer state
    sync(ctx)
    updates0 = engine.num_updates
    watch = SyncWatch(ctx.cuda)
    if ctx.cuda and prec != "fp16":
        torch.cuda.set_sync_debug_mode("error")
        try:
            _engine_steps(engine, loader, sched, ctx)
        except RuntimeError as e:
            return dict(mode="error", micro_steps=steps, ok=False, error=str(e)[:500])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return dict(mode="error", micro_steps=steps, ok=True, syncs=0)
    with watch.watching():
        _engine_steps(engine, loader, sched, ctx)
    updates = engine.num_updates - updates0
    n = watch.count()
    return dict(mode="warn" if ctx.cuda else "python-level counter", micro_steps=steps, updates=updates, syncs=n,
                syncs_per_update=round(n / max(updates, 1), 3), where=watch.where(), ok=prec == "fp16" or n == 0)


def _trainer_hooks(sched):
    from colossal_lite.logging import get_dist_logger
    from colossal_lite.nn.metric import Accuracy
    from colossal_lite.trainer import hooks

    return [hooks.LossHook(), hooks.AccuracyHook(Accuracy()), hooks.LRSchedulerHook(sched, by_epoch=False),
            hooks.LogMetricByEpochHook(get_dist_logger())]


def trainer_sync_case(prec: str, ctx: Ctx, steps: int) -> dict:
    """Trainer.fit with LossHook, AccuracyHook, LRSchedulerHook (per update), LogMetricByEpochHook and progress on:
    syncs inside the micro-steps (target 0 for fp32/bf16) and all others by where they come from."""
    from colossal_lite.trainer import Trainer
    from colossal_lite.trainer.hooks import BaseHook

    engine, loader, sched = _sync_setup(prec, 2, steps, ctx)
    watch = SyncWatch(ctx.cuda)

    class StepBegins(BaseHook):  # runs first at before_train_iter
        mark = 0

        def before_train_iter(self, trainer):
            self.mark = watch.count()

    class StepEnds(BaseHook):  # runs after the other hooks at after_train_iter (the Recorder, which flushes, is last)
        inside = steps_seen = 0

        def after_train_iter(self, trainer, output, label, loss):
            self.inside += watch.count() - begins.mark
            self.steps_seen += 1

    begins, phase = StepBegins(priority=-1000), StepEnds(priority=1000)
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        Trainer(engine).fit(loader, epochs=1, hooks=_trainer_hooks(sched), display_progress=True, log_dir=False)
        sync(ctx)  # the warm-up epoch above created the optimizer state
        updates0 = engine.num_updates
        with watch.watching():
            Trainer(engine).fit(loader, epochs=1 if ctx.dry else 2, hooks=[begins, phase, *_trainer_hooks(sched)],
                                display_progress=True, log_dir=False)
    updates = engine.num_updates - updates0
    return dict(micro_steps=phase.steps_seen, updates=updates, syncs_inside_steps=phase.inside,
                syncs_per_update_inside=round(phase.inside / max(updates, 1), 3), syncs_total=watch.count(),
                where=watch.where(), ok=prec == "fp16" or phase.inside == 0)


def section_host_sync(ctx: Ctx) -> dict:
    steps = 6 if ctx.dry else 200
    results = {}
    for prec in ("fp32", "bf16", "fp16"):
        for name, case in (("engine", engine_sync_case), ("trainer", trainer_sync_case)):
            try:
                results[f"{name}/{prec}"] = case(prec, ctx, steps)
            except Exception as e:  # noqa: BLE001
                results[f"{name}/{prec}"] = dict(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])
    fp16 = [r.get("syncs_per_update", r.get("syncs_per_update_inside")) for k, r in results.items() if k.endswith("fp16")]
    zero = all(r.get("ok") for k, r in results.items() if not k.endswith("fp16"))
    summary = (f"fp32/bf16 {'0 syncs per step' if zero else 'SYNCS FOUND'}; fp16 syncs/update engine {fp16[0]}, "
               f"trainer {fp16[1] if len(fp16) > 1 else '?'}")
    return verdict(zero and all(r.get("ok") for r in results.values()), summary, cases=results,
                   instrument="set_sync_debug_mode" if ctx.cuda else "python-level counter (CPU: nothing synchronises)")


# -- offload -------------------------------------------------------------------------------------------------------
def _offload_model(checkpoint: bool, offload: bool, width: int, depth: int) -> nn.Module:
    from colossal_lite.nn import CheckpointModule

    class Block(CheckpointModule):
        def __init__(self):
            super().__init__(checkpoint=checkpoint, offload=offload)
            self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)

        def _forward(self, h):
            return h + self.fc2(torch.relu(self.fc1(h)))

    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(depth)])


def _offload_run(ctx: Ctx, checkpoint: bool, offload: bool, rows: int, width: int, depth: int) -> dict:
    """Forward and backward of the block stack: device bytes held after forward, peak, and the gradients."""
    model = _offload_model(checkpoint, offload, width, depth).to(ctx.device)
    x = torch.randn(rows, width, device=ctx.device, generator=torch.Generator(ctx.device).manual_seed(1), requires_grad=True)
    out = {}
    if ctx.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    y = model(x)
    if ctx.cuda:
        torch.cuda.synchronize()
        out["after_forward_mib"] = (torch.cuda.memory_allocated() - base) / 2**20
    y.square().mean().backward()
    if ctx.cuda:
        torch.cuda.synchronize()
        out["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    out["grads"] = [p.grad.detach().cpu() for p in model.parameters()] + [x.grad.detach().cpu()]
    return out


def section_offload(ctx: Ctx) -> dict:
    """CheckpointModule(offload=True) against the same blocks without offload, checkpointing off and on."""
    rows, width, depth = (8, 16, 2) if ctx.dry else (8192, 4096, 6)
    activation_mib = rows * width * 4 / 2**20
    cases = {}
    ok = True
    for checkpoint in (False, True):
        runs = {off: _offload_run(ctx, checkpoint, off, rows, width, depth) for off in (False, True)}
        same = all(torch.equal(a, b) for a, b in zip(runs[False]["grads"], runs[True]["grads"]))
        case = dict(gradients_equal=same)
        for off, r in runs.items():
            case.update({f"{k}_{'offload' if off else 'kept'}": round(v, 1) for k, v in r.items() if k != "grads"})
        if ctx.cuda:
            # with offload, what the blocks keep for the backward is on the host: the device holds the stack's
            # output alone (the first block's input is the caller's ``x``, on the device before and after, and
            # not counted: it was allocated before the measurement's base)
            saved = case["after_forward_mib_kept"] - case["after_forward_mib_offload"]
            case["moved_to_host_mib"] = round(saved, 1)
            ok = ok and saved > 0 and case["after_forward_mib_offload"] <= activation_mib * 1.05
        ok = ok and same
        cases["checkpoint" if checkpoint else "no_checkpoint"] = case
    if not ctx.cuda:
        return verdict(ok, "gradients equal; memory not measured (CPU: tensors are in host memory already)",
                       cases=cases, note="needs CUDA to measure device memory")
    moved = ", ".join(f"{k} {c['moved_to_host_mib']:.0f} MiB" for k, c in cases.items())
    left = ", ".join(f"{k} {c['after_forward_mib_offload']:.0f}" for k, c in cases.items())
    return verdict(ok, f"moved to host: {moved}; left on the device after forward: {left} MiB (the output, "
                       f"{activation_mib:.0f} MiB)",
                   cases=cases, activation_mib=activation_mib)


# -- checkpoint_resume ---------------------------------------------------------------------------------------------
def _resume_build(config: dict, n: int):
    import colossal_lite
    from colossal_lite.utils import get_dataloader

    launch_here(config, seed=5)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.Tanh(), nn.Dropout(0.3), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(n, 16, generator=g) * 3, torch.randint(0, 4, (n,), generator=g))
    loader = get_dataloader(data, shuffle=True, seed=3, batch_size=4, pin_memory=torch.cuda.is_available())
    return colossal_lite.initialize(model, opt, nn.CrossEntropyLoss(), loader, lr_scheduler=sched, verbose=False)


def _resume_train(config: dict, n: int, folder: Path, resume=None):
    from colossal_lite.trainer import Trainer
    from colossal_lite.trainer.hooks import LossHook, LRSchedulerHook, SaveCheckpointHook

    engine, loader, _, sched = _resume_build(config, n)
    hooks = [LossHook(), LRSchedulerHook(sched, by_epoch=False), SaveCheckpointHook("3ba", str(folder))]
    Trainer(engine).fit(loader, epochs=3, hooks=hooks, resume_from=resume, log_dir=False)
    state = {f"model.{k}": v.detach().clone() for k, v in engine.unwrapped_model.state_dict().items()}
    for i, s in engine.optimizer.state_dict()["state"].items():
        state.update({f"optim.{i}.{k}": v.detach().clone() for k, v in s.items() if isinstance(v, torch.Tensor)})
    return state


def section_checkpoint_resume(ctx: Ctx) -> dict:
    """A run that saves every 3 optimizer steps, and fresh runs resumed from a mid-epoch and an epoch-end checkpoint:
    model parameters and buffers and optimizer state equal (fp32, bf16, fp16 with a growing loss scale)."""
    from colossal_lite.amp import AMP_TYPE
    from colossal_lite.checkpoint import CheckpointManager

    n = 28 if ctx.dry else 44  # 7 or 11 batches of 4 per epoch: saves fall mid-epoch and at epoch ends
    configs = dict(fp32={}, bf16=dict(fp16=dict(mode=AMP_TYPE.BF16)),
                   fp16=dict(gradient_accumulation=2, fp16=dict(mode=AMP_TYPE.TORCH, init_scale=2.0**16, growth_interval=3)))
    if ctx.dry:
        configs = {"fp32": configs["fp32"]}
    results = {}
    with tempfile.TemporaryDirectory(dir=ctx.out) as tmp:
        for name, config in configs.items():
            want = _resume_train(config, n, Path(tmp) / name)
            folders = CheckpointManager(Path(tmp) / name).list_checkpoints()
            for folder in (folders[2], folders[len(folders) // 2 + 1])[:1 if ctx.dry else 2]:
                got = _resume_train(config, n, Path(tmp) / f"{name}-{folder.name}", resume=folder)
                differ = {k: float((got[k].double() - want[k].double()).abs().max()) for k in want
                          if not torch.equal(got[k].cpu(), want[k].cpu())}
                results[f"{name} from {folder.name}"] = dict(bitwise=not differ and got.keys() == want.keys(), max_abs_diff=differ)
    good = sum(r["bitwise"] for r in results.values())
    return verdict(good == len(results), f"{good}/{len(results)} resumed runs bitwise on {ctx.device.type}", cases=results)


# -- distributed: torchrun workers -----------------------------------------------------------------------------------
def worker_main(args) -> None:
    """Run under torchrun: an all-reduce check, then tests/exact_loop.py cases for ``--kinds``; rank files out."""
    import exact_loop

    import colossal_lite
    from colossal_lite.core import global_context as gpc

    colossal_lite.launch_from_torch(config={}, backend=args.backend, verbose=False)
    rank, world = gpc.get_global_rank(), gpc.get_world_size()
    t = torch.full((4,), float(rank + 1), device=gpc.device)
    torch.distributed.all_reduce(t)
    result = dict(rank=rank, world=world, device=str(gpc.device), backend=torch.distributed.get_backend(),
                  all_reduce_ok=bool((t == world * (world + 1) / 2).all()))
    precisions = args.precisions.split(",")
    cases = [(p, k, 3, loop) for p in precisions for k in args.kinds.split(",") for loop in args.loops.split(",")]
    result["cases"] = {"/".join(map(str, c)): _summarise_case(r) for c, r in zip(cases, _run_cases(exact_loop, cases, rank))}
    Path(f"{args.result}.rank{rank}").write_text(json.dumps(result))
    gpc.destroy()


def _run_cases(exact_loop, cases, rank: int):
    out = exact_loop.run_all(cases, rank)
    return [out["/".join(map(str, c))] for c in cases]


def _summarise_case(r: dict) -> dict:
    if "error" in r:
        return dict(error=r["error"])
    return dict(bitwise=not r["differ"], max_abs_diff=r["differ"], losses_equal=r["lib_losses"] == r["hand_losses"],
                collectives_equal=r["lib_collectives"] == r["hand_collectives"], strategy=r["strategy"])


def run_workers(ctx: Ctx, nproc: int, backend: str, kinds: str, precisions: str, loops: str, timeout: float) -> dict:
    from dist_helpers import free_port

    result = ctx.out / f"dist-{nproc}-{backend}"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(Path(__file__).resolve()), "--worker", "--backend", backend,
           "--kinds", kinds, "--precisions", precisions, "--loops", loops, "--result", str(result)]
    run = run_cmd(cmd, timeout=timeout, env={"OMP_NUM_THREADS": "1"})
    ranks = []
    for r in range(nproc):
        f = Path(f"{result}.rank{r}")
        ranks.append(json.loads(f.read_text()) if f.exists() else None)
    cases = ranks[0]["cases"] if ranks[0] else {}
    good = [k for k, c in cases.items()
            if all(rk and rk["cases"][k].get("bitwise") and rk["cases"][k].get("losses_equal")
                   and rk["cases"][k].get("collectives_equal") for rk in ranks)]
    ok = run["returncode"] == 0 and all(rk and rk["all_reduce_ok"] for rk in ranks) and len(good) == len(cases) > 0
    return dict(ok=ok, backend=backend, nproc=nproc, bitwise_cases=f"{len(good)}/{len(cases)}", ranks=ranks,
                **{k: v for k, v in run.items() if k != "stdout_tail" or not ok})


def section_nccl_one_rank(ctx: Ctx) -> dict:
    """One rank on NCCL: the all-reduce, then FSDP2 (zero stages 2 and 3) against the hand-sharded loop on the device."""
    if not ctx.cuda:
        return dict(status="skipped", summary="needs CUDA (NCCL)", reason="NCCL needs CUDA GPUs")
    return one_rank_verdict(run_workers(ctx, 1, "nccl", "zero2,zero3", "fp32,bf16,fp16", "engine,trainer",
                                        timeout=ctx.left() - 2))


def one_rank_verdict(r: dict) -> dict:
    """The section's record from ``run_workers``'s result (its ``ok`` becomes the status)."""
    data = {k: v for k, v in r.items() if k != "ok"}
    return verdict(r["ok"], f"all-reduce {'ok' if r['ranks'][0] and r['ranks'][0]['all_reduce_ok'] else 'FAILED'}; "
                            f"FSDP2 cases bitwise {r['bitwise_cases']}", **data)


def section_two_ranks(ctx: Ctx) -> dict:
    """Two ranks on the one GPU: NCCL first (it refuses two ranks on one device in most versions), then gloo
    with CUDA tensors; DDP, the gradient handler and ZeRO-1 against the hand loop. The dry run: gloo on the CPU."""
    attempts = {}
    kinds, precisions, loops = ("ddp", "fp32", "engine") if ctx.dry else ("ddp,handler,zero1", "fp32,bf16,fp16", "engine,trainer")
    if ctx.cuda:
        attempts["nccl"] = run_workers(ctx, 2, "nccl", kinds, precisions, loops, timeout=min(60.0, ctx.left() / 2))
        if attempts["nccl"]["ok"]:
            return verdict(True, f"NCCL, 2 ranks on one GPU: bitwise {attempts['nccl']['bitwise_cases']}", attempts=attempts)
    attempts["gloo"] = run_workers(ctx, 2, "gloo", kinds, precisions, loops, timeout=ctx.left() - 2)
    g = attempts["gloo"]
    nccl_note = "NCCL refused, " if ctx.cuda else ""
    return verdict(g["ok"], f"{nccl_note}gloo on {ctx.device.type}: bitwise {g['bitwise_cases']}", attempts=attempts)


# -- the command -------------------------------------------------------------------------------------------------------
# -- speed report ------------------------------------------------------------------------------------------------
def _speed_report_case(ctx: Ctx, width: int, batch: int, steps: int, delay: float) -> dict:
    """One fit with ``SpeedReportHook`` on the device: an MLP ``width`` wide (bf16 on a GPU), ``delay`` seconds of
    sleep per batch in the loader; -> the report's figures and text."""
    import colossal_lite
    from colossal_lite.trainer import Trainer
    from colossal_lite.trainer.hooks import LossHook, SpeedReportHook
    from colossal_lite.trainer.speed_report import rank_causes

    launch_here(dict(fp16=dict(mode="bf16")) if ctx.cuda else {})
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(width, width), nn.GELU())], nn.Linear(width, 10))
    data = [(torch.randn(batch, width), torch.randint(0, 10, (batch,))) for _ in range(steps)]

    def loader():
        for item in data:
            time.sleep(delay)
            yield item
    engine, _, _, _ = colossal_lite.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                                               nn.CrossEntropyLoss(), verbose=False)
    hook = SpeedReportHook(report=False, peak_tflops=None if ctx.cuda else 1.0)
    Trainer(engine).fit(_Replay(loader, steps), epochs=1, hooks=[hook, LossHook()], log_dir=False)
    f = hook.figures
    timed = [cause.key for cause in rank_causes(f) if cause.key != "host syncs"]
    return dict(first=timed[0], mfu=f.mfu, samples_per_s=f.samples_per_s, peak=f.peak_note,
                seconds={k: round(v, 4) for k, v in f.seconds.items()}, sync_sites=f.sync_sites,
                clock=hook.clock_kind, report=hook.report_text)


class _Replay:
    """A loader made from a generator function (each iteration calls it again) and its length."""

    def __init__(self, make, steps: int):
        self.make, self.steps = make, steps

    def __iter__(self):
        return self.make()

    def __len__(self):  # (sized, so the wait for each batch is timed as such, not read ahead with the last one)
        return self.steps


def section_speed_report(ctx: Ctx) -> dict:
    """SpeedReportHook on the device: MFU of a bf16 MLP against the peak table (device events time the phases), and
    a loader that sleeps is named first."""
    width, batch, steps = (64, 8, 4) if ctx.dry else (4096, 256, 30)
    compute = _speed_report_case(ctx, width, batch, steps, delay=0.0)
    data_bound = _speed_report_case(ctx, width, batch, 6 if ctx.dry else 10, delay=0.1 if ctx.dry else 0.05)
    mfu_ok = compute["mfu"] is not None and 0 < compute["mfu"] <= 1
    ok = mfu_ok and data_bound["first"] == "data" and (compute["clock"] == "DeviceClock") == ctx.cuda
    mfu = "none" if compute["mfu"] is None else f"{100 * compute['mfu']:.1f}%"
    return verdict(ok, f"MFU {mfu} ({compute['peak']}); sleeping loader named first: {data_bound['first']}",
                   compute=compute, data_bound=data_bound)


def sections() -> List[tuple]:
    """(name, budget in seconds, function), in the order they run: cheap correctness first, compilation last."""
    import gpu_check_speed as speed

    return [
        ("env", 15, section_env),
        ("gpu_tests", 90, section_gpu_tests),
        ("equivalence", 60, section_equivalence),
        ("host_sync", 60, section_host_sync),
        ("offload", 30, section_offload),
        ("checkpoint_resume", 45, section_checkpoint_resume),
        ("nccl_one_rank", 75, section_nccl_one_rank),
        ("two_ranks", 90, section_two_ranks),
        ("speed_report", 60, section_speed_report),
        ("speed_resnet18", 60, speed.section("resnet18", compiled=False)),
        ("speed_gpt2", 75, speed.section("gpt2", compiled=False)),
        ("speed_resnet18_compile", 120, speed.section("resnet18", compiled=True)),
        ("speed_gpt2_compile", 120, speed.section("gpt2", compiled=True)),
    ]


def import_problem(package: str = "colossal_lite") -> Optional[str]:
    """Why ``import colossal_lite`` fails here, as a fix to apply, or None. Every section imports the library, so a
    missing dependency is said once, before any section runs, instead of as each section's error."""
    try:
        importlib.import_module(package)
    except ImportError as e:
        missing = (e.name or str(e)).split(".")[0]
        return (f"{package} cannot be imported here ({type(e).__name__}: {e}); install what it needs, e.g. "
                f"`pip install {missing.replace('_', '-')}`, or the whole project with `pip install -e .`")
    return None


def print_table(results: Dict[str, dict], total_s: float, path: Path) -> None:
    print()
    print(f"{'section':<24} {'status':<8} {'s':>6}  summary")
    for name, r in results.items():
        print(f"{name:<24} {r['status']:<8} {r.get('seconds', 0):>6.1f}  {r.get('summary', '')}")
    print(f"total {total_s:.0f} s; everything measured: {path}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="folder for gpu_check.json (created)")
    parser.add_argument("--dry-run", action="store_true", help="the whole path on the CPU at tiny sizes (CI)")
    parser.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S, help="seconds the whole command may take")
    parser.add_argument("--only", default="", help="comma-separated section names to run (default: all)")
    parser.add_argument("--skip", default="", help="comma-separated section names to leave out")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed rounds of each speed section (default: 8 for ResNet-18, 6 for GPT-2); more give a "
                             "steadier median on a busy machine")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a torchrun rank of a dist section
    for name in ("--backend", "--kinds", "--precisions", "--loops", "--result"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(args)
        return 0
    if args.out is None:
        parser.error("--out DIR is required")
    start = time.monotonic()
    problem = import_problem()
    if problem:
        parser.error(problem)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --dry-run to check the path on the CPU")
    device = torch.device("cuda", torch.cuda.current_device()) if not args.dry_run else torch.device("cpu")
    if args.dry_run:
        torch.set_num_threads(min(2, torch.get_num_threads()))
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    ctx = Ctx(out=args.out, dry=args.dry_run, device=device, deadline=start + args.deadline, rounds=args.rounds)
    only, skip = set(filter(None, args.only.split(","))), set(filter(None, args.skip.split(",")))
    path = args.out / "gpu_check.json"
    results: Dict[str, dict] = {}
    for name, budget, fn in sections():
        if (only and name not in only) or name in skip:
            continue
        if name.startswith("speed_") and ctx.rounds:  # (the budgets are sized for the default rounds, 6 or 8)
            budget *= max(1.0, ctx.rounds / 6)
        print(f"[gpu_check] {name} ...", flush=True)
        results[name] = run_section(ctx, name, budget, fn)
        print(f"[gpu_check] {name}: {results[name]['status']} in {results[name]['seconds']} s: "
              f"{results[name].get('summary', '')}", flush=True)
        write_json(path, results, ctx, time.monotonic() - start)
    total = time.monotonic() - start
    write_json(path, results, ctx, total)
    print_table(results, total, path)
    return 0 if all(r["status"] in ("passed", "skipped") for r in results.values()) else 1


def write_json(path: Path, results: Dict[str, dict], ctx: Ctx, seconds: float) -> None:
    doc = dict(dry_run=ctx.dry, device=str(ctx.device), seconds=round(seconds, 1), sections=results)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
