"""An optimizer that evaluates the loss itself (``torch.optim.LBFGS``, as in pytorch/examples'
time_sequence_prediction) through ``engine.step(closure)``, and ``engine.zero_grad()`` after a backward that no
update followed: both against the loop a user writes with plain PyTorch, bit for bit."""
import pytest
import torch
from dist_helpers import run_ranks
from engine_helpers import make_batches, make_model
from torch import nn

import colossal_lite
from colossal_lite.engine import Engine
from colossal_lite.engine.accumulation import AccumulationWindow
from colossal_lite.engine.loss_guard import build_loss_guard
from colossal_lite.engine.strategy import DDPStrategy
from colossal_lite.engine.zero import FSDPStrategy, ZeroStage1Strategy

LOSS = nn.MSELoss()


def _data(n=32):
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 6, generator=g), torch.randn(n, 4, generator=g)


def _lbfgs(model):
    # line search and a tolerance on the loss: each step calls the closure a number of times the losses decide
    return torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=6, history_size=4, line_search_fn="strong_wolfe")


def _hand_lbfgs(steps, clip=0.0):
    x, y = _data()
    model = make_model(dout=4)
    opt = _lbfgs(model)
    calls = []

    def closure():
        opt.zero_grad()
        loss = LOSS(model(x), y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        calls.append(float(loss.detach()))
        return loss

    for _ in range(steps):
        opt.step(closure)
    return model, calls


def _engine_lbfgs(launched, steps, config=None):
    launched(config or {})
    x, y = _data()
    model = make_model(dout=4)
    engine, *_ = colossal_lite.initialize(model, _lbfgs(model), LOSS, verbose=False)
    calls = []
    closure = engine_closure(engine, x, y, calls)
    updated = [engine.step(closure) for _ in range(steps)]
    return engine, calls, updated


def engine_closure(engine, x, y, calls=None):
    """The closure a user writes for ``engine.step(closure)``; ``calls`` collects each evaluation's loss."""
    def closure():
        engine.zero_grad()
        loss = engine.criterion(engine(x), y)
        engine.backward(loss)
        if calls is not None:
            calls.append(float(loss.detach()))
        return loss
    return closure


def _assert_equal_params(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_lbfgs_through_engine_step_closure_equals_the_plain_loop(launched, clip):
    engine, calls, updated = _engine_lbfgs(launched, 3, dict(clip_grad_norm=clip) if clip else None)
    hand, hand_calls = _hand_lbfgs(3, clip)
    assert len(calls) > 3  # the optimizer evaluated the loss several times per update
    assert calls == hand_calls
    _assert_equal_params(engine.unwrapped_model, hand)
    assert updated == [True, True, True] and engine.num_updates == 3
    assert engine.window.at_start  # each update closed its window


def test_a_scheduler_from_initialize_steps_once_per_closure_update(launched):
    launched({})
    x, y = _data()
    model = make_model(dout=4)
    optimizer = _lbfgs(model)
    engine, _, _, sched = colossal_lite.initialize(model, optimizer, LOSS,
                                                   lr_scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5),
                                                   verbose=False)
    for _ in range(2):
        engine.step(engine_closure(engine, x, y))
        sched.step()
    assert optimizer.param_groups[0]["lr"] == 0.5 * 0.25


def test_a_closure_without_engine_backward_is_refused(launched):
    launched({})
    x, y = _data()
    model = make_model(dout=4)
    engine, *_ = colossal_lite.initialize(model, _lbfgs(model), LOSS, verbose=False)

    def closure():
        engine.zero_grad()
        loss = engine.criterion(engine(x), y)
        loss.backward()
        return loss

    with pytest.raises(RuntimeError, match=r"the closure ran no engine.backward\(loss\)"):
        engine.step(closure)


@pytest.mark.parametrize("part,match", [
    ("accumulation", "gradient_accumulation=1"),
    ("naive fp16", "fp16 loss scaling"),
    ("zero1", "ZeRO stage 1"),
    ("zero3", "Fix: without zero"),
    ("skip", "nonfinite_loss='skip'"),
])
def test_what_cannot_run_an_optimizers_closure_is_refused_before_anything_runs(part, match):
    from colossal_lite.amp.precision import NaiveAMPPrecision

    model = make_model()
    kwargs = dict(accumulation=dict(window=AccumulationWindow(2)),
                  zero1=dict(strategy=ZeroStage1Strategy()),
                  zero3=dict(strategy=FSDPStrategy(stage=3)))
    kwargs["naive fp16"] = dict(precision=NaiveAMPPrecision())
    kwargs["skip"] = dict(loss_guard=build_loss_guard("skip", None))
    engine = Engine(model, _lbfgs(model), LOSS, **kwargs[part])
    ran = []
    with pytest.raises(ValueError, match=match):
        engine.step(lambda: ran.append(1))
    assert not ran


def test_ddp_is_a_strategy_that_takes_closures():
    assert DDPStrategy.takes_closures and DDPStrategy.data_parallel
    assert not ZeroStage1Strategy.takes_closures and not FSDPStrategy.takes_closures


@pytest.mark.parametrize("accumulation", [1, 2])
def test_zero_grad_after_a_backward_that_no_update_followed_starts_the_micro_batch_over(launched, accumulation):
    """A loop over the user's own loader that skips the update of a batch (a loss spike): the next batch's
    ``zero_grad()`` drops the skipped batch's gradients, as ``optimizer.zero_grad()`` does in the plain loop.
    With accumulation the skipped batch opened a window: the window starts over with the next batch."""
    launched(dict(gradient_accumulation=accumulation))
    model = make_model()
    engine, *_ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                          nn.CrossEntropyLoss(), verbose=False)
    hand = make_model()
    opt = torch.optim.SGD(hand.parameters(), lr=0.1)
    batches = make_batches(2 + 4 * accumulation)
    skip = {0, 1 + accumulation}  # batches that each open a window and get no update
    for i, (x, y) in enumerate(batches):
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        if i not in skip:
            engine.step()
    # the plain loop: a skipped batch's gradients are cleared by the next zero_grad, each window of
    # `accumulation` kept batches adds its losses / accumulation
    kept = [b for i, b in enumerate(batches) if i not in skip]
    for w in range(0, len(kept) - len(kept) % accumulation, accumulation):
        opt.zero_grad()
        for x, y in kept[w:w + accumulation]:
            (nn.functional.cross_entropy(hand(x), y) / accumulation).backward()
        opt.step()
    assert engine.num_updates == len(kept) // accumulation
    _assert_equal_params(engine.unwrapped_model, hand)


RANKS = r'''
import json, sys
import torch
import torch.distributed as dist
from torch import nn
import colossal_lite
from colossal_lite.core import global_context as gpc
sys.path.insert(0, {tests!r})
from engine_helpers import make_model

colossal_lite.launch_from_torch(config=dict(clip_grad_norm=0.05), verbose=False)
rank, world = dist.get_rank(), dist.get_world_size()
g = torch.Generator().manual_seed(3)
x, y = torch.randn(32, 6, generator=g), torch.randn(32, 4, generator=g)
x, y = x[rank::world], y[rank::world]
lbfgs = lambda m: torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=6, history_size=4, line_search_fn="strong_wolfe")

# the plain DDP loop: each rank's closure returns the mean loss over the ranks, so that the optimizer's line
# search decides alike everywhere (with each rank's own loss the ranks could call the closure a different
# number of times, and DDP's all-reduces would no longer pair up)
hand = nn.parallel.DistributedDataParallel(make_model(dout=4))
opt = lbfgs(hand)
hand_calls = []
def closure():
    opt.zero_grad()
    loss = nn.functional.mse_loss(hand(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(hand.parameters(), 0.05)
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    hand_calls.append(float(mean / world))
    return mean / world
for _ in range(3):
    opt.step(closure)

model = make_model(dout=4)
engine, *_ = colossal_lite.initialize(model, lbfgs(model), nn.MSELoss(), verbose=False)
calls = []
def engine_closure():
    engine.zero_grad()
    loss = engine.criterion(engine(x), y)
    engine.backward(loss)
    return loss
for _ in range(3):
    engine.step(lambda: calls.append(1) or engine_closure())
equal = all(torch.equal(p, q) for p, q in zip(engine.unwrapped_model.parameters(), hand.module.parameters()))
with open(sys.argv[1] + f".rank{{rank}}", "w") as f:
    json.dump(dict(equal=equal, calls=len(calls), hand_calls=len(hand_calls)), f)
gpc.destroy()
'''


def test_lbfgs_on_two_ranks_equals_the_plain_ddp_loop(tmp_path):
    import json
    from pathlib import Path

    script = tmp_path / "lbfgs_ranks.py"
    script.write_text(RANKS.format(tests=str(Path(__file__).parents[1])))
    run_ranks(script, [tmp_path / "out"], nproc=2, timeout=120)
    results = [json.loads((tmp_path / f"out.rank{r}").read_text()) for r in (0, 1)]
    for r in results:
        assert r["equal"], results
        assert r["calls"] == r["hand_calls"] > 3, results
