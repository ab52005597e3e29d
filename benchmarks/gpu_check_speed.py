"""The speed sections of ``gpu_check.py``: colossal_lite against the best hand-written loop on the same device.

All contestants train ONE model with ONE optimizer (so memory placement and weights cannot favour one), taking
turns in blocks of ``block`` steps, round after round, in a rotating order; the first round is warm-up (cuDNN
autotuning, compilation, optimizer state). Each block is timed between two device synchronisations; the Trainer's
blocks are the stretches of one ``fit`` between hand-overs (its loader runs the others every ``block`` batches), so
its epoch end counts against it. Per contestant: median samples/s, the median of per-round throughput ratios to the
hand loop (paired: the same round), and the median per-block peak ``torch.cuda.max_memory_allocated`` against the
hand loop's (the shared model and optimizer are in every block's figure alike).

The hand loop is what a careful user writes: pinned host batches copied with ``non_blocking=True``, autocast bf16,
fused AdamW, ``zero_grad(set_to_none=True)``, ``clip_grad_norm_`` where the workload clips; the engine loop is the
README's loop with the same copies; the Trainer is ``fit`` with ``LossHook`` (progress off); Lightning Fabric
(``bf16-mixed``, when ``lightning`` is installed, without compile) runs the same step through ``fabric.setup``.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

Batch = Tuple[torch.Tensor, torch.Tensor]
Step = Callable[[Batch], None]


@dataclass
class Work:
    """One workload: the model, its batches (pinned host memory), the loss, the config, the sizes."""

    name: str
    model: nn.Module
    batches: List[Batch]
    criterion: Callable
    config: dict
    clip: float
    batch_size: int
    rounds: int  # timed rounds, after one warm-up round
    block: int  # steps per contestant per round
    describe: str


def _pinned(batches: List[Batch], cuda: bool) -> List[Batch]:
    return [(x.pin_memory(), y.pin_memory()) for x, y in batches] if cuda else batches


def _dry_cnn(classes: int) -> nn.Module:
    """The dry run's stand-in for ResNet-18 (whose 11 M parameters take seconds a step on a shared CPU)."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, classes))


def resnet_work(ctx, compile_opts) -> Work:
    import torchvision

    from colossal_lite.amp import AMP_TYPE

    b, side, classes = (2, 16, 10) if ctx.dry else (128, 224, 1000)
    torch.manual_seed(0)
    model = _dry_cnn(classes) if ctx.dry else torchvision.models.resnet18(weights=None, num_classes=classes)
    model = model.to(memory_format=torch.channels_last)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(b, 3, side, side, generator=g).contiguous(memory_format=torch.channels_last),
                torch.randint(0, classes, (b,), generator=g)) for _ in range(4)]
    config = dict(fp16=dict(mode=AMP_TYPE.BF16), cudnn_benchmark=True, compile=compile_opts)
    what = "a small CNN standing in for ResNet-18 (dry run)" if ctx.dry else "ResNet-18 (torchvision, random weights)"
    return Work("resnet18", model, _pinned(batches, ctx.cuda), nn.CrossEntropyLoss(), config, 0.0, b,
                rounds=ctx.rounds or (2 if ctx.dry else 8), block=2 if ctx.dry else 10,
                describe=f"{what}, batch {b} x 3 x {side} x {side}, bf16, channels-last, AdamW, no clipping")


class LMLogits(nn.Module):
    """A Hugging Face causal LM returning its logits (the criterion takes a tensor)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        return self.lm(input_ids=ids).logits


def lm_loss(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def gpt2_work(ctx, compile_opts) -> Work:
    from transformers import GPT2Config, GPT2LMHeadModel

    from colossal_lite.amp import AMP_TYPE

    if ctx.dry:
        cfg, b, seq = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32), 2, 16
    else:
        cfg, b, seq = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024), 8, 1024
    cfg.use_cache = False
    torch.manual_seed(0)
    model = LMLogits(GPT2LMHeadModel(cfg))
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(4):
        ids = torch.randint(0, cfg.vocab_size, (b, seq + 1), generator=g)
        batches.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    config = dict(fp16=dict(mode=AMP_TYPE.BF16), clip_grad_norm=1.0, compile=compile_opts)
    params = sum(p.numel() for p in model.parameters())
    return Work("gpt2", model, _pinned(batches, ctx.cuda), lm_loss, config, 1.0, b,
                rounds=ctx.rounds or (2 if ctx.dry else 6), block=2 if ctx.dry else 8,
                describe=f"GPT-2 (transformers GPT2Config, {cfg.n_layer} layers, {cfg.n_embd} wide, {params / 1e6:.0f} M "
                         f"parameters, random weights), batch {b} x {seq} tokens, bf16, AdamW, clip 1.0")


WORKLOADS = {"resnet18": resnet_work, "gpt2": gpt2_work}


# -- contestants -------------------------------------------------------------------------------------------------
def hand_step(w: Work, model: nn.Module, optimizer, device: torch.device) -> Step:
    params = list(model.parameters())

    def step(batch: Batch):
        x = batch[0].to(device, non_blocking=True)
        y = batch[1].to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = w.criterion(model(x), y)
        loss.backward()
        if w.clip:
            torch.nn.utils.clip_grad_norm_(params, w.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def engine_step(engine) -> Step:
    def step(batch: Batch):
        engine.zero_grad()
        x = batch[0].to(engine.device, non_blocking=True)
        y = batch[1].to(engine.device, non_blocking=True)
        engine.backward(engine.criterion(engine(x), y))
        engine.step()

    return step


def fabric_step(w: Work, model: nn.Module, optimizer, device: torch.device) -> Optional[Step]:
    """Lightning Fabric on the same model and optimizer (None when lightning is not installed)."""
    try:
        from lightning.fabric import Fabric
    except ImportError:
        return None
    fabric = Fabric(accelerator=device.type, devices=1, precision="bf16-mixed")
    fmodel, fopt = fabric.setup(model, optimizer, move_to_device=False)

    def step(batch: Batch):
        x = batch[0].to(device, non_blocking=True)
        y = batch[1].to(device, non_blocking=True)
        with fabric.autocast():
            loss = w.criterion(fmodel(x), y)
        fabric.backward(loss)
        if w.clip:
            fabric.clip_gradients(fmodel, fopt, max_norm=w.clip)
        fopt.step()
        fopt.zero_grad(set_to_none=True)

    return step


# -- measuring ----------------------------------------------------------------------------------------------------
class Meter:
    """Seconds and peak device memory (MiB) of each contestant's block, per round; and the host's seconds, the
    time the block's Python took to hand the device its work (read before the closing wait): a host time close to
    the block's time means the host, not the device, sets the pace (a CPU-bound loop, where a loop's own Python
    per step shows in its throughput)."""

    def __init__(self, ctx, names: List[str]):
        self.ctx = ctx
        self.seconds: Dict[str, List[float]] = {n: [] for n in names}
        self.host: Dict[str, List[float]] = {n: [] for n in names}
        self.peak: Dict[str, List[float]] = {n: [] for n in names}
        self._t0 = 0.0

    def start(self):
        if self.ctx.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self._t0 = time.perf_counter()

    def stop(self, name: str):
        self.host[name].append(time.perf_counter() - self._t0)
        if self.ctx.cuda:
            torch.cuda.synchronize()
            self.peak[name].append(torch.cuda.max_memory_allocated() / 2**20)
        self.seconds[name].append(time.perf_counter() - self._t0)


class InterleavedLoader:
    """The Trainer's loader: every ``block`` batches it ends the Trainer's timed block and runs the others'."""

    def __init__(self, w: Work, others: Dict[str, Step], meter: Meter):
        self.w, self.others, self.meter = w, others, meter
        self._round = 0
        self._timing_trainer = False

    def __len__(self) -> int:
        return (self.w.rounds + 1) * self.w.block

    def _hand_over(self):
        """End the Trainer's block, run each other contestant's (in an order that rotates by round), start the next."""
        self.finish()
        names = list(self.others)
        k = self._round % len(names)
        for name in names[k:] + names[:k]:
            self.meter.start()
            for i in range(self.w.block):
                self.others[name](self.w.batches[i % len(self.w.batches)])
            self.meter.stop(name)
        self.meter.start()
        self._timing_trainer = True

    def finish(self):
        if self._timing_trainer:
            self.meter.stop("trainer")
            self._timing_trainer = False

    def __iter__(self):
        for r in range(self.w.rounds + 1):
            self._round = r
            self._hand_over()
            for i in range(self.w.block):
                yield self.w.batches[i % len(self.w.batches)]


def build_contestants(ctx, w: Work, compiled: bool):
    """The engine (via initialize, config from the workload) and every contestant's step over its one model."""
    import colossal_lite
    from colossal_lite.core import global_context as gpc

    gpc.destroy()
    colossal_lite.launch_from_torch(config=w.config, verbose=False)
    model = w.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=ctx.cuda)
    engine, *_ = colossal_lite.initialize(model, optimizer, w.criterion, verbose=False)
    opts = w.config["compile"]
    hand_model = torch.compile(engine.unwrapped_model, **({} if opts is True else opts)) if compiled else engine.unwrapped_model
    steps = {"hand": hand_step(w, hand_model, engine.optimizer, engine.device), "engine": engine_step(engine)}
    notes = []
    if not compiled:
        try:
            fabric = fabric_step(w, engine.unwrapped_model, engine.optimizer, engine.device)
        except Exception as e:  # noqa: BLE001 - Fabric is optional: the other contestants still run
            fabric = None
            notes.append(f"Lightning Fabric failed to set up: {type(e).__name__}: {e}")
        if fabric is not None:
            steps["fabric"] = fabric
        elif not notes:
            notes.append("Lightning Fabric not measured: lightning is not installed")
    return engine, steps, notes


def measure(ctx, workload: str, compiled: bool) -> dict:
    from colossal_lite.trainer import Trainer
    from colossal_lite.trainer.hooks import LossHook

    # the dry run traces with dynamo but skips inductor's code generation (minutes on a small CPU)
    compile_opts = (dict(backend="eager") if ctx.dry else True) if compiled else False
    w = WORKLOADS[workload](ctx, compile_opts)
    engine, steps, notes = build_contestants(ctx, w, compiled)
    meter = Meter(ctx, [*steps, "trainer"])
    loader = InterleavedLoader(w, steps, meter)
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        Trainer(engine).fit(loader, epochs=1, hooks=[LossHook()], display_progress=False, log_dir=False)
    loader.finish()
    return dict(report(ctx, w, meter, compiled, engine), notes=notes)


def report(ctx, w: Work, meter: Meter, compiled: bool, engine) -> dict:
    """Medians over the timed rounds (the first is warm-up): samples/s, paired ratios and peak memory to the hand's."""
    secs = {n: v[1:] for n, v in meter.seconds.items()}
    samples = w.batch_size * w.block
    hand = secs["hand"]
    out = dict(workload=w.describe, compile=compiled, rounds=len(hand), block=w.block, device=str(ctx.device),
               compile_time_s=engine.compile_time_s, contestants={})
    for name, s in secs.items():
        ratios = [h / c for h, c in zip(hand, s)]
        host = meter.host[name][1:]
        row = dict(samples_per_s=round(samples / statistics.median(s), 2), ratio_to_hand=round(statistics.median(ratios), 4),
                   ratio_range=[round(min(ratios), 4), round(max(ratios), 4)],
                   host_share=round(statistics.median(h / t for h, t in zip(host, s)), 3))
        if meter.peak[name]:
            peak = statistics.median(meter.peak[name][1:])
            row.update(peak_mib=round(peak, 1), peak_ratio_to_hand=round(peak / statistics.median(meter.peak["hand"][1:]), 4))
        out["contestants"][name] = row
    lib = [out["contestants"][n] for n in ("engine", "trainer")]
    out["meets_throughput_target"] = all(r["ratio_to_hand"] >= 0.99 for r in lib)
    if ctx.cuda:
        out["meets_memory_target"] = all(r["peak_ratio_to_hand"] <= 1.02 for r in lib)
    return out


def section(workload: str, compiled: bool):
    """A gpu_check section for one workload: measured figures, status 'passed' when it ran (targets are reported,
    not enforced: they are the question this command answers)."""
    def run(ctx) -> dict:
        try:
            r = measure(ctx, workload, compiled)
        except ImportError as e:
            return dict(status="skipped", summary=f"{e.name or e} is not installed", reason=str(e))
        c = r["contestants"]
        summary = ", ".join(f"{n} {c[n]['ratio_to_hand']:.3f}x" for n in c if n != "hand")
        summary = f"hand {c['hand']['samples_per_s']:.0f}/s; {summary}"
        if ctx.cuda:
            summary += f"; peak engine {c['engine']['peak_ratio_to_hand']:.3f}x trainer {c['trainer']['peak_ratio_to_hand']:.3f}x"
        return dict(status="passed", summary=summary, **r)
    return run
