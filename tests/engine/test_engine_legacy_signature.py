"""``Engine`` built by hand as legacy scripts do: ``Engine(model, optimizer, criterion, gradient_handlers,
clip_grad_norm, ophook_list, verbose, schedule)``, positional or by keyword. The handlers run once per optimizer
update before clipping, so on two ranks they give the parameters of hand-written DDP with clipping."""
import pytest
import torch
import torch.distributed as dist
from engine_helpers import make_batches, make_model
from torch import nn

import colossal_lite
from colossal_lite.amp import AMP_TYPE, convert_to_amp
from colossal_lite.engine import Engine
from colossal_lite.engine.gradient_handler import BaseGradientHandler, DataParallelGradientHandler
from colossal_lite.engine.strategy import DDPStrategy
from colossal_lite.nn.optimizer import ColossalaiOptimizer
from colossal_lite.testing import assert_close, rerun_if_address_is_in_use, spawn


class CountingHandler(BaseGradientHandler):
    """Counts its calls and notes the gradient norm it saw (the norm clipping then measures)."""

    def __init__(self, model, optimizer):
        super().__init__(model, optimizer)
        self.norms = []

    def handle_gradient(self):
        grads = [p.grad.reshape(-1) for p in self._model.parameters() if p.grad is not None]
        self.norms.append(torch.linalg.vector_norm(torch.cat(grads)).item())


def _batches(rank, n):
    return make_batches(n, dout=3, seed=100 + rank)  # each rank its own data


def _model():
    return make_model(dh=8, dout=3)


def _run_two_ranks(rank, world_size, port):
    colossal_lite.launch(config={}, rank=rank, world_size=world_size, host="127.0.0.1", port=port, backend="gloo",
                         verbose=False)
    model, twin = _model(), _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    sync, counter = DataParallelGradientHandler(model, optimizer), CountingHandler(model, optimizer)
    # the legacy positional order: criterion, gradient_handlers, clip_grad_norm
    engine = Engine(model, optimizer, nn.CrossEntropyLoss(), [sync, counter], 0.05)

    ddp = nn.parallel.DistributedDataParallel(twin)  # the hand-written equivalent
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.5)
    for data, label in _batches(rank, 3):
        engine.zero_grad()
        engine.backward(engine.criterion(engine(data), label))
        engine.step()

        twin_opt.zero_grad()
        nn.functional.cross_entropy(ddp(data), label).backward()
        norm = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.05)
        twin_opt.step()
        assert counter.norms[-1] == pytest.approx(norm.item(), rel=1e-5)  # after the sync, before clipping
    assert len(counter.norms) == 3 and counter.norms[-1] > 0.05  # once per update; clipping did act
    for p, q in zip(model.parameters(), twin.parameters()):
        assert_close(p, q, rtol=1e-5, atol=1e-6)
    first = next(model.parameters()).detach()
    gathered = [torch.empty_like(first) for _ in range(world_size)]
    dist.all_gather(gathered, first)
    assert torch.equal(gathered[0], gathered[1])  # the ranks agree


@rerun_if_address_is_in_use()
def test_handlers_given_to_a_hand_built_engine_sync_two_ranks_like_ddp():
    spawn(_run_two_ranks, nprocs=2)


def test_keywords_of_the_legacy_signature_are_taken():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    counter = CountingHandler(model, optimizer)
    engine = Engine(model=model, optimizer=optimizer, criterion=nn.CrossEntropyLoss(), gradient_handlers=[counter],
                    clip_grad_norm=1.0, ophook_list=[], verbose=False, schedule=None)
    assert engine.clip_grad_norm == 1.0 and engine.strategy.handlers == [counter]
    for data, label in _batches(0, 2):
        engine.zero_grad()
        engine.backward(engine.criterion(engine(data), label))
        engine.step()
    assert len(counter.norms) == 2
    # the fifth positional argument is clip_grad_norm, as in legacy; None or [] handlers leave the default part
    assert Engine(model, optimizer, None, None, 2.0).clip_grad_norm == 2.0
    assert type(Engine(model, optimizer, None, []).strategy).__name__ == "SingleProcess"


def test_an_optimizer_wrapped_by_hand_in_colossalai_optimizer_trains_as_the_one_it_wraps(launched):
    """Legacy ``Engine`` and ``initialize`` took a ``ColossalaiOptimizer``; here they failed on it with an
    AttributeError (found by the legacy-scripts probe). The engine steps the optimizer it wraps, and a scheduler
    built on the wrapper follows the updates."""
    launched()
    batches = _batches(0, 3)
    hand = _model()
    hand_opt = torch.optim.SGD(hand.parameters(), lr=0.1)
    for data, label in batches:
        hand_opt.zero_grad()
        nn.functional.cross_entropy(hand(data), label).backward()
        hand_opt.step()
    for build in ("Engine", "initialize"):
        model = _model()
        wrapped = ColossalaiOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        if build == "Engine":
            engine = Engine(model, wrapped, nn.CrossEntropyLoss(), None, 0.0, None, False)
            scheduler = None
        else:
            scheduler = torch.optim.lr_scheduler.StepLR(wrapped, step_size=1, gamma=1.0)
            engine, _, _, scheduler = colossal_lite.initialize(model, wrapped, nn.CrossEntropyLoss(),
                                                               lr_scheduler=scheduler, verbose=False)
        for data, label in batches:
            engine.zero_grad()
            engine.backward(engine.criterion(engine(data), label))
            assert engine.step()
            if scheduler is not None:
                scheduler.step()
        assert engine.optimizer is wrapped.optim and engine.num_updates == 3, build
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), hand.parameters())), build
        if scheduler is not None:
            assert scheduler.last_epoch == 3


def test_an_optimizer_convert_to_amp_wrapped_is_refused_with_the_config_to_write(launched):
    launched()
    model = _model()
    _, amp_optimizer, _ = convert_to_amp(model, torch.optim.SGD(model.parameters(), lr=0.1), None, AMP_TYPE.TORCH)
    for build in (lambda: Engine(model, amp_optimizer, nn.CrossEntropyLoss()),
                  lambda: colossal_lite.initialize(model, amp_optimizer, nn.CrossEntropyLoss(), verbose=False)):
        with pytest.raises(TypeError, match=r"got an optimizer that convert_to_amp wrapped \(TorchAMPOptimizer\).* Fix: "
                                            r"pass the torch optimizer it wraps \(\.optim\) and set fp16 = "
                                            r"dict\(mode=AMP_TYPE\.TORCH\) in the config"):
            build()


def test_wrong_handlers_and_op_hooks_say_what_to_fix():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"Engine\(ophook_list=\.\.\.\): op-hooks \(Gemini\) are not supported .*"
                                         r"remove the argument"):
        Engine(model, optimizer, ophook_list=[object()])
    with pytest.raises(TypeError, match=r"item 0 is a str, which has no handle_gradient\(\); give handler objects, "
                                        r"e\.g\. DataParallelGradientHandler\(model, optimizer\)"):
        Engine(model, optimizer, None, ["DataParallelGradientHandler"])
    with pytest.raises(TypeError, match=r"must be a list of gradient handlers, got DataParallelGradientHandler"):
        Engine(model, optimizer, gradient_handlers=DataParallelGradientHandler(model, optimizer))
    with pytest.raises(ValueError, match=r"both gradient_handlers and strategy=DDPStrategy.*give one of the two"):
        Engine(model, optimizer, gradient_handlers=[CountingHandler(model, optimizer)], strategy=DDPStrategy())
