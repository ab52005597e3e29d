"""initialize() argument errors, execute_schedule batch layouts, engine state."""
import pytest
import torch
from engine_helpers import make_batches, make_model

import colossal_lite
from colossal_lite.engine.schedule import NonPipelineSchedule


def test_model_and_optimizer_may_be_callables(launched):
    launched()
    engine, *_ = colossal_lite.initialize(make_model, lambda params: torch.optim.SGD(params, lr=0.1), verbose=False)
    assert isinstance(engine.model, torch.nn.Sequential)
    assert engine.optimizer.param_groups[0]["params"][0] is next(engine.model.parameters())


@pytest.mark.parametrize("model,optimizer,criterion,needle", [
    ("not a model", None, None, "initialize(model=...) must be a torch.nn.Module"),
    (make_model, 3, None, "initialize(optimizer=...) must be a torch.optim.Optimizer"),
    (make_model, None, "mse", "initialize(criterion=...) must be callable"),
    (lambda: 5, None, None, "the callable returned int"),
])
def test_bad_arguments_name_the_argument(launched, model, optimizer, criterion, needle):
    launched()
    if optimizer is None:
        optimizer = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    with pytest.raises(TypeError, match=__import__("re").escape(needle)):
        colossal_lite.initialize(model, optimizer, criterion, verbose=False)


def test_optimizer_of_another_model_is_refused(launched):
    launched()
    other = make_model()
    with pytest.raises(ValueError, match="optimizer's parameters are not parameters of the model"):
        colossal_lite.initialize(make_model(), torch.optim.SGD(other.parameters(), lr=0.1), verbose=False)


def test_criterion_missing_is_a_clear_error(launched):
    launched()
    engine, *_ = colossal_lite.initialize(make_model(), lambda p: torch.optim.SGD(p, lr=0.1), verbose=False)
    with pytest.raises(RuntimeError, match="initialize\\(\\) got no criterion"):
        engine.criterion(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long))


class TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(3, 2)
        self.b = torch.nn.Linear(3, 2)

    def forward(self, x1, x2):
        return self.a(x1) + self.b(x2)


def test_execute_schedule_spreads_lists_and_dicts(launched):
    launched()
    model = TwoInputs()
    seen = []

    def criterion(out, target, weight=1.0):
        seen.append(weight)
        return ((out - target) ** 2).mean() * weight

    engine, *_ = colossal_lite.initialize(model, lambda p: torch.optim.SGD(p, lr=0.1), criterion, verbose=False)
    x1, x2, t = torch.randn(5, 3), torch.randn(5, 3), torch.randn(5, 2)
    out, label, loss = engine.execute_schedule(iter([((x1, x2), t)]))
    torch.testing.assert_close(out, model(x1, x2))
    assert loss.requires_grad is True and model.a.weight.grad is not None
    # dict data -> model(**data); dict label -> criterion(out, **label); layout given by data_process_func
    engine.schedule = NonPipelineSchedule(lambda batch: ({"x1": batch["a"], "x2": batch["b"]}, {"target": batch["t"], "weight": 2.0}))
    out, label, loss = engine.execute_schedule(iter([{"a": x1, "b": x2, "t": t}]), forward_only=True)
    assert seen[-1] == 2.0 and not loss.requires_grad
    assert engine.schedule.batch_size == 5
    engine.schedule = NonPipelineSchedule()
    _, _, loss = engine.execute_schedule(iter([((x1, x2), t)]), forward_only=True, return_output_label=False)
    assert loss is not None
    with pytest.raises(ValueError, match="a batch must be \\(data, label\\)"):
        engine.execute_schedule(iter([(x1, x2, t)]))
    with pytest.raises(TypeError, match="exactly one argument"):
        NonPipelineSchedule(lambda a, b: (a, b))


def test_engine_state_dict_round_trip_mid_window(launched):
    """A state taken inside an accumulation window (grads of the open window included) resumes exactly."""
    launched(dict(gradient_accumulation=3))
    batches = make_batches(6)

    def build():
        model = make_model()
        engine, *_ = colossal_lite.initialize(model, torch.optim.Adam(model.parameters(), lr=0.01),
                                              torch.nn.CrossEntropyLoss(), verbose=False)
        return engine

    def run(engine, part):
        for x, y in part:
            engine.zero_grad()
            engine.backward(engine.criterion(engine(x), y))
            engine.step()

    full = build()
    run(full, batches)
    half = build()
    run(half, batches[:4])  # stop mid-window: one window of 3, then 1 micro-step
    state = half.state_dict()
    assert state["accumulation"]["micro_step"] == 1
    resumed = build()
    resumed.load_state_dict(state)
    run(resumed, batches[4:])
    for p, q in zip(resumed.model.parameters(), full.model.parameters()):
        assert torch.equal(p, q)
    assert resumed.num_updates == full.num_updates == 2


def test_place_passes_a_pair_on_the_device_through_and_sizes_batches_when_asked():
    from colossal_lite.engine.schedule import move_to_device

    cpu = torch.device("cpu")
    x, y = torch.randn(6, 3), torch.arange(6)
    pair = (x, y)
    assert move_to_device(pair, cpu) is pair  # nothing to move: the same object, no copy
    nested = [x, {"y": y}]
    moved = move_to_device(nested, cpu)
    assert moved is not nested and moved[0] is x and moved[1]["y"] is y
    schedule = NonPipelineSchedule()
    batch, data, label = schedule.place(pair, cpu)
    assert batch is pair and data is x and label is y and schedule.batch_size == 6
    batch, data, label = schedule.place([x[:2], y[:2]], cpu)  # a list batch goes through split
    assert data.shape[0] == 2 and schedule.batch_size == 2
    schedule.place((torch.tensor(1.0), y), cpu)
    assert schedule.batch_size is None  # a 0-dim first tensor has no batch dimension
    with pytest.raises(ValueError, match="a batch must be \\(data, label\\)"):
        schedule.place((x, y, y), cpu)
