"""The state protocol: a hook of the user's own is checkpointed and resumed through state_dict / load_state_dict
(and rank_state_dict / load_rank_state_dict for what differs between ranks) with no change to the library, and
LRSchedulerHook's state is its scheduler's, so a trainer's own state_dict carries the schedule too."""
import pytest
import torch
from torch import nn

import colossal_lite
from colossal_lite.checkpoint import read_checkpoint
from colossal_lite.core import global_context as gpc
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import BaseHook, LossHook, LRSchedulerHook, SaveCheckpointHook
from colossal_lite.utils import get_dataloader


@pytest.fixture(autouse=True)
def clean():
    yield
    gpc.destroy()


def build():
    """40 samples in batches of 4: 10 optimizer steps per epoch."""
    gpc.destroy()
    colossal_lite.launch_from_torch(config={}, seed=5, verbose=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.8)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g))
    engine, loader, _, sched = colossal_lite.initialize(model, opt, nn.CrossEntropyLoss(),
                                                        get_dataloader(data, shuffle=True, batch_size=4),
                                                        lr_scheduler=sched, verbose=False)
    return model, engine, loader, sched


class NoisyCounter(BaseHook):
    """A user's hook: counts the samples trained on (the same on every rank) and adds noise to each batch from a
    generator of its own (each rank's own stream), so a resumed run matches only if both come back."""

    def __init__(self):
        super().__init__()
        self.samples = 0
        self.generator = torch.Generator().manual_seed(1234)

    def after_batch_loaded(self, trainer):
        data = trainer.state.data
        trainer.state.data = data + 0.1 * torch.randn(data.shape, generator=self.generator)

    def after_train_iter(self, trainer, output, label, loss):
        self.samples += len(label)

    def state_dict(self):
        return {"samples": self.samples}

    def load_state_dict(self, state):
        self.samples = state["samples"]

    def rank_state_dict(self):
        return {"generator": self.generator.get_state()}

    def load_rank_state_dict(self, state):
        self.generator.set_state(state["generator"])


def run(ck=None, max_steps=None, resume_from=None):
    model, engine, loader, sched = build()
    counter = NoisyCounter()
    hooks = [LossHook(), LRSchedulerHook(sched, by_epoch=False), counter]
    if ck is not None:
        hooks.append(SaveCheckpointHook(1, ck))
    Trainer(engine).fit(loader, epochs=3, max_steps=max_steps, hooks=hooks, resume_from=resume_from)
    return [p.detach().clone() for p in model.parameters()], counter


def test_a_users_stateful_hook_is_checkpointed_and_resumed_with_no_library_change(tmp_path):
    want, uninterrupted = run()
    ck = tmp_path / "ck"
    run(ck, max_steps=13)  # stopped inside epoch 1: its final checkpoint is epoch1-step13
    shared, rank = read_checkpoint(ck / "epoch1-step13")
    assert shared["trainer"]["hooks"]["NoisyCounter.0"] == {"samples": 52}
    assert set(rank["trainer"]["hooks"]["NoisyCounter.0"]) == {"generator"}
    got, resumed = run(ck, resume_from="auto")
    assert resumed.samples == uninterrupted.samples == 120
    assert torch.equal(resumed.generator.get_state(), uninterrupted.generator.get_state())
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # the noise it added continued the same stream


def test_lr_scheduler_hooks_state_is_its_schedulers_and_a_trainer_state_dict_carries_it():
    _, engine, loader, sched = build()
    hook = LRSchedulerHook(sched, by_epoch=False)
    trainer = Trainer(engine)
    trainer.fit(loader, epochs=1, max_steps=7, hooks=[LossHook(), hook])
    assert hook.state_dict() == sched.state_dict() and hook.state_dict()["seen_updates"] == 7
    saved = trainer.state_dict()
    assert saved["hooks"]["LRSchedulerHook.0"] == sched.state_dict()
    lr_after_7 = sched.get_last_lr()

    _, engine2, loader2, sched2 = build()  # a fresh run given the first one's state: the schedule goes on
    other = Trainer(engine2)
    other.load_state_dict(saved)
    lrs = []

    class LR(BaseHook):
        def before_train(self, trainer):
            lrs.append(sched2.get_last_lr())

    other.fit(loader2, epochs=1, hooks=[LossHook(), LRSchedulerHook(sched2, by_epoch=False), LR()])
    assert lrs == [lr_after_7]


def test_a_hook_naming_an_unknown_checkpoint_entry_is_refused(tmp_path):
    class Odd(BaseHook):
        checkpoint_entry = "somewhere"

        def state_dict(self):
            return {"x": 1}

    _, engine, loader, _ = build()
    with pytest.raises(ValueError, match=r"Odd.checkpoint_entry is 'somewhere': use one of \['trainer', "
                                         r"'lr_schedulers'\]"):
        Trainer(engine).fit(loader, epochs=1, hooks=[LossHook(), Odd(), SaveCheckpointHook(1, tmp_path / "ck")])
