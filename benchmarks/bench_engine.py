"""Per-micro-step cost of the colossal_lite engine and Trainer against the hand-written PyTorch loop.

Workload: a 512 -> 512 -> 10 MLP, batch 64, SGD, gradient accumulation 2, global-norm clipping
1.0, fp32, CPU, one thread. The Trainer runs ``fit`` with LossHook, AccuracyHook, LRSchedulerHook
(per update), LogMetricByStepHook and the progress display on (plain lines, written to /dev/null).

How it is measured (this machine is shared and noisy; instances of the same model differ by tens of us):
- the three contestants train ONE model with ONE optimizer, so memory placement cannot favour one;
- they alternate every ``--block`` micro-steps (a whole number of accumulation windows): the Trainer's
  loader, every ``block`` batches, hands control to the hand-written loop and the engine loop (random
  order), which run the same batches, timed apart; so ``fit`` runs once over all epochs, with its epoch
  ends, evaluations-free progress lines and metric reductions counted where they fall;
- the first epoch is warm-up; each block gives one paired difference (contestant - hand, same moment),
  and the median of those is reported with a 95 % confidence interval (order statistics).

    python benchmarks/bench_engine.py [--epochs 8] [--epoch-steps 600] [--block 20] [--runs 5]
                                      [--width 512] [--batch-size 64] [--hooks loss,acc,lr,step] [--no-progress]
                                      [--nonfinite-loss raise|skip|ignore] [--speed-report off|on|both]

``--hooks`` and ``--no-progress`` change only the Trainer (the other contestants stay as they are): an
ablation of what each hook and the display cost, e.g. ``--hooks '' --no-progress`` for the bare loop.
``--speed-report on`` adds ``SpeedReportHook()`` to the Trainer's hooks; ``both`` (with ``--runs K``) runs K
pairs of processes, without and with it, interleaved, and prints the paired difference of Trainer - hand.

One process's heap and code layout shifts every figure by up to tens of us (a CI within one run does not
show it), so ``--runs K`` runs the whole measurement in K fresh processes one after another and reports,
for each difference, the median over the runs of their paired medians, with each run's figure.

Before timing, each contestant trains its own copy of the model for a few steps and must end with the
same parameters as the hand-written loop (they do the same work).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

Batch = Tuple[torch.Tensor, torch.Tensor]
HOOK_CLASSES = {"loss": "LossHook", "acc": "AccuracyHook", "lr": "LRSchedulerHook", "step": "LogMetricByStepHook"}
HOOK_NAMES = tuple(HOOK_CLASSES)  # the names ``--hooks`` takes, in the order the hooks are listed
MicroStep = Callable[[Batch], None]


@dataclass(frozen=True)
class Workload:
    in_features: int = 512
    hidden: int = 512
    classes: int = 10
    batch_size: int = 64
    accumulation: int = 2  # micro-steps per optimizer step
    clip: float = 1.0  # global L2 norm
    lr: float = 0.01
    num_batches: int = 16  # distinct batches, cycled (made once, outside the timed region)
    hooks: Tuple[str, ...] = HOOK_NAMES  # the Trainer's hooks (``--hooks``: an ablation leaves some out)
    progress: bool = True  # the Trainer's progress display (plain lines to /dev/null)
    nonfinite_loss: str = "raise"  # the config key for the engine and the Trainer (``--nonfinite-loss``)
    speed_report: bool = False  # the Trainer with SpeedReportHook too (``--speed-report``)

    def config(self) -> dict:
        return dict(gradient_accumulation=self.accumulation, clip_grad_norm=self.clip,
                    nonfinite_loss=self.nonfinite_loss)

    def model(self) -> nn.Module:
        torch.manual_seed(0)  # every contestant starts from the same weights
        return nn.Sequential(nn.Linear(self.in_features, self.hidden), nn.ReLU(), nn.Linear(self.hidden, self.classes))

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=self.lr)

    def batches(self) -> List[Batch]:
        g = torch.Generator().manual_seed(1)
        return [(torch.randn(self.batch_size, self.in_features, generator=g),
                 torch.randint(0, self.classes, (self.batch_size,), generator=g)) for _ in range(self.num_batches)]


# -- contestants: each returns (micro_step, model) ------------------------------------------------
def hand_loop(w: Workload, model: nn.Module, optimizer: torch.optim.Optimizer) -> MicroStep:
    """The plain PyTorch loop: zero_grad per window, loss / N, backward, clip and step every N micro-steps."""
    criterion = nn.CrossEntropyLoss()
    params = list(model.parameters())
    counter = [0]

    def micro_step(batch: Batch):
        x, y = batch
        if counter[0] == 0:
            optimizer.zero_grad()
        loss = criterion(model(x), y) / w.accumulation
        loss.backward()
        counter[0] += 1
        if counter[0] == w.accumulation:
            torch.nn.utils.clip_grad_norm_(params, w.clip)
            optimizer.step()
            counter[0] = 0

    return micro_step


def engine_loop(engine) -> MicroStep:
    """The colossal_lite engine loop (accumulation and clipping come from the config)."""

    def micro_step(batch: Batch):
        x, y = batch
        engine.zero_grad()
        loss = engine.criterion(engine(x), y)
        engine.backward(loss)
        engine.step()

    return micro_step


def build_hand(w: Workload) -> Tuple[MicroStep, nn.Module]:
    model = w.model()
    return hand_loop(w, model, w.optimizer(model)), model


def build_engine(w: Workload) -> Tuple[MicroStep, nn.Module]:
    import colossal_lite

    colossal_lite.launch_from_torch(config=w.config(), verbose=False)
    model = w.model()
    engine, *_ = colossal_lite.initialize(model, w.optimizer(model), nn.CrossEntropyLoss(), verbose=False)
    return engine_loop(engine), engine.unwrapped_model


def trainer_setup(w: Workload):
    """An engine with a constant LambdaLR (same result as the other loops) and the benchmark's hook list
    -> (engine, scheduler, hooks)."""
    import colossal_lite
    from colossal_lite.nn.metric import Accuracy
    from colossal_lite.trainer import hooks

    colossal_lite.launch_from_torch(config=w.config(), verbose=False)
    model = w.model()
    optimizer = w.optimizer(model)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    engine, _, _, sched = colossal_lite.initialize(model, optimizer, nn.CrossEntropyLoss(), lr_scheduler=sched,
                                                   verbose=False)
    make = {"loss": hooks.LossHook, "acc": lambda: hooks.AccuracyHook(Accuracy()),
            "lr": lambda: hooks.LRSchedulerHook(sched, by_epoch=False), "step": hooks.LogMetricByStepHook}
    chosen = [make[name]() for name in HOOK_NAMES if name in w.hooks]
    return engine, sched, chosen + ([hooks.SpeedReportHook(report=False)] if w.speed_report else [])


class _TrainerSteps:
    """``Trainer.fit`` over the requested micro-batches, as one contestant (it owns its loop)."""

    def __init__(self, trainer, hooks, lr_scheduler, progress: bool = True):
        self.trainer, self.hooks, self.lr_scheduler, self.progress = trainer, hooks, lr_scheduler, progress
        self.epochs = 0

    def run_many(self, batches: List[Batch], steps: int, start: int):
        n = len(batches)
        loader = [batches[i % n] for i in range(start, start + steps)]
        self.epochs += 1
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
            self.trainer.fit(loader, epochs=self.epochs, hooks=self.hooks, display_progress=self.progress)

    def __call__(self, batch: Batch):
        self.run_many([batch], 1, 0)


def build_trainer(w: Workload) -> Tuple[MicroStep, nn.Module]:
    """Trainer.fit with LossHook, AccuracyHook, LRSchedulerHook, LogMetricByStepHook and progress display on."""
    from colossal_lite.trainer import Trainer

    engine, sched, hook_list = trainer_setup(w)
    return _TrainerSteps(Trainer(engine), hook_list, sched, w.progress), engine.unwrapped_model


CONTESTANTS: Dict[str, Callable[[Workload], Tuple[MicroStep, nn.Module]]] = {
    "hand": build_hand,
    "engine": build_engine,
    "trainer": build_trainer,
}
BASELINE = "hand"


# -- measurement ----------------------------------------------------------------------------------
def check_same_result(w: Workload, steps: int = 8):
    """Before timing: every contestant, on its own copy, must produce the hand loop's parameters."""
    batches = w.batches()
    results = {}
    for name, build in CONTESTANTS.items():
        micro_step, model = build(w)
        if hasattr(micro_step, "run_many"):
            micro_step.run_many(batches, steps, 0)
        else:
            for i in range(steps):
                micro_step(batches[i % len(batches)])
        results[name] = [p.detach().clone() for p in model.parameters()]
    ref = results[BASELINE]
    for name, params in results.items():
        diff = max((a - b).abs().max().item() for a, b in zip(ref, params))
        if diff > 1e-5:
            raise SystemExit(f"{name} and {BASELINE} disagree after {steps} micro-steps (max |diff| {diff:.3g}): "
                             f"they do not run the same workload")


def _minor_faults() -> int:
    """Minor page faults of this process so far (glibc returning heap memory to the OS and touching it
    again shows up here; it can cost any contestant tens of us per micro-step, by chance of heap layout)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _feed(batches: List[Batch]):
    """The other contestants' batches through a generator, as the Trainer gets its own from the loader's
    generator, so resuming a generator is not counted against the Trainer alone."""
    for batch in batches:
        yield batch


class InterleavedLoader:
    """The Trainer's train loader; every ``block`` batches it runs the other contestants on the same batches.

    ``segments['trainer']`` gets the Trainer's seconds per micro-step over each block (everything fit did
    between two hand-overs, epoch ends included); ``segments[name]`` the other contestants' for the same block.
    """

    def __init__(self, batches: List[Batch], epoch_steps: int, block: int, others: Dict[str, MicroStep], seed: int = 0):
        self.batches, self.epoch_steps, self.block, self.others = batches, epoch_steps, block, others
        self.segments: Dict[str, List[float]] = {name: [] for name in ["trainer", *others]}
        self.faults: Dict[str, List[float]] = {name: [] for name in ["trainer", *others]}
        self._faults_mark = 0
        self.epoch = 0
        self._rng = random.Random(seed)
        self._mark: Optional[float] = None  # when the Trainer's current block began
        self._done = 0  # batches handed out in all epochs

    def __len__(self) -> int:
        return self.epoch_steps

    def _hand_over(self, block_batches: List[Batch]) -> None:
        now = time.perf_counter()
        if self._mark is not None:
            self.segments["trainer"].append((now - self._mark) / self.block)
            self.faults["trainer"].append((_minor_faults() - self._faults_mark) / self.block)
        names = list(self.others)
        self._rng.shuffle(names)
        for name in names:
            step = self.others[name]
            f0 = _minor_faults()
            t0 = time.perf_counter()
            for batch in _feed(block_batches):
                step(batch)
            self.segments[name].append((time.perf_counter() - t0) / self.block)
            self.faults[name].append((_minor_faults() - f0) / self.block)
        self._faults_mark = _minor_faults()
        self._mark = time.perf_counter()

    def finish(self) -> None:
        """After fit: the last block of the Trainer (its other contestants already ran)."""
        if self._mark is not None:
            self.segments["trainer"].append((time.perf_counter() - self._mark) / self.block)
            self.faults["trainer"].append((_minor_faults() - self._faults_mark) / self.block)
            self._mark = None

    def __iter__(self):
        n = len(self.batches)
        for i in range(0, self.epoch_steps, self.block):
            start = self._done + i
            block_batches = [self.batches[(start + j) % n] for j in range(self.block)]
            self._hand_over(block_batches)
            yield from block_batches  # the Trainer's batches cost what _feed's cost the others
        self._done += self.epoch_steps
        self.epoch += 1


def build_shared(w: Workload, epoch_steps: int):
    """The contestants over one model and optimizer -> ({name: micro-step}, trainer, hooks)."""
    from colossal_lite.trainer import Trainer

    engine, sched, hook_list = trainer_setup(w)
    model, optimizer = engine.unwrapped_model, engine.optimizer
    criterion = nn.CrossEntropyLoss()
    params = list(model.parameters())
    counter = [0]
    inner_sched = sched.lr_scheduler  # the LambdaLR the Trainer's LRSchedulerHook steps
    sink = open(os.devnull, "w")
    loss_sum = torch.zeros((), dtype=torch.float64)
    done = [0]

    def hand_same_work(batch: Batch):
        """The hand loop plus, written by hand, what the hooks and progress do: the LR scheduler steps each
        update, each loss is added (detached, in place) to a running sum averaged at the epoch's end, and a
        progress line with the last loss and LR is printed every 10% of the epoch."""
        x, y = batch
        if counter[0] == 0:
            optimizer.zero_grad()
        loss = criterion(model(x), y)
        (loss / w.accumulation).backward()
        loss_sum.add_(loss.detach())
        counter[0] += 1
        if counter[0] == w.accumulation:
            torch.nn.utils.clip_grad_norm_(params, w.clip)
            optimizer.step()
            inner_sched.step()
            counter[0] = 0
        done[0] += 1
        if done[0] % (epoch_steps // 10) == 0:
            print(f"{done[0]} loss={loss.item():.5g} lr={inner_sched.get_last_lr()[0]:.5g}", file=sink)
        if done[0] % epoch_steps == 0:
            print(f"epoch loss {loss_sum.item() / epoch_steps:.5g}", file=sink)
            loss_sum.zero_()

    steps = {"hand": hand_loop(w, model, optimizer), "hand+": hand_same_work, "engine": engine_loop(engine)}
    return steps, Trainer(engine), hook_list


def median_ci(values: List[float]) -> Tuple[float, float, float]:
    """Median and a 95 % confidence interval for it (order statistics, normal approximation)."""
    v = sorted(values)
    n = len(v)
    half = 1.96 * math.sqrt(n) / 2
    lo, hi = max(0, int(math.floor(n / 2 - half))), min(n - 1, int(math.ceil(n / 2 + half)))
    return statistics.median(v), v[lo], v[hi]


def workload(args) -> Workload:
    return Workload(in_features=args.width, hidden=args.width, batch_size=args.batch_size,
                    hooks=tuple(args.hooks), progress=not args.no_progress, nonfinite_loss=args.nonfinite_loss,
                    speed_report=args.speed_report == "on")


def describe_trainer(w: Workload) -> str:
    listed = ", ".join([HOOK_CLASSES[n] for n in HOOK_NAMES if n in w.hooks] +
                       (["SpeedReportHook"] if w.speed_report else [])) or "no hooks"
    return f"{listed}, progress {'on' if w.progress else 'off'}"


def parse_hooks(text: str) -> Tuple[str, ...]:
    chosen = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in chosen if name not in HOOK_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown hook {', '.join(unknown)}: choose from {','.join(HOOK_NAMES)} "
                                         f"(an empty string: no hooks)")
    return chosen


PAIRS = (("engine", BASELINE), ("trainer", BASELINE), ("hand+", BASELINE), ("trainer", "hand+"))


def measure(args) -> Dict[str, object]:
    """One run in this process: prints its report; returns {'hand': us, 'engine - hand': [diff, lo, hi], ...}."""
    w = workload(args)
    torch.set_num_threads(1)
    check_same_result(w)
    steps, trainer, hook_list = build_shared(w, args.epoch_steps)
    loader = InterleavedLoader(w.batches(), args.epoch_steps, args.block, steps)
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):  # progress lines: plain, not shown
        trainer.fit(loader, epochs=args.epochs, hooks=hook_list, display_progress=w.progress)
    loader.finish()

    warm = args.epoch_steps // args.block  # blocks of the first epoch
    us = {name: [s * 1e6 for s in seg[warm:]] for name, seg in loader.segments.items()}
    n = min(len(v) for v in us.values())
    us = {name: v[:n] for name, v in us.items()}
    print(f"workload: MLP {w.in_features}->{w.hidden}->{w.classes}, batch {w.batch_size}, SGD, accumulation "
          f"{w.accumulation}, clip {w.clip}, fp32, CPU, {torch.get_num_threads()} thread; trainer with "
          f"{describe_trainer(w)}; {args.epochs - 1} epochs x "
          f"{args.epoch_steps} micro-steps after 1 warm-up epoch, contestants alternating every {args.block}")
    base = us[BASELINE]
    result: Dict[str, object] = {BASELINE: statistics.median(base)}
    print(f"  {BASELINE:>8}: median {statistics.median(base):8.1f} us/micro-step over {n} blocks")
    for name, ref in PAIRS:
        med = statistics.median(us[name])
        diff, lo, hi = median_ci([a - b for a, b in zip(us[name], us[ref])])
        print(f"  {name:>8}: median {med:8.1f} us/micro-step; paired {name} - {ref}: {diff:+.1f} us "
              f"(95% CI {lo:+.1f} .. {hi:+.1f}), ratio {med / statistics.median(us[ref]):.3f}")
        result[f"{name} - {ref}"] = [diff, lo, hi]
    fault_medians = {name: statistics.median(v[warm:]) for name, v in loader.faults.items()}
    faults = ", ".join(f"{name} {v:.1f}" for name, v in fault_medians.items())
    print(f"  minor page faults per micro-step (median over blocks): {faults}")
    print(f"summary: hand {statistics.median(base):.1f} us per micro-step; " + "; ".join(
        f"{k} = {v[0]:+.1f} us (95% CI {v[1]:+.1f}..{v[2]:+.1f})" for k, v in result.items() if k != BASELINE))
    result["faults"] = fault_medians
    return result


def _run_process(args, speed_report: str, label: str) -> Dict[str, object]:
    """One fresh process of ``measure`` -> its figures."""
    cmd = [sys.executable, os.path.abspath(__file__), "--epochs", str(args.epochs), "--epoch-steps",
           str(args.epoch_steps), "--block", str(args.block), "--width", str(args.width), "--batch-size",
           str(args.batch_size), "--hooks", ",".join(args.hooks), "--nonfinite-loss", args.nonfinite_loss,
           "--speed-report", speed_report, "--json"]
    if args.no_progress:
        cmd.append("--no-progress")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"run {label} failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    run = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"run {label}: hand {run[BASELINE]:.1f} us; " + "; ".join(
        f"{k} {run[k][0]:+.1f}" for k in map(" - ".join, PAIRS)) + "; page faults per micro-step "
        + ", ".join(f"{k} {v:.1f}" for k, v in run["faults"].items()), flush=True)
    return run


def measure_in_processes(args) -> None:
    """``--runs`` fresh processes, one after another; the median over runs of each paired median. With
    ``--speed-report both`` each run is a pair of processes, without and with the hook, one after the other."""
    kinds = ("off", "on") if args.speed_report == "both" else (args.speed_report,)
    runs: Dict[str, List[Dict[str, object]]] = {kind: [] for kind in kinds}
    for i in range(args.runs):
        for kind in kinds:
            runs[kind].append(_run_process(args, kind, f"{i + 1}/{args.runs}, SpeedReportHook {kind}"))
    for kind in kinds:
        print(f"median over {args.runs} runs, SpeedReportHook {kind} (each run: median of paired block differences):")
        print(f"  hand: {statistics.median(r[BASELINE] for r in runs[kind]):.1f} us per micro-step")
        for name, ref in PAIRS:
            key = f"{name} - {ref}"
            values = [r[key][0] for r in runs[kind]]
            print(f"  {key}: {statistics.median(values):+.1f} us (runs: {', '.join(f'{v:+.1f}' for v in values)})")
    if len(kinds) == 2:
        key = f"trainer - {BASELINE}"
        paired = [on[key][0] - off[key][0] for on, off in zip(runs["on"], runs["off"])]
        print(f"SpeedReportHook on - off, {key} paired by run: {statistics.median(paired):+.1f} us "
              f"(runs: {', '.join(f'{v:+.1f}' for v in paired)})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8, help="epochs of fit; the first is warm-up")
    parser.add_argument("--epoch-steps", type=int, default=600, help="micro-steps per epoch")
    parser.add_argument("--block", type=int, default=20, help="micro-steps each contestant runs before handing over")
    parser.add_argument("--width", type=int, default=Workload.in_features,
                        help="input and hidden features of the MLP (small: the per-step Python cost with warm caches)")
    parser.add_argument("--batch-size", type=int, default=Workload.batch_size)
    parser.add_argument("--hooks", type=parse_hooks, default=HOOK_NAMES, metavar="LIST",
                        help=f"the Trainer's hooks, comma-separated from {','.join(HOOK_NAMES)} (default: all; "
                             f"'' for none): an ablation of what each costs")
    parser.add_argument("--no-progress", action="store_true", help="the Trainer without its progress display")
    parser.add_argument("--nonfinite-loss", default="raise", choices=("raise", "skip", "ignore"),
                        help="config nonfinite_loss of the engine and the Trainer ('ignore': without the loss guard)")
    parser.add_argument("--runs", type=int, default=1, help="fresh processes to measure in (median over them)")
    parser.add_argument("--speed-report", default="off", choices=("off", "on", "both"),
                        help="the Trainer with SpeedReportHook() too ('both', with --runs: each run a pair of "
                             "processes, without and with it)")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    args = parser.parse_args()
    w = workload(args)
    if args.block % w.accumulation or args.epoch_steps % args.block:
        parser.error(f"--block must be a multiple of the accumulation window ({w.accumulation}) and divide "
                     f"--epoch-steps")
    if args.epochs < 2:
        parser.error("--epochs must be >= 2 (the first is warm-up)")
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    if args.speed_report == "both" and args.runs < 2:
        parser.error("--speed-report both needs --runs >= 2 (each run is a pair of fresh processes)")
    if args.runs > 1:
        measure_in_processes(args)
        return
    result = measure(args)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
