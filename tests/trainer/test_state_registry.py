"""``StateRegistry``: the trainer's stateful parts by section and key, states that wait for their part."""
import pytest
import torch
from torch import nn

import colossal_lite
from colossal_lite.core import global_context as gpc
from colossal_lite.trainer import Trainer
from colossal_lite.trainer._checkpoint.registry import StateRegistry
from colossal_lite.trainer.hooks import BaseHook, LossHook


@pytest.fixture(autouse=True)
def clean():
    yield
    gpc.destroy()


def build_engine_and_loader():
    gpc.destroy()
    colossal_lite.launch_from_torch(config={}, seed=5, verbose=False)
    model = nn.Linear(6, 3)
    data = torch.utils.data.TensorDataset(torch.randn(40, 6), torch.randint(0, 3, (40,)))
    engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                    nn.CrossEntropyLoss(),
                                                    torch.utils.data.DataLoader(data, batch_size=4), verbose=False)
    return engine, loader


class Counter:
    def __init__(self, n=0):
        self.n = n

    def state_dict(self):
        return {"n": self.n} if self.n else {}

    def load_state_dict(self, state):
        self.n = state["n"]


def test_a_state_waits_for_its_part_and_replaces_what_waited_before():
    registry = StateRegistry()
    registry.section("objects", keyed=True)
    registry.load({"objects": {"a": {"n": 1}, "b": {"n": 2}}})
    registry.load({"objects": {"a": {"n": 3}}})  # a newer load replaces what waited in the section
    a, b = Counter(), Counter()
    registry.add("objects", "a", a)
    registry.add("objects", "b", b)
    registry.hand_on("objects")
    assert (a.n, b.n) == (3, 0)
    assert registry.state() == {"objects": {"a": {"n": 3}}}  # b's empty state is left out
    assert registry.key_of(a, "objects") == "a"


def test_sections_must_be_declared_and_keyed_by_their_kind():
    registry = StateRegistry()
    with pytest.raises(KeyError, match="no section 'hooks'.*declare it with section"):
        registry.add("hooks", "X.0", Counter())
    registry.section("progress", keyed=False)
    with pytest.raises(ValueError, match="section 'progress' takes key None"):
        registry.add("progress", "x", Counter())


def test_before_save_runs_first_and_is_cleared_with_its_section():
    registry = StateRegistry()
    registry.section("trackers", keyed=True)
    seen = Counter()
    registry.add("trackers", "T.0", seen)
    registry.before_save("trackers", lambda: setattr(seen, "n", seen.n + 1))
    assert registry.state() == {"trackers": {"T.0": {"n": 1}}}
    assert registry.state(rank=True) == {}  # per-rank states are read without the before-save step
    registry.clear("trackers")
    assert registry.state() == {"trackers": {}} and seen.n == 1


class Seen(BaseHook):
    def __init__(self):
        super().__init__()
        self.batches = 0

    def after_train_iter(self, trainer, *args):
        self.batches += 1

    def state_dict(self):
        return {"batches": self.batches}

    def load_state_dict(self, state):
        self.batches = state["batches"]


def test_the_trainer_registers_its_parts_and_a_hook_state_waits_for_the_next_fit():
    engine, loader = build_engine_and_loader()
    trainer = Trainer(engine)
    schedule = Counter(5)
    assert trainer.register_for_checkpointing(schedule) == "Counter.0"
    trainer.fit(loader, epochs=1, max_steps=3, hooks=[LossHook(), Seen()])
    registry = trainer.state_registry
    assert sorted(registry.parts("hooks")) == ["LossHook.0", "Seen.0"]
    saved = trainer.state_dict()
    assert saved["hooks"]["Seen.0"] == {"batches": 3} and saved["objects"] == {"Counter.0": {"n": 5}}
    assert saved["progress"]["step"] == 3 and registry.parts("trackers") == {}  # trackers leave with their fit

    engine2, loader2 = build_engine_and_loader()
    other = Trainer(engine2)
    other.load_state_dict(saved)
    hook, schedule2 = Seen(), Counter()
    other.register_for_checkpointing(schedule2)
    assert schedule2.n == 5 and hook.batches == 0  # the hook's state waits for the fit that attaches it
    other.fit(loader2, epochs=1, max_steps=5, hooks=[LossHook(), hook])
    assert hook.batches == 3 + 2 and other.state.step == 5
