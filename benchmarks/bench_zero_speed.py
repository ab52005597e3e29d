"""Time per update of DDP and ZeRO 1/2/3 through colossal_lite against the hand-written loop of each, on 2 ranks.

Run: python benchmarks/bench_zero_speed.py [--models gpt2,resnet] [--precisions fp32,bf16] [--runs 4]
                                           [--rounds 4] [--steps 2] [--nproc 2] [--glibc-malloc]
                                           [--hand-under-setting] [--zero-env NAME=VALUE]

Workloads (CPU, gloo on 127.0.0.1, one thread per rank, AdamW, no clipping, no accumulation):
- ``gpt2``: a Hugging Face ``GPT2LMHeadModel`` (4 blocks, width 128, 4 heads, vocabulary 1024), sequences of 64
  tokens, 4 per rank; a thin wrapper returns the logits, so the library finds the blocks through the wrapper.
- ``resnet``: torchvision ``resnet18`` (10 classes) on 32x32 images, 4 per rank.

The hand-written loops are what the FSDP2 / DDP documentation says to write: ``DDP(model)`` (torch's defaults);
ZeRO 1 = ``DDP(model, gradient_as_bucket_view=True)`` with ``ZeroRedundancyOptimizer``; ZeRO 2/3 = ``fully_shard``
on each block (``GPT2Block``, ``BasicBlock``) and the root with ``reshard_after_forward`` False / True, under
bf16 a ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` and the BatchNorm layers as one fp32 unit
(``batch_norm`` refuses bf16 weights next to its fp32 running statistics); ``torch.autocast`` around forward and
loss under bf16. The library runs ``initialize`` with ``zero=dict(stage=N)`` (and ``fp16=dict(mode=AMP_TYPE.BF16)``)
and the engine loop. Every library contestant first trains two steps beside a twin hand loop in its own process
and must hold the same parameters and buffers (``torch.equal``).

The allocator: on the CPU the library's ZeRO 2 and 3 set glibc's ``mallopt`` (process-wide), which a user's own loop
does not. So the contestants live in two kinds of 2-rank launch: "plain" (every hand loop, and the library's DDP
and ZeRO 1, which leave the allocator alone) and "zero" (the library's ZeRO 2 and 3). ``--runs`` pairs of launches are
alternated (plain, zero, then zero, plain); in a launch each contestant runs ``--steps`` updates per round, after
a barrier, ``--rounds`` times. Reported per pair: the library's median ms per update over the rounds divided by
its hand loop's; then the median of those ratios over the pairs. Target: <= 1.05. ``--hand-under-setting``
gives the hand loops ZeRO's setting too (the library's own overhead alone); ``--glibc-malloc`` runs the library
under glibc's defaults (it leaves the allocator alone when a ``glibc.malloc`` tunable is set;
``glibc.malloc.check=0`` is glibc's default); ``--zero-env NAME=VALUE`` sets a variable for the ZeRO launches
only (for example ``GLIBC_TUNABLES``, read by glibc at process start). Minor page faults (``ru_minflt``) per update
are reported for each side: the fresh pages the kernel maps for memory the allocator took anew. The machine is shared: other processes' load shows as noise in every
figure; the load average is printed.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

KINDS = ("ddp", "zero1", "zero2", "zero3")
LIBRARY_IN_PLAIN = ("ddp", "zero1")  # the library's kinds that leave glibc's allocator settings alone
TARGET = 1.05


def build_model(name: str):
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name == "resnet":
        import torchvision

        return torchvision.models.resnet18(num_classes=10), "BasicBlock"
    import transformers

    config = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=1024, n_positions=64,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt = transformers.GPT2LMHeadModel(config)

        def forward(self, ids):
            return self.gpt(input_ids=ids).logits

    return LM(), "GPT2Block"


def criterion():
    import torch

    class TokenLoss(torch.nn.Module):
        def forward(self, logits, target):
            return torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), target.flatten())

    return TokenLoss()


def batch(name: str, rank: int):
    import torch

    g = torch.Generator().manual_seed(rank)
    if name == "resnet":
        return torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)
    ids = torch.randint(0, 1024, (4, 65), generator=g)
    return ids[:, :-1], ids[:, 1:]


def hand_setup(kind: str, model, block: str, dtype):
    """The hand-written wrapping of ``kind`` -> (model, optimizer)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    if kind in ("ddp", "zero1"):
        model = DDP(model, gradient_as_bucket_view=kind == "zero1")
        if kind == "ddp":
            return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
    reshard = kind == "zero3"
    if dtype is not None:
        norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
        if norms:
            fully_shard(norms, reshard_after_forward=reshard)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype is not None else None)
    for m in model.modules():
        if type(m).__name__ == block:
            fully_shard(m, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, reshard_after_forward=reshard, mp_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def hand_step(model, optimizer, loss_fn, dtype, x, y):
    import torch

    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()


def library_setup(kind: str, model, prec: str):
    import torch

    import colossal_lite
    from colossal_lite.amp import AMP_TYPE
    from colossal_lite.core import global_context as gpc

    config = {} if kind == "ddp" else dict(zero=dict(stage=int(kind[-1])))
    if prec == "bf16":
        config["fp16"] = dict(mode=AMP_TYPE.BF16)
    gpc.load_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return colossal_lite.initialize(model, optimizer, criterion(), verbose=False)[0]


def library_step(engine, x, y):
    engine.zero_grad()
    engine.backward(engine.criterion(engine(x), y))
    engine.step()


def warmed(setup_and_step):
    """Two updates, so that every contestant is timed in its steady state (optimizer state, FSDP buffers)."""
    for _ in range(2):
        setup_and_step()
    return setup_and_step


def contestants(name: str, prec: str, rank: int, launch_kind: str):
    """{(kind, side): one update} of the contestants that run in a launch of ``launch_kind``: "plain" holds every
    hand-written loop and the library's DDP and ZeRO 1 (none touches the allocator), "zero" the library's ZeRO 2/3. A
    library contestant is first checked against a twin hand loop in its own process: after two updates each, the
    same parameters and buffers (``torch.equal``)."""
    import torch

    from colossal_lite.checkpoint.model_state import unwrap_module

    dtype = torch.bfloat16 if prec == "bf16" else None
    x, y = batch(name, rank)
    loss_fn = criterion()
    steps = {}
    for kind in KINDS:
        if launch_kind == "zero" and kind in LIBRARY_IN_PLAIN:
            continue
        model, block = build_model(name)
        hand_model, optimizer = hand_setup(kind, model, block, dtype)
        hand = warmed(lambda m=hand_model, o=optimizer: hand_step(m, o, loss_fn, dtype, x, y))
        if launch_kind == "plain":
            steps[kind, "hand"] = hand
        library_here = (kind in LIBRARY_IN_PLAIN) == (launch_kind == "plain")
        if not library_here:
            continue
        engine = library_setup(kind, build_model(name)[0], prec)
        steps[kind, "lib"] = warmed(lambda e=engine: library_step(e, x, y))
        hand_state = {k: getattr(v, "full_tensor", lambda v=v: v)() for k, v in
                      unwrap_module(hand_model).state_dict().items()}
        lib_state = engine.state_dict()["model"]
        differ = [k for k in hand_state if not torch.equal(hand_state[k], lib_state[k])]
        if differ:
            raise SystemExit(f"{name}/{prec}/{kind}: the library trained differently from the hand loop: {differ[:5]}")
    return steps


def time_rounds(steps: dict, rounds: int, per_round: int) -> dict:
    """ms per update of each contestant in each round; the contestants of a launch take turns (their order
    reversed every other round), each after a barrier."""
    import resource

    import torch.distributed as dist

    times = {key: [] for key in steps}
    faults = {key: [] for key in steps}
    for r in range(rounds):
        for key in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            dist.barrier()
            f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            for _ in range(per_round):
                steps[key]()
            times[key].append((time.perf_counter() - t0) / per_round * 1e3)
            faults[key].append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / per_round)
    return {**{f"{k}/{s}": v for (k, s), v in times.items()},
            **{f"{k}/{s}/faults": v for (k, s), v in faults.items()}}


def worker(args):
    import torch

    import colossal_lite
    from colossal_lite.core import global_context as gpc
    from colossal_lite.engine.zero import return_large_frees_to_the_system

    torch.set_num_threads(1)
    colossal_lite.launch_from_torch(config={}, verbose=False)
    if args.launch_kind == "plain" and args.hand_under_setting:
        return_large_frees_to_the_system()
    rank = gpc.get_global_rank()
    results = {}
    for name in args.models.split(","):
        for prec in args.precisions.split(","):
            steps = contestants(name, prec, rank, args.launch_kind)
            results[f"{name}/{prec}"] = time_rounds(steps, args.rounds, args.steps)
            del steps
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    gpc.destroy()


def launch(args, launch_kind: str) -> dict:
    """One 2-rank launch of ``launch_kind``: {workload: {kind/side: the largest rank's ms per update, per round}}."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}", "--master_addr=127.0.0.1",
           f"--master_port={port}", __file__, "--models", args.models, "--precisions", args.precisions,
           "--rounds", str(args.rounds), "--steps", str(args.steps), "--launch-kind", launch_kind]
    if args.hand_under_setting:
        cmd.append("--hand-under-setting")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if args.glibc_malloc:
        env["GLIBC_TUNABLES"] = "glibc.malloc.check=0"
    if launch_kind == "zero":
        env.update(zero_env(args))
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run(cmd + ["--out", out], env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            sys.exit(f"torchrun exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        ranks = []
        for rank in range(args.nproc):
            with open(os.path.join(out, f"rank{rank}.json")) as f:
                ranks.append(json.load(f))
    return {w: {key: [max(v) for v in zip(*(r[w][key] for r in ranks))] for key in ranks[0][w]} for w in ranks[0]}


def zero_env(args) -> dict:
    """The ``--zero-env NAME=VALUE`` variables, set for the library's ZeRO launches only."""
    pairs = [item.partition("=") for item in args.zero_env]
    bad = [name for name, eq, _ in pairs if not eq or not name]
    if bad:
        sys.exit(f"--zero-env takes NAME=VALUE (for example GLIBC_TUNABLES=glibc.malloc.hugetlb=1); got {bad}")
    return {name: value for name, _, value in pairs}


def paired_launches(args) -> list:
    """``--runs`` pairs of launches, "plain" then "zero" and the next pair the other way round, merged per pair."""
    pairs = []
    for i in range(args.runs):
        merged = {}
        for launch_kind in (("plain", "zero") if i % 2 == 0 else ("zero", "plain")):
            for workload, times in launch(args, launch_kind).items():
                merged.setdefault(workload, {}).update(times)
        pairs.append(merged)
    return pairs


def report(pairs: list) -> bool:
    """One line per workload and kind: the median over pairs of launches of each side's median ms per update,
    the ratio in each pair (library median / hand median) and the median of those ratios."""
    ok = True
    med = statistics.median
    print(f"{'workload':14}{'kind':7}{'hand ms':>9}{'lib ms':>9}{'faults/update hand, lib':>25}{'lib/hand':>10}"
          f"  per pair")
    for workload in pairs[0]:
        for kind in KINDS:
            hand = [med(p[workload][f"{kind}/hand"]) for p in pairs]
            lib = [med(p[workload][f"{kind}/lib"]) for p in pairs]
            faults = [med(med(p[workload][f"{kind}/{side}/faults"]) for p in pairs) for side in ("hand", "lib")]
            ratios = [b / a for a, b in zip(hand, lib)]
            ratio = med(ratios)
            ok = ok and ratio <= TARGET
            print(f"{workload:14}{kind:7}{med(hand):9.1f}{med(lib):9.1f}{faults[0]:13.0f}{faults[1]:12.0f}"
                  f"{ratio:10.3f}  "
                  f"{' '.join(f'{r:.2f}' for r in ratios)}  {'PASS' if ratio <= TARGET else 'FAIL'} (<= {TARGET})")
    return ok


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,resnet")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--runs", type=int, default=4, help="pairs of launches (plain, zero), alternated")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per launch (each contestant once per round)")
    parser.add_argument("--steps", type=int, default=2, help="updates per contestant per round")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--glibc-malloc", action="store_true", help="the library's ZeRO without its mallopt setting")
    parser.add_argument("--hand-under-setting", action="store_true",
                        help="the hand loops (and DDP) under ZeRO's mallopt setting too: the library's own overhead")
    parser.add_argument("--zero-env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for the library's ZeRO launches only (repeatable)")
    parser.add_argument("--launch-kind", choices=("plain", "zero"), help=argparse.SUPPRESS)  # set in the ranks
    parser.add_argument("--out", help=argparse.SUPPRESS)  # the folder the ranks write their results to
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    start = time.perf_counter()
    load = os.getloadavg()
    ok = report(paired_launches(args))
    zero = "glibc default" if args.glibc_malloc else "as ZeRO sets it"
    if args.zero_env:
        zero = f"the environment's {zero_env(args)} (ZeRO leaves a glibc.malloc tunable alone)"
    hand = "as ZeRO sets it" if args.hand_under_setting else "glibc default"
    print(f"{args.nproc} ranks, gloo, CPU, {args.runs} pairs of launches x {args.rounds} rounds x {args.steps} "
          f"updates; malloc: library ZeRO {zero}, hand loops and DDP {hand}; load average {load[0]:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after; {time.perf_counter() - start:.0f} s")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
