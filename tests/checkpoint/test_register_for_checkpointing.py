"""A user's own stateful object in the checkpoints, registered in one line (issue 30, item 2's
``register_for_checkpointing``): a run resumed after a crash ends with the object in the uninterrupted run's state."""
import pytest
import torch
from hook_helpers import crash_at
from torch import nn

import colossal_lite
from colossal_lite.core import global_context as gpc
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import BaseHook, LossHook, SaveCheckpointHook


class NoiseSchedule:
    """The user's object: its own generator and a step count, moved on by their hook every optimizer step."""

    def __init__(self):
        self.gen = torch.Generator().manual_seed(123)
        self.steps = 0
        self.draws = []

    def advance(self):
        self.steps += 1
        self.draws.append(float(torch.rand((), generator=self.gen)))

    def state_dict(self):
        return {"gen": self.gen.get_state(), "steps": self.steps, "draws": list(self.draws)}

    def load_state_dict(self, state):
        self.gen.set_state(state["gen"])
        self.steps, self.draws = state["steps"], list(state["draws"])


class Advance(BaseHook):
    def __init__(self, schedule):
        super().__init__(priority=50)
        self.schedule = schedule

    def after_train_iter(self, trainer, *args):
        if trainer.state.stepped:
            self.schedule.advance()


@pytest.fixture(autouse=True)
def launched():
    colossal_lite.launch_from_torch(config={}, seed=1, verbose=False)
    yield
    gpc.destroy()


def fit(folder, crash=None, resume=None, register=True):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 3, generator=g), torch.randint(0, 2, (2,), generator=g)) for _ in range(6)]
    engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                    nn.CrossEntropyLoss(), batches, verbose=False)
    trainer, schedule = Trainer(engine), NoiseSchedule()
    if register:
        assert trainer.register_for_checkpointing(schedule) == "NoiseSchedule.0"
    hooks = [LossHook(), Advance(schedule), SaveCheckpointHook("2ba", folder)] + ([crash_at(crash)] if crash else [])
    try:
        trainer.fit(loader, epochs=2, hooks=hooks, resume_from=resume)
    except RuntimeError as e:
        assert "simulated crash" in str(e)
    return schedule


def test_a_registered_object_continues_exactly_after_a_crash(tmp_path):
    whole = fit(tmp_path / "whole")
    assert whole.steps == 12
    fit(tmp_path / "cut", crash=7)  # the last checkpoint is at step 6
    resumed = fit(tmp_path / "cut", resume="last")
    assert resumed.state_dict()["draws"] == whole.draws and resumed.steps == 12
    assert torch.equal(resumed.gen.get_state(), whole.gen.get_state())
    # unregistered, the object starts afresh on resume: what the registration gives
    fit(tmp_path / "bare", crash=7, register=False)
    bare = fit(tmp_path / "bare", resume="last", register=False)
    assert bare.steps == 6 and bare.draws != whole.draws[6:]


def test_what_is_not_stateful_is_refused_with_the_fix():
    trainer = Trainer(None)
    with pytest.raises(TypeError, match=r"register_for_checkpointing: int has no state_dict\(\); give an object with"):
        trainer.register_for_checkpointing(3)
    trainer.register_for_checkpointing(NoiseSchedule(), key="noise")
    with pytest.raises(ValueError, match="the key 'noise' is taken by another object"):
        trainer.register_for_checkpointing(NoiseSchedule(), key="noise")
