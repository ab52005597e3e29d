"""Precision x data parallel, each with gradient accumulation 2, clipping, an LR scheduler built before
``initialize`` (the legacy order) and BatchNorm, on 2 ranks: every combination trains to the DDP run of the same
precision, or the config check refuses it saying why.

The whole matrix runs in one 2-rank torchrun launch that re-initializes the engine for each combination.
Parameters are compared, not BatchNorm's running statistics: DDP broadcasts rank 0's buffers before each forward,
the gradient handler and ZeRO keep each rank's own (neither changes a training-mode loss).
"""
import json
from pathlib import Path

import pytest
import torch
from dist_helpers import run_ranks

RANK_SCRIPT = r'''
import json, math, sys, traceback
import torch
from torch import nn
sys.path.insert(0, {tests!r})
import colossal_lite
from colossal_lite.amp import AMP_TYPE
from colossal_lite.context.config import ConfigException
from colossal_lite.core import global_context as gpc
from engine_helpers import make_batches
from exact_loop import Block  # Linear -> BatchNorm1d -> ReLU

def build():
    torch.manual_seed(0)
    return nn.Sequential(Block(6, 16), Block(16, 16), nn.Linear(16, 4))

PRECISIONS = dict(fp32=None, bf16=dict(mode=AMP_TYPE.BF16), fp16=dict(mode=AMP_TYPE.TORCH, init_scale=1024.0),
                  naive=dict(mode=AMP_TYPE.NAIVE, initial_scale=1024.0))
PARALLEL = dict(ddp={{}}, handler=dict(gradient_handler=[dict(type="DataParallelGradientHandler")]),
                zero1=dict(zero=dict(stage=1)), zero2=dict(zero=dict(stage=2)), zero3=dict(zero=dict(stage=3)))

def run(config):
    model = build()
    head = list(model[2].parameters())
    head_ids = set(map(id, head))
    body = [p for p in model.parameters() if id(p) not in head_ids]
    optimizer = torch.optim.SGD([dict(params=body), dict(params=head, lr=0.05)], lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=4, eta_min=0.01)  # before initialize
    engine, loader, _, scheduler = colossal_lite.initialize(model, optimizer, nn.CrossEntropyLoss(),
                                                            make_batches(8, b=8), lr_scheduler=scheduler, verbose=False)
    rank, world = gpc.get_global_rank(), gpc.get_world_size()
    losses, lrs, user_lrs = [], [], []
    for x, y in loader:
        half = x.shape[0] // world
        x, y = x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]
        engine.zero_grad()
        loss = engine.criterion(engine(x), y)
        engine.backward(loss)
        losses.append(float(loss.detach()))
        if engine.step():
            scheduler.step()
            lrs.append([g["lr"] for g in engine.optimizer.param_groups])
            user_lrs.append([g["lr"] for g in optimizer.param_groups])
    names = [n for n, _ in build().named_parameters()]
    state = engine.state_dict()["model"]  # collective: full parameters on every rank
    return dict(losses=losses, lrs=lrs, user_lrs=user_lrs, params={{n: state[n].float().tolist() for n in names}},
                strategy=engine.strategy.name)

colossal_lite.launch_from_torch(config={{}}, verbose=False)
result = {{}}
for prec, fp16 in PRECISIONS.items():
    for dp, extra in PARALLEL.items():
        config = dict(gradient_accumulation=2, clip_grad_norm=0.5, **extra)
        if fp16 is not None:
            config["fp16"] = fp16
        try:
            gpc.load_config(config)  # what launch and colossal-lite check run
        except ConfigException as e:
            result[f"{{prec}}/{{dp}}"] = dict(refused=str(e))
            continue
        try:
            result[f"{{prec}}/{{dp}}"] = run(config)
        except Exception as e:
            result[f"{{prec}}/{{dp}}"] = dict(error=f"{{type(e).__name__}}: {{e}}", trace=traceback.format_exc())
for stage in (1, 2):  # an optimizer that has stepped holds state for the unsharded parameters: refused
    gpc.load_config(dict(zero=dict(stage=stage)))
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 6)).sum().backward()
    optimizer.step()
    try:
        colossal_lite.initialize(model, optimizer, verbose=False)
        result[f"stepped/zero{{stage}}"] = "accepted"
    except ValueError as e:
        result[f"stepped/zero{{stage}}"] = str(e)
with open({out!r} + f".rank{{gpc.get_global_rank()}}", "w") as f:
    json.dump(result, f)
gpc.destroy()
'''

PRECISIONS = ("fp32", "bf16", "fp16", "naive")
PARALLEL = ("handler", "zero1", "zero2", "zero3")
# Tolerance against DDP of the same precision (absolute and relative): the runs differ by summation order only
# (ZeRO 2/3 reduce-scatter instead of all-reduce, the gradient handler sums fp16 gradients before dividing).
TOLERANCE = dict(fp32=1e-5, bf16=1e-4, fp16=1e-4, naive=1e-3)
# Combinations the config check refuses, and the reason it must give.
REFUSED = {("naive", "zero2"): "AMP_TYPE.NAIVE",
           ("naive", "zero3"): "AMP_TYPE.NAIVE"}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero_matrix")
    script = tmp / "matrix_rank.py"
    script.write_text(RANK_SCRIPT.format(tests=str(Path(__file__).parents[1]), out=str(tmp / "result")))
    run_ranks(script, nproc=2, timeout=240)
    return [json.loads((tmp / f"result.rank{r}").read_text()) for r in (0, 1)]


def _ran(results, key):
    for res in results:
        assert "error" not in res[key], f"{key} failed on a rank:\n{res[key]['trace']}"
        assert "refused" not in res[key], f"{key} was refused: {res[key]['refused']}"
    return results


def _assert_same_training(results, key, ref_key, tol):
    for res in _ran(_ran(results, ref_key), key):
        ref, got = res[ref_key], res[key]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=tol, atol=tol)
        for name in ref["params"]:
            torch.testing.assert_close(torch.tensor(got["params"][name]), torch.tensor(ref["params"][name]),
                                       rtol=tol, atol=tol, msg=lambda m, n=name: f"{key}, parameter {n}: {m}")


@pytest.mark.parametrize("dp", PARALLEL)
@pytest.mark.parametrize("prec", PRECISIONS)
def test_combination_matches_ddp_or_is_refused(matrix, prec, dp):
    key = f"{prec}/{dp}"
    if (prec, dp) in REFUSED:
        for res in matrix:
            assert "refused" in res[key], f"{key} should be refused by the config check, got {res[key].keys()}"
            assert REFUSED[(prec, dp)] in res[key]["refused"] and "Fix:" in res[key]["refused"]
        return
    _assert_same_training(matrix, key, f"{prec}/ddp", TOLERANCE[prec])


@pytest.mark.parametrize("dp", ("zero1", "zero2", "zero3"))
def test_scheduler_built_before_initialize_drives_every_stage(matrix, dp):
    """The legacy order (optimizer, scheduler, then initialize): the scheduler moves the LR the engine's optimizer
    uses under every ZeRO stage, in the user's optimizer too, and training equals DDP's."""
    for res in _ran(_ran(matrix, "fp32/ddp"), f"fp32/{dp}"):
        ref, got = res["fp32/ddp"], res[f"fp32/{dp}"]
        assert len(ref["lrs"]) == 4 and ref["lrs"][0] != ref["lrs"][-1]  # the schedule really moves
        assert got["lrs"] == ref["lrs"]
        assert got["user_lrs"] == got["lrs"]
    _assert_same_training(matrix, f"fp32/{dp}", "fp32/ddp", TOLERANCE["fp32"])


@pytest.mark.parametrize("prec", ("bf16", "fp16"))
@pytest.mark.parametrize("dp", ("zero2", "zero3"))
def test_batchnorm_trains_under_low_precision_and_sharding(matrix, prec, dp):
    """bf16/fp16 with ZeRO 2/3 on a model with BatchNorm trains like DDP with the same precision."""
    _assert_same_training(matrix, f"{prec}/{dp}", f"{prec}/ddp", TOLERANCE[prec])


@pytest.mark.parametrize("stage", (1, 2))
def test_an_optimizer_that_has_stepped_is_refused(matrix, stage):
    for res in matrix:
        message = res[f"stepped/zero{stage}"]
        assert f"zero stage {stage}: the optimizer passed to initialize() has already taken a step" in message
        assert "Fix: pass an optimizer that has not stepped yet" in message
