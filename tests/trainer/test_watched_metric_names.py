"""A hook that names a metric (save_best, early stopping, a plateau scheduler) refuses a name no hook provides.

Before, ``SaveCheckpointHook(save_best=("Acc", "max"))`` never wrote ``best`` and recorded ``"Acc": null``.
The name is checked once all of ``fit``'s hooks are attached, whatever their priorities, before any step.
"""
import json

import pytest
import torch
from torch import nn

from colossal_lite.engine.engine import Engine
from colossal_lite.nn.metric import Accuracy
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import (
    AccuracyHook,
    BaseHook,
    EarlyStoppingHook,
    LossHook,
    LRSchedulerHook,
    SaveCheckpointHook,
)


def batches(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def make_trainer(lr=0.1):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return Trainer(Engine(model, optimizer, nn.CrossEntropyLoss())), optimizer


def test_a_misspelt_save_best_name_stops_fit_before_any_step_and_suggests_the_real_one(tmp_path):
    trainer, _ = make_trainer()
    with pytest.raises(ValueError, match=r"SaveCheckpointHook watches metric 'Acc': no metric 'Acc' \(did you "
                                         r"mean 'Accuracy'\? names are case-sensitive\)\. The hooks of this run give "
                                         r"train metrics \['Loss'\] and test metrics \['Accuracy', 'Loss'\]"):
        trainer.fit(batches(2, 0), epochs=1, test_dataloader=batches(1, 1),
                    hooks=[LossHook(), AccuracyHook(Accuracy()),
                           SaveCheckpointHook(1, str(tmp_path / "ck"), save_best=("Acc", "max"))])
    assert trainer.engine.num_updates == 0
    assert not list(tmp_path.glob("ck/*/meta.json"))


def test_the_check_does_not_depend_on_hook_priorities_and_the_right_name_moves_best(tmp_path):
    trainer, _ = make_trainer()
    # the checkpoint hook is attached before the metric hooks (lower priority number): its name still resolves
    saver = SaveCheckpointHook(1, str(tmp_path / "ck"), save_best=("Accuracy", "max"), priority=-5)
    trainer.fit(batches(2, 0), epochs=2, test_dataloader=batches(1, 1),
                hooks=[saver, LossHook(), AccuracyHook(Accuracy())])
    best = (tmp_path / "ck" / "best").read_text().strip()
    meta = json.loads((tmp_path / "ck" / best / "meta.json").read_text())
    assert isinstance(meta["metrics"]["Accuracy"], float)


def test_test_mode_refuses_a_misspelt_name_too():
    trainer, _ = make_trainer()
    with pytest.raises(ValueError, match=r"EarlyStoppingHook watches metric 'loss': no metric 'loss' \(did you "
                                         r"mean 'Loss'\?"):
        trainer.fit(batches(2, 0), epochs=1, test_dataloader=batches(1, 1), test_mode=True,
                    hooks=[LossHook(), EarlyStoppingHook("loss")])


def test_a_test_metric_in_a_run_without_a_test_loader_is_refused():
    trainer, _ = make_trainer()
    with pytest.raises(ValueError, match=r"'test/Loss' is a test metric, but fit got no test_dataloader"):
        trainer.fit(batches(2, 0), epochs=1, hooks=[LossHook(), EarlyStoppingHook("test/Loss")])


def test_a_bare_test_only_name_in_a_run_without_a_test_loader_says_so():
    """It said "no metric 'Accuracy' (did you mean 'Accuracy'?)", naming the metric it could not find as the one
    meant (found by a probe)."""
    from colossal_lite.nn.metric import Accuracy
    from colossal_lite.trainer.hooks import AccuracyHook

    trainer, _ = make_trainer()
    with pytest.raises(ValueError, match=r"metric 'Accuracy' is a test metric here, but fit got no test_dataloader: "
                                         r".*AccuracyHook\(\.\.\., track_train=True\)\) and name it 'train/Accuracy'"):
        trainer.fit(batches(2, 0), epochs=1, hooks=[AccuracyHook(Accuracy()), EarlyStoppingHook("Accuracy")])


def test_reduce_lr_on_plateau_needs_a_metric_and_refuses_an_unknown_one():
    _, optimizer = make_trainer()
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    with pytest.raises(ValueError, match=r"ReduceLROnPlateau steps on a metric once per epoch: pass by_epoch=True "
                                         r"and monitor='test/Loss'"):
        LRSchedulerHook(plateau, by_epoch=True)
    with pytest.raises(ValueError, match=r"monitor='Loss'\) is for ReduceLROnPlateau; StepLR steps without a metric"):
        LRSchedulerHook(torch.optim.lr_scheduler.StepLR(optimizer, 1), by_epoch=True, monitor="Loss")
    trainer, optimizer = make_trainer()
    hook = LRSchedulerHook(torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer), by_epoch=True, monitor="test/Los")
    with pytest.raises(ValueError, match=r"LRSchedulerHook watches metric 'test/Los': no test metric 'Los' "
                                         r"\(did you mean 'Loss'\?"):
        trainer.fit(batches(2, 0), epochs=1, test_dataloader=batches(1, 1), hooks=[LossHook(), hook])


@pytest.mark.parametrize("monitor", ["test/Loss", "train/Loss"])
def test_reduce_lr_on_plateau_steps_on_the_monitored_epoch_value_like_a_hand_written_loop(monitor):
    trainer, optimizer = make_trainer(lr=0.5)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=0.5)
    phase, name = monitor.split("/")
    seen = []

    class Probe(BaseHook):  # runs after the scheduler hook at each epoch's end and evaluation
        def after_train_epoch(self, trainer):
            if phase == "train":
                seen.append((trainer.states["metrics"]["train"][name].get_accumulated_value(),
                             optimizer.param_groups[0]["lr"]))

        def after_test_epoch(self, trainer):
            if phase == "test":
                seen.append((trainer.states["metrics"]["test"][name].get_accumulated_value(),
                             optimizer.param_groups[0]["lr"]))

    trainer.fit(batches(3, 0), epochs=5, test_dataloader=batches(2, 1),
                hooks=[LossHook(), LRSchedulerHook(scheduler, by_epoch=True, monitor=monitor), Probe(priority=99)])
    assert len(seen) == 5
    # the same values fed by hand to a fresh ReduceLROnPlateau give the same LR after each epoch
    param = nn.Parameter(torch.zeros(1))
    hand_opt = torch.optim.SGD([param], lr=0.5)
    hand = torch.optim.lr_scheduler.ReduceLROnPlateau(hand_opt, factor=0.5, patience=0, threshold=0.5)
    expected = []
    for value, _ in seen:
        hand.step(value)
        expected.append(hand_opt.param_groups[0]["lr"])
    assert [lr for _, lr in seen] == pytest.approx(expected)
    assert expected[-1] < 0.5  # the schedule really reduced the LR in this run
