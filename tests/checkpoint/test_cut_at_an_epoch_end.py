"""A run cut by ``max_steps`` exactly at an epoch's end, where its test interval asks for no evaluation, makes one
evaluation more than the longer run it may be continued into: the end of training asks for it. Its final checkpoint
is taken after that evaluation (so that ``best`` sees its values), so the evaluation drew from the random state (a
``DataLoader``'s seeds) and told an early stop its value: the resumed longer run trained on other MixUp draws and
counted an early stop's checks from another best than the uninterrupted run (found by the Composer-features probe).
The closing evaluation now puts the random state back, and hooks that decide training's course leave it out."""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import colossal_lite
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import BaseHook, EarlyStoppingHook, LossHook, MixUp, SaveCheckpointHook

g = torch.Generator().manual_seed(1)
BATCHES = [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(4)]
TEST = TensorDataset(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))


class EarlyStopSeen(BaseHook):
    """The early stop's (best, wait) after each step and at the end of the run."""

    def __init__(self, early_stop):
        super().__init__(priority=50)
        self.early_stop, self.at = early_stop, {}

    def after_train_iter(self, trainer, *args):
        if trainer.state.stepped:
            self.at[trainer.state.step] = (self.early_stop.best, self.early_stop.wait)

    def after_train(self, trainer):
        self.at["end"] = (self.early_stop.best, self.early_stop.wait)


def run(ck, interval, **fit_args):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    engine, *_ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                                          verbose=False)
    early_stop = EarlyStoppingHook("test/Loss", patience=5)
    seen = EarlyStopSeen(early_stop)
    torch.manual_seed(5)  # (a resumed run's random state comes from its checkpoint)
    Trainer(engine).fit(BATCHES, test_dataloader=DataLoader(TEST, batch_size=4, shuffle=True), test_interval=interval,
                        hooks=[MixUp(alpha=0.4), LossHook(), early_stop, seen, SaveCheckpointHook(100, ck)],
                        log_dir=False, **fit_args)
    return model, seen.at


@pytest.mark.parametrize("interval", [3, "3ba"])
def test_a_run_cut_at_an_epoch_end_resumes_as_the_uninterrupted_run(tmp_path, interval):
    whole, whole_checks = run(tmp_path / "whole", interval, epochs=3)
    run(tmp_path / "cut", interval, epochs=3, max_steps=4)  # epoch 0 of 4 batches: the interval asks for nothing
    resumed, resumed_checks = run(tmp_path / "cut", interval, epochs=3, resume_from="last")
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), resumed.parameters()))
    assert {s: c for s, c in whole_checks.items() if s == "end" or s > 4} == resumed_checks
    assert any(best is not None for best, _ in resumed_checks.values())  # the early stop did check
