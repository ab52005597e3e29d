"""The training loop a careful user writes by hand, and the same training through colossal_lite, side by side.

Used by ``engine/test_exact_loop_matrix.py``: in the test process for one process, and as a torchrun script
(``python -m torch.distributed.run --nproc_per_node 2 exact_loop.py OUT``) for the data-parallel kinds; and by
``benchmarks/gpu_check.py`` on a GPU. Both loops run on the launched device (``device()``: CUDA where there is one). Each case
is {precision} x {data-parallel kind} x {accumulation 1, or 3 over 7 micro-batches: windows of 3, 3 and a partial
1}, with clipping, a model with BatchNorm and two param groups listed in another order than the model's (decay /
no-decay, as nanoGPT builds them). The hand loop is what torch's documentation says to write for the case:
``no_sync`` around forward and backward of a micro-batch that does not end its window (FSDP2:
``set_requires_gradient_sync``), the loss divided by its window's real size, ``GradScaler`` for fp16,
``clip_grad_norm_(model.parameters())``. Every collective either loop makes is counted per micro-step.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn

CLIP = 0.5
LR = 0.1
MICRO_BATCHES = 7
INIT_SCALE = 1024.0
PRECISIONS = ("fp32", "bf16", "fp16")
PARALLEL = ("ddp", "handler", "zero1", "zero2", "zero3")
ACCUMULATIONS = (1, 3)
LOOPS = ("engine", "trainer")


class Block(nn.Module):
    def __init__(self, din, dout):
        super().__init__()
        self.lin, self.norm = nn.Linear(din, dout), nn.BatchNorm1d(dout)

    def forward(self, x):
        return torch.relu(self.norm(self.lin(x)))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(6, 16), Block(16, 16), nn.Linear(16, 4))


def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """nanoGPT's grouping: matrices decay, biases and norm weights do not; the groups interleave the model's order."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.SGD([dict(params=decay, weight_decay=0.01), dict(params=no_decay, weight_decay=0.0)],
                           lr=LR, momentum=0.9)


def device() -> torch.device:
    """Where both loops run: the launched process's device (CUDA when the machine has it, as users train)."""
    from colossal_lite.core import global_context as gpc

    return gpc.device


def batches(rank: int):
    """The micro-batches of ``rank``, drawn on the CPU (the same numbers on every device) and placed on ``device()``."""
    g = torch.Generator().manual_seed(100 + rank)
    drawn = [(torch.randn(4, 6, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(MICRO_BATCHES)]
    return [(x.to(device()), y.to(device())) for x, y in drawn]


def windows(acc: int, n: int = MICRO_BATCHES):
    """(first, last, divisor) of each micro-batch: windows of ``acc`` from the epoch's start, the last one partial."""
    out = []
    for i in range(n):
        start = i - i % acc
        size = min(acc, n - start)
        out.append((i == start, i == start + size - 1, size))
    return out


# -- counting every collective ---------------------------------------------------------------------------------
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather",
                "reduce_scatter", "all_to_all", "_broadcast_coalesced", "all_gather_object", "broadcast_object_list")


class CollectiveCounter:
    """Counts, per micro-step, each torch.distributed collective called from Python and each DDP gradient bucket
    (DDP's reducer calls the process group from C++: a comm hook sees its all-reduces)."""

    def __init__(self):
        self.steps = []
        self._current = None
        self._originals = {}

    def begin(self):
        self._current = {}
        self.steps.append(self._current)

    def end(self):
        self._current = None

    def count(self, kind: str):
        if self._current is not None:
            self._current[kind] = self._current.get(kind, 0) + 1

    @contextlib.contextmanager
    def patched(self):
        for name in _COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._originals[name] = fn

            def counted(*args, _fn=fn, _name=name, **kwargs):
                self.count(_name)
                return _fn(*args, **kwargs)
            setattr(dist, name, counted)
        try:
            yield self
        finally:
            for name, fn in self._originals.items():
                setattr(dist, name, fn)

    def ddp_hook(self, state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.count("ddp_grad_bucket")
        return allreduce_hook(state, bucket)


# -- the hand-written loops --------------------------------------------------------------------------------------
NORMS = (nn.BatchNorm1d,)


def _hand_fsdp(model, stage: int, param_dtype):
    """FSDP2 as the user shards it: each block, then the root (the head stays in the root's unit); under low
    precision the BatchNorm layers are one unit that keeps fp32 parameters (their running statistics are fp32
    buffers FSDP2 does not cast, and ``batch_norm`` refuses bf16 weights next to them)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    reshard = stage == 3
    low = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    if param_dtype is not None:
        fully_shard([m for m in model.modules() if isinstance(m, NORMS)], reshard_after_forward=reshard)
    for block in model[:-1]:
        fully_shard(block, reshard_after_forward=reshard, mp_policy=low)
    fully_shard(model, reshard_after_forward=reshard, mp_policy=low)
    return model


def hand_loop(prec: str, parallel: str, acc: int, rank: int, counter: CollectiveCounter):
    """What a careful user writes for the case. Returns (model, losses)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build_model().to(device())
    world = dist.get_world_size() if dist.is_initialized() else 1
    kind = device().type
    dtype = dict(fp32=None, bf16=torch.bfloat16, fp16=torch.float16)[prec]
    if parallel in ("ddp", "zero1"):
        if world > 1:
            model = DDP(model, gradient_as_bucket_view=parallel == "zero1")
            model.register_comm_hook(None, counter.ddp_hook)
    elif parallel in ("zero2", "zero3"):
        model = _hand_fsdp(model, int(parallel[-1]), dtype)
    optimizer = build_optimizer(model.module if isinstance(model, DDP) else model)
    if parallel == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(optimizer.param_groups, optimizer_class=torch.optim.SGD, lr=LR,
                                            momentum=0.9, weight_decay=0.0)
    if prec == "fp16" and parallel in ("zero2", "zero3"):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler(kind, init_scale=INIT_SCALE)
    else:
        scaler = torch.amp.GradScaler(kind, init_scale=INIT_SCALE, enabled=prec == "fp16")
    losses = []
    for (x, y), (first, last, size) in zip(batches(rank), windows(acc)):
        counter.begin()
        if first:
            optimizer.zero_grad(set_to_none=True)
        if parallel in ("zero2", "zero3"):
            model.set_requires_gradient_sync(last)
            sync = contextlib.nullcontext()
        else:
            sync = model.no_sync() if not last and isinstance(model, DDP) else contextlib.nullcontext()
        with sync:
            with torch.autocast(kind, dtype=dtype, enabled=dtype is not None):
                loss = nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss / size).backward()
        losses.append(loss.detach().float().item())
        if last:
            if parallel == "handler" and world > 1:  # one flat all-reduce, then the mean over ranks
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat)
                flat.div_(world)
                offset = 0
                for g in grads:
                    g.copy_(flat[offset:offset + g.numel()].view_as(g))
                    offset += g.numel()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            scaler.step(optimizer)
            scaler.update()
        counter.end()
    return model, losses


# -- the same through colossal_lite ------------------------------------------------------------------------------
def config_for(prec: str, parallel: str, acc: int) -> dict:
    from colossal_lite.amp import AMP_TYPE

    config = dict(gradient_accumulation=acc, clip_grad_norm=CLIP)
    if prec == "bf16":
        config["fp16"] = dict(mode=AMP_TYPE.BF16)
    elif prec == "fp16":
        config["fp16"] = dict(mode=AMP_TYPE.TORCH, init_scale=INIT_SCALE)
    if parallel == "handler":
        config["gradient_handler"] = [dict(type="DataParallelGradientHandler")]
    elif parallel.startswith("zero"):
        config["zero"] = dict(stage=int(parallel[-1]))
    return config


def library_loop(prec: str, parallel: str, acc: int, loop: str, rank: int, counter: CollectiveCounter):
    """The case through ``initialize`` and the engine loop or ``Trainer.fit``. Returns (engine, losses)."""
    import colossal_lite
    from colossal_lite.core import global_context as gpc
    from colossal_lite.engine.strategy import DDPStrategy
    from colossal_lite.trainer import Trainer, hooks

    gpc.load_config(config_for(prec, parallel, acc))
    model = build_model()
    engine, loader, _, _ = colossal_lite.initialize(model, build_optimizer(model), nn.CrossEntropyLoss(),
                                                    batches(rank), verbose=False)
    if isinstance(engine.strategy, DDPStrategy):
        engine.model.register_comm_hook(None, counter.ddp_hook)
    losses = []
    if loop == "engine":
        for x, y in loader:
            counter.begin()
            engine.zero_grad()
            loss = engine.criterion(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float().item())
            counter.end()
        return engine, losses

    class Record(hooks.BaseHook):
        def before_train_iter(self, trainer):
            counter.begin()

        def after_train_iter(self, trainer, output, label, loss):
            counter.end()
            losses.append(loss.detach().float().item())

    Trainer(engine).fit(loader, epochs=1, hooks=[Record()], display_progress=False)
    return engine, losses


# -- comparing ---------------------------------------------------------------------------------------------------
def full_state(model) -> dict:
    """Parameters and buffers as full tensors (FSDP2's DTensors gathered: a collective)."""
    out = {}
    inner = getattr(model, "module", model)
    for name, t in list(inner.named_parameters()) + list(inner.named_buffers()):
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[name] = t.detach().clone()
    return out


def compare(prec, parallel, acc, loop, rank) -> dict:
    """One case, the library against the hand loop: differing tensors, collectives per micro-step, losses."""
    hand_counter, lib_counter = CollectiveCounter(), CollectiveCounter()
    with hand_counter.patched():
        hand_model, hand_losses = hand_loop(prec, parallel, acc, rank, hand_counter)
    with lib_counter.patched():
        engine, lib_losses = library_loop(prec, parallel, acc, loop, rank, lib_counter)
    hand, lib = full_state(hand_model), full_state(engine.unwrapped_model)
    differ = {n: float((hand[n].double() - lib[n].double()).abs().max()) for n in hand if not torch.equal(hand[n], lib[n])}
    return dict(differ=differ, names=sorted(hand), hand_collectives=hand_counter.steps,
                lib_collectives=lib_counter.steps, hand_losses=hand_losses, lib_losses=lib_losses,
                strategy=engine.strategy.name)


def bypass_case(rank: int) -> dict:
    """DDP, accumulation 2: each window's last forward calls ``engine.model(x)`` directly, bypassing the engine, so
    nothing announced where it stands; it must still all-reduce (and train as the hand loop does)."""
    import colossal_lite
    from colossal_lite.core import global_context as gpc

    counter = CollectiveCounter()
    gpc.load_config(dict(gradient_accumulation=2))
    model = build_model()
    engine, *_ = colossal_lite.initialize(model, build_optimizer(model), nn.CrossEntropyLoss(), verbose=False)
    engine.model.register_comm_hook(None, counter.ddp_hook)
    for i, (x, y) in enumerate(batches(rank)[:4]):
        counter.begin()
        engine.zero_grad()
        out = engine(x) if i % 2 == 0 else engine.model(x)
        engine.backward(engine.criterion(out, y))
        engine.step()
        counter.end()
    return dict(buckets=[s.get("ddp_grad_bucket", 0) for s in counter.steps], updates=engine.num_updates)


def run_all(cases, rank: int) -> dict:
    results = {}
    for case in cases:
        key = "/".join(map(str, case))
        try:
            results[key] = compare(*case, rank)
        except Exception as e:
            results[key] = dict(error=f"{type(e).__name__}: {e}", trace=traceback.format_exc())
    return results


def cases(parallel_kinds):
    return [(p, d, a, loop) for p in PRECISIONS for d in parallel_kinds for a in ACCUMULATIONS for loop in LOOPS]


if __name__ == "__main__":
    import colossal_lite
    from colossal_lite.core import global_context as gpc

    colossal_lite.launch_from_torch(config={}, verbose=False)
    rank = gpc.get_global_rank()
    kinds = sys.argv[2].split(",") if len(sys.argv) > 2 else PARALLEL
    results = run_all(cases(kinds), rank)
    if "ddp" in kinds:
        results["bypass"] = bypass_case(rank)
    with open(f"{sys.argv[1]}.rank{rank}", "w") as f:
        json.dump(results, f)
    gpc.destroy()
    os.environ.pop("MASTER_PORT", None)
