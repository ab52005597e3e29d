"""Per-micro-step cost of the colossal_lite engine against the hand-written PyTorch loop it replaces.

Workload: a 512 -> 512 -> 10 MLP, batch 64, SGD, gradient accumulation 2, global-norm clipping
1.0, fp32, CPU, one thread. Each contestant trains its own copy of the same model on the same
batches; the contestants run interleaved (A, B, A, B, ...) for several rounds so that drifts of
the machine hit them alike, and the median over rounds is reported.

    python benchmarks/bench_engine.py [--rounds 7] [--steps 300] [--warmup 100]

To add a contestant (e.g. the Trainer), write a ``build_*`` function returning a callable that
runs one micro-step for a given batch, and add it to ``CONTESTANTS``.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import torch
from torch import nn

Batch = Tuple[torch.Tensor, torch.Tensor]
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
def build_hand(w: Workload) -> Tuple[MicroStep, nn.Module]:
    """The plain PyTorch loop: zero_grad per window, loss / N, backward, clip and step every N micro-steps."""
    model = w.model()
    optimizer = w.optimizer(model)
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

    return micro_step, model


def build_engine(w: Workload) -> Tuple[MicroStep, nn.Module]:
    """The colossal_lite engine loop, with accumulation and clipping taken from the config."""
    import colossal_lite

    colossal_lite.launch_from_torch(config=dict(gradient_accumulation=w.accumulation, clip_grad_norm=w.clip),
                                    verbose=False)
    model = w.model()
    engine, *_ = colossal_lite.initialize(model, w.optimizer(model), nn.CrossEntropyLoss(), verbose=False)

    def micro_step(batch: Batch):
        x, y = batch
        engine.zero_grad()
        loss = engine.criterion(engine(x), y)
        engine.backward(loss)
        engine.step()

    return micro_step, engine.unwrapped_model


class _TrainerSteps:
    """``Trainer.fit`` over the requested micro-batches, as one contestant (it owns its loop)."""

    def __init__(self, trainer, hooks, lr_scheduler):
        self.trainer, self.hooks, self.lr_scheduler = trainer, hooks, lr_scheduler
        self.epochs = 0

    def run_many(self, batches: List[Batch], steps: int, start: int):
        n = len(batches)
        loader = [batches[i % n] for i in range(start, start + steps)]
        self.epochs += 1
        self.trainer.fit(loader, epochs=self.epochs, hooks=self.hooks, display_progress=True)

    def __call__(self, batch: Batch):
        self.run_many([batch], 1, 0)


def build_trainer(w: Workload) -> Tuple[MicroStep, nn.Module]:
    """Trainer.fit with LossHook, AccuracyHook, LRSchedulerHook, LogMetricByStepHook and progress display on."""
    import colossal_lite
    from colossal_lite.nn.metric import Accuracy
    from colossal_lite.trainer import Trainer, hooks

    colossal_lite.launch_from_torch(config=dict(gradient_accumulation=w.accumulation, clip_grad_norm=w.clip),
                                    verbose=False)
    model = w.model()
    optimizer = w.optimizer(model)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)  # constant: same result as the others
    engine, _, _, sched = colossal_lite.initialize(model, optimizer, nn.CrossEntropyLoss(), lr_scheduler=sched,
                                                   verbose=False)
    hook_list = [hooks.LossHook(), hooks.AccuracyHook(Accuracy()),
                 hooks.LRSchedulerHook(sched, by_epoch=False), hooks.LogMetricByStepHook()]
    return _TrainerSteps(Trainer(engine), hook_list, sched), engine.unwrapped_model


CONTESTANTS: Dict[str, Callable[[Workload], Tuple[MicroStep, nn.Module]]] = {
    "hand": build_hand,
    "engine": build_engine,
    "trainer": build_trainer,
}
BASELINE = "hand"


# -- measurement ----------------------------------------------------------------------------------
def run_steps(micro_step: MicroStep, batches: List[Batch], steps: int, start: int = 0) -> float:
    """Seconds for ``steps`` micro-steps (a whole number of accumulation windows keeps contestants in phase)."""
    n = len(batches)
    t0 = time.perf_counter()
    if hasattr(micro_step, "run_many"):
        micro_step.run_many(batches, steps, start)
    else:
        for i in range(start, start + steps):
            micro_step(batches[i % n])
    return time.perf_counter() - t0


def check_same_result(w: Workload, steps: int = 8):
    """Before timing: every contestant must produce the same parameters (so they do the same work)."""
    batches = w.batches()
    results = {}
    for name, build in CONTESTANTS.items():
        micro_step, model = build(w)
        run_steps(micro_step, batches, steps)
        results[name] = [p.detach().clone() for p in model.parameters()]
    ref = results[BASELINE]
    for name, params in results.items():
        diff = max((a - b).abs().max().item() for a, b in zip(ref, params))
        if diff > 1e-5:
            raise SystemExit(f"{name} and {BASELINE} disagree after {steps} micro-steps (max |diff| {diff:.3g}): "
                             f"they do not run the same workload")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds; each runs every contestant once")
    parser.add_argument("--steps", type=int, default=300, help="micro-steps per contestant per round")
    parser.add_argument("--warmup", type=int, default=100, help="untimed micro-steps per contestant first")
    args = parser.parse_args()
    w = Workload()
    if args.steps % w.accumulation or args.warmup % w.accumulation:
        parser.error(f"--steps and --warmup must be multiples of the accumulation window ({w.accumulation})")
    torch.set_num_threads(1)

    check_same_result(w)
    batches = w.batches()
    steppers = {name: build(w)[0] for name, build in CONTESTANTS.items()}
    for step in steppers.values():
        run_steps(step, batches, args.warmup)

    per_step_us: Dict[str, List[float]] = {name: [] for name in steppers}
    done = args.warmup
    for _ in range(args.rounds):
        for name, step in steppers.items():  # interleaved: A, B, A, B, ...
            gc.collect()
            seconds = run_steps(step, batches, args.steps, start=done)
            per_step_us[name].append(seconds / args.steps * 1e6)
        done += args.steps

    print(f"workload: MLP {w.in_features}->{w.hidden}->{w.classes}, batch {w.batch_size}, SGD, accumulation "
          f"{w.accumulation}, clip {w.clip}, fp32, CPU, {torch.get_num_threads()} thread; "
          f"{args.rounds} rounds x {args.steps} micro-steps after {args.warmup} warm-up")
    medians = {name: statistics.median(v) for name, v in per_step_us.items()}
    base = medians[BASELINE]
    # the same round's difference cancels slow drifts of the machine; its median is the steadier figure
    paired = {name: statistics.median(a - b for a, b in zip(v, per_step_us[BASELINE]))
              for name, v in per_step_us.items() if name != BASELINE}
    for name, values in per_step_us.items():
        spread = f"min {min(values):.1f}, max {max(values):.1f}"
        extra = "" if name == BASELINE else (f"  diff {medians[name] - base:+.1f} us (paired by round "
                                             f"{paired[name]:+.1f} us)  ratio {medians[name] / base:.3f}")
        print(f"  {name:>8}: median {medians[name]:8.1f} us/micro-step ({spread}){extra}")
    summary = ", ".join(f"{name} {m:.1f} us" for name, m in medians.items())
    others = ", ".join(f"{name} - {BASELINE} = {medians[name] - base:+.1f} us (paired {paired[name]:+.1f} us, "
                       f"{medians[name] / base:.3f}x)" for name in paired)
    print(f"summary: median per micro-step: {summary}; {others}")


if __name__ == "__main__":
    main()
