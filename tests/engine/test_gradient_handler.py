"""Custom gradient handlers (the gradient-handler documentation page): a class registered in GRADIENT_HANDLER and
named in ``gradient_handler = [dict(type=...)]`` is built with the model and optimizer and called once per
optimizer update, before clipping, on every rank."""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import colossal_lite
from colossal_lite.context import ConfigException
from colossal_lite.context.validation import load_config
from colossal_lite.core import global_context as gpc
from colossal_lite.engine.gradient_handler import BaseGradientHandler, DataParallelGradientHandler
from colossal_lite.registry import GRADIENT_HANDLER
from colossal_lite.testing import assert_close, parameterize, rerun_if_address_is_in_use, spawn


@GRADIENT_HANDLER.register_module
class MyGradientHandler(BaseGradientHandler):
    """Average the gradients over the ranks by hand, and note what it saw."""

    def __init__(self, model, optimizer, scale: float = 1.0):
        super().__init__(model, optimizer)
        self.scale = scale
        self.norms = []

    def handle_gradient(self):
        world = dist.get_world_size() if dist.is_initialized() else 1
        grads = [p.grad for p in self._model.parameters() if p.grad is not None]
        for g in grads:
            if world > 1:
                dist.all_reduce(g)
            g.mul_(self.scale / world)
        self.norms.append(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads])).item())


@GRADIENT_HANDLER.register_module
class CountingHandler(BaseGradientHandler):
    """Only counts its calls: whatever syncs the gradients, it is another handler."""

    calls = 0

    def handle_gradient(self):
        self.calls += 1


def _batches(rank, n):
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    return [(torch.randn(4, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen)) for _ in range(n)]


def _train(engine, batches):
    engine.train()
    for data, label in batches:
        engine.zero_grad()
        loss = engine.criterion(engine(data), label)
        engine.backward(loss)
        engine.step()


def _run_handler_vs_ddp(rank, world_size, port):
    config = dict(gradient_handler=[dict(type="MyGradientHandler")], gradient_accumulation=2, clip_grad_norm=0.05)
    colossal_lite.launch(config=config, rank=rank, world_size=world_size, host="127.0.0.1", port=port,
                         backend="gloo", verbose=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    twin = copy.deepcopy(model)
    engine, *_ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5), nn.CrossEntropyLoss(),
                                          verbose=False)
    handler, = engine.strategy.handlers
    assert isinstance(handler, MyGradientHandler) and handler._model is model
    assert handler._optimizer is engine.optimizer
    assert not isinstance(engine.model, nn.parallel.DistributedDataParallel)  # the handler replaces DDP

    # the built-in handler listed with another one runs as a handler too
    triplet = copy.deepcopy(twin)
    gpc.config["gradient_handler"] = [dict(type="DataParallelGradientHandler", bucket_size_mb=0.0001),
                                      dict(type="CountingHandler")]
    mixed_engine, *_ = colossal_lite.initialize(triplet, torch.optim.SGD(triplet.parameters(), lr=0.5),
                                                nn.CrossEntropyLoss(), verbose=False)
    counter = mixed_engine.strategy.handlers[1]

    del gpc.config["gradient_handler"]  # the same run with torch DDP, for comparison
    ddp_engine, *_ = colossal_lite.initialize(twin, torch.optim.SGD(twin.parameters(), lr=0.5), nn.CrossEntropyLoss(),
                                              verbose=False)
    assert isinstance(ddp_engine.model, nn.parallel.DistributedDataParallel)

    batches = _batches(rank, 4)  # 2 optimizer updates of 2 micro-batches
    for e in (engine, mixed_engine, ddp_engine):
        _train(e, batches)
    assert len(handler.norms) == 2 and counter.calls == 2  # once per optimizer update
    for p, q in zip(triplet.parameters(), twin.parameters()):
        assert_close(p, q, rtol=1e-5, atol=1e-6)
    # before clipping: the norm the handler left is the one clipping measured (well above the 0.05 limit)
    assert handler.norms[-1] == pytest.approx(engine.grad_norm.item(), rel=1e-5) and handler.norms[-1] > 0.05
    for p, q in zip(model.parameters(), twin.parameters()):
        assert_close(p, q, rtol=1e-5, atol=1e-6)
    first = next(model.parameters()).detach()
    gathered = [torch.empty_like(first) for _ in range(world_size)]
    dist.all_gather(gathered, first)
    assert all(torch.equal(gathered[0], g) for g in gathered)  # every rank holds the same parameters


@parameterize("scale", [1.0, 0.5])
def _check_single_process(scale):
    """World size 1: a user's handler is still called (legacy called it at any world size), with its options."""
    gpc.config["gradient_handler"] = [dict(type="MyGradientHandler", scale=scale)]
    model = nn.Linear(6, 3)
    engine, *_ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                                          verbose=False)
    handler, = engine.strategy.handlers
    data, label = _batches(0, 1)[0]
    loss = engine.criterion(engine(data), label)
    engine.backward(loss)
    norm = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in model.parameters()])).item()
    engine.step()
    assert handler.scale == scale and len(handler.norms) == 1
    assert handler.norms[0] == pytest.approx(scale * norm, rel=1e-5)


def _run_single(rank, world_size, port):
    colossal_lite.launch(config=dict(gradient_handler=[dict(type="MyGradientHandler")]), rank=rank,
                         world_size=world_size, host="127.0.0.1", port=port, backend="gloo", verbose=False)
    _check_single_process()


@rerun_if_address_is_in_use()
def test_user_handler_gives_the_parameters_of_ddp_on_two_ranks():
    spawn(_run_handler_vs_ddp, nprocs=2)


@rerun_if_address_is_in_use()
def test_user_handler_runs_in_one_process_with_its_options():
    spawn(_run_single, nprocs=1)


def test_unknown_handler_type_lists_the_registered_ones():
    with pytest.raises(ConfigException) as e:
        load_config(dict(gradient_handler=[dict(type="MyGradientHandlr")]))
    msg = str(e.value)
    assert "unknown handler type 'MyGradientHandlr'" in msg
    assert "DataParallelGradientHandler, CountingHandler, MyGradientHandler" in msg and "did you mean 'MyGradientHandler'" in msg
    assert "@GRADIENT_HANDLER.register_module" in msg and "before calling launch" in msg


def test_handler_options_are_checked_against_its_constructor():
    load_config(dict(gradient_handler=[dict(type="MyGradientHandler", scale=2.0)]))
    with pytest.raises(ConfigException, match=r"unknown option\(s\) \['scal'\] for MyGradientHandler.*"
                                              r"did you mean 'scale'.*accepted: type, scale"):
        load_config(dict(gradient_handler=[dict(type="MyGradientHandler", scal=2.0)]))


def test_data_parallel_handler_is_registered_and_a_no_op_alone():
    assert GRADIENT_HANDLER.get_module("DataParallelGradientHandler") is DataParallelGradientHandler
    model = nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    before = model.weight.grad.clone()
    DataParallelGradientHandler(model, None).handle_gradient()  # one process: nothing to average
    assert torch.equal(model.weight.grad, before)
    with pytest.raises(TypeError):
        BaseGradientHandler(model, None)  # handle_gradient is abstract
