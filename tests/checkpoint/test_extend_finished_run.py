"""A finished run resumed with more epochs, or run again as it was.

Extending: the restored scheduler was built for the old length, so past its end a cosine climbs back
up; ``fit`` warns, naming the scheduler and how to rebuild it, and the recipe in docs/checkpoints.md
("Extending a finished run") gives the schedule for the epochs still to run. Run again unchanged with
``resume_from='auto'``: "already trained to epoch N, nothing to do", no training, no metric lines.
"""
import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import colossal_lite
from colossal_lite.checkpoint import CheckpointManager
from colossal_lite.core import global_context as gpc
from colossal_lite.nn.lr_scheduler import CosineAnnealingLR, CosineAnnealingWarmupLR, StepLR
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import (
    BaseHook,
    LogMetricByEpochHook,
    LossHook,
    LRSchedulerHook,
    SaveCheckpointHook,
)
from colossal_lite.utils import get_dataloader

STEPS_PER_EPOCH = 5  # 20 samples in batches of 4


@pytest.fixture(autouse=True)
def clean():
    yield
    gpc.destroy()


def build():
    gpc.destroy()
    colossal_lite.launch_from_torch(config={}, seed=0, verbose=False)
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(20, 6, generator=g), torch.randint(0, 3, (20,), generator=g))
    loader = get_dataloader(data, batch_size=4, shuffle=True)
    engine, loader, test_loader, _ = colossal_lite.initialize(model, optimizer, nn.CrossEntropyLoss(), loader,
                                                              get_dataloader(data, batch_size=10), verbose=False)
    return model, optimizer, engine, loader, test_loader


class EpochLR(BaseHook):
    """The optimizer's LR as each epoch starts."""

    def __init__(self, optimizer):
        super().__init__(priority=0)
        self.optimizer, self.lrs = optimizer, []

    def before_train_epoch(self, trainer):
        self.lrs.append(round(self.optimizer.param_groups[0]["lr"], 6))


SCHEDULES = {  # name: (build(optimizer, epochs), by_epoch, unit of its length)
    "torch cosine by epoch": (lambda opt, e: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=e), True, "epochs"),
    "colossal_lite cosine by step": (lambda opt, e: CosineAnnealingLR(opt, total_steps=e * STEPS_PER_EPOCH), False,
                                     "optimizer steps"),
    "colossal_lite warm-up + cosine by step": (
        lambda opt, e: CosineAnnealingWarmupLR(opt, total_steps=e * STEPS_PER_EPOCH, warmup_steps=3), False,
        "optimizer steps"),
    "torch one-cycle by step": (lambda opt, e: torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=0.1, total_steps=e * STEPS_PER_EPOCH), False, "optimizer steps"),
}


def run(ck, epochs, schedule, planned=None, short=None):
    """fit ``epochs`` epochs with ``resume_from='auto'`` and a scheduler built for ``planned`` (default ``epochs``)
    epochs; the 'schedule too short' warnings go to ``short`` (also when fit raises)."""
    model, optimizer, engine, loader, _ = build()
    make, by_epoch, _ = SCHEDULES[schedule] if isinstance(schedule, str) else schedule
    scheduler = make(optimizer, planned or epochs)
    trainer = Trainer(engine)
    lr = EpochLR(optimizer)
    short = [] if short is None else short
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(loader, epochs=epochs, hooks=[LossHook(), LRSchedulerHook(scheduler, by_epoch=by_epoch), lr,
                                                      SaveCheckpointHook(1, ck)], resume_from="auto")
        finally:
            short += [str(w.message) for w in caught if "was built for the run that wrote it" in str(w.message)]
    return trainer, optimizer, lr.lrs, short


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_a_restored_schedule_shorter_than_the_extended_run_warns(tmp_path, schedule):
    ck = tmp_path / "ck"
    _, _, lrs, short = run(ck, 2, schedule)
    assert short == []
    _, by_epoch, unit = SCHEDULES[schedule]
    length, more = (2, 2) if by_epoch else (10, 10)
    name = {"torch cosine by epoch": "CosineAnnealingLR", "colossal_lite cosine by step": "CosineAnnealingLR",
            "colossal_lite warm-up + cosine by step": "CosineAnnealingWarmupLR",
            "torch one-cycle by step": "OneCycleLR"}[schedule]
    if schedule == "torch one-cycle by step":  # torch refuses to step it past its end: the warning comes first
        short, lrs = [], [0, 1]
        with pytest.raises(ValueError, match="Tried to step"):
            run(ck, 4, schedule, short=short)
    else:
        _, _, lrs, short = run(ck, 4, schedule)
    assert short == [f"LRSchedulerHook.0: the {name} restored from {ck / 'epoch1-step10'} was built for the run that "
                     f"wrote it: it is {length} {unit} long and has 0 left, but this fit runs {more} more {unit}. "
                     f"Past its end the learning rate no longer follows a schedule (a cosine climbs back up, a decay "
                     f"stays at its last value). To extend a finished run, load only the engine state (model and "
                     f"optimizer) and build a scheduler for the {unit} still to run: see 'Extending a finished run' "
                     f"in docs/checkpoints.md"]
    assert lrs[-1] > lrs[0]  # what the warning is about: the LR climbed back up (one-cycle: torch refused)


def test_no_warning_when_the_schedule_covers_the_run_or_has_no_end(tmp_path):
    # interrupted after 1 of 4 planned epochs: the restored schedule has exactly the 3 epochs left
    _, _, _, short = run(tmp_path / "a", 1, "torch cosine by epoch", planned=4)
    _, _, lrs, short2 = run(tmp_path / "a", 4, "torch cosine by epoch")
    assert short == short2 == []
    assert lrs == [round(0.05 * (1 + math.cos(math.pi * e / 4)), 6) for e in (1, 2, 3)]
    # a schedule without an end (step decay) may be extended freely
    step = (lambda opt, e: StepLR(opt, total_steps=e, step_size=3, gamma=0.5), False, "optimizer steps")
    run(tmp_path / "b", 1, step)
    assert run(tmp_path / "b", 3, step)[3] == []


def test_the_documented_recipe_extends_a_finished_run_with_a_new_schedule(tmp_path):
    """docs/checkpoints.md, 'Extending a finished run': load only the engine state, reset the LR, a new scheduler."""
    ck = tmp_path / "ck"
    _, old_optimizer, _, _ = run(ck, 2, "torch cosine by epoch")
    momentum = [old_optimizer.state[p]["momentum_buffer"].clone() for g in old_optimizer.param_groups
                for p in g["params"]]
    model, optimizer, engine, loader, _ = build()
    # -- the recipe, as the page writes it
    shared, _ = CheckpointManager(ck).load("last")
    engine.load_state_dict(shared["engine"])  # model, optimizer (momentum, Adam moments), loss scaler
    done = shared["trainer"]["progress"]["epoch"]  # epochs already trained
    for group in optimizer.param_groups:  # the restored LR is where the old schedule ended
        group["lr"] = group["initial_lr"]
    lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=4 - done)  # the epochs still to run
    trainer = Trainer(engine)
    trainer.cur_epoch = done  # the next fit starts at that epoch
    # --
    assert all(torch.equal(optimizer.state[p]["momentum_buffer"], m) for p, m in zip(model.parameters(), momentum))
    lr = EpochLR(optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning at all
        trainer.fit(loader, epochs=4, hooks=[LossHook(), LRSchedulerHook(lr_scheduler, by_epoch=True), lr,
                                             SaveCheckpointHook(1, ck)])
    assert lr.lrs == [0.1, 0.05] and optimizer.param_groups[0]["lr"] == pytest.approx(0, abs=1e-12)
    assert trainer.cur_epoch == 4 and trainer.cur_step == 20
    # interrupted or not, the same script resumed with 'auto' now holds the new scheduler: no warning either
    assert run(ck, 4, (lambda opt, e: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=2), True, "epochs"))[3] == []


def test_running_a_finished_script_again_says_nothing_to_do(tmp_path, capfd):
    ck = tmp_path / "ck"

    def script():
        model, optimizer, engine, loader, test_loader = build()
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=2)
        trainer = Trainer(engine)
        trainer.fit(loader, epochs=2, test_dataloader=test_loader,
                    hooks=[LossHook(), LRSchedulerHook(scheduler, by_epoch=True), LogMetricByEpochHook(),
                           SaveCheckpointHook(1, ck)], resume_from="auto")
        return trainer, [p.detach().clone() for p in model.parameters()]

    _, trained = script()
    first = capfd.readouterr()
    assert "[Epoch 1 / Train]: Loss = " in first.out + first.err
    saved = sorted(p.name for p in ck.iterdir())
    trainer, again = script()
    second = capfd.readouterr()
    log = second.out + second.err
    assert f"resumed from {ck / 'epoch1-step10'}: epoch 2, step 10" in log
    assert "already trained to epoch 2, nothing to do (step 10; this fit ends at epochs=2); pass more epochs to " \
           "train further" in log, log
    assert "[Epoch" not in log and "nan" not in log.lower(), log  # nothing trained, evaluated or logged
    assert all(torch.equal(a, b) for a, b in zip(trained, again))
    assert sorted(p.name for p in ck.iterdir()) == saved and trainer.cur_step == 10


def test_a_run_that_reached_max_steps_says_so_when_run_again(tmp_path, capfd):
    ck = tmp_path / "ck"
    for _ in range(2):
        model, optimizer, engine, loader, _ = build()
        trainer = Trainer(engine)
        trainer.fit(loader, max_steps=7, hooks=[LossHook(), SaveCheckpointHook(1, ck)], resume_from="auto")
    log = capfd.readouterr()
    assert "already trained to step 7 (epoch 1, batch 2), nothing to do: this fit ends at max_steps=7; pass a larger " \
           "max_steps to train further" in log.out + log.err
    assert trainer.cur_step == 7


def test_a_later_fit_of_the_same_trainer_past_the_schedules_end_warns_too():
    """A second fit on the same trainer (no checkpoint read) ran past the schedule's end without the warning a
    resumed run gets: a cosine climbed back up (found by a probe)."""
    model, optimizer, engine, loader, _ = build()
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=2)
    trainer = Trainer(engine)
    hooks = [LossHook(), LRSchedulerHook(scheduler, by_epoch=True)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(loader, epochs=2, hooks=hooks)
        assert not [w for w in caught if "was built for" in str(w.message)]
        trainer.fit(loader, epochs=4, hooks=hooks)
    short = [str(w.message) for w in caught if "was built for" in str(w.message)]
    assert short == ["LRSchedulerHook.0: the CosineAnnealingLR this trainer's earlier fit stepped was built for that "
                     "fit: it is 2 epochs long and has 0 left, but this fit runs 2 more epochs. Past its end the "
                     "learning rate no longer follows a schedule (a cosine climbs back up, a decay stays at its last "
                     "value). To extend a finished run, load only the engine state (model and optimizer) and build a "
                     "scheduler for the epochs still to run: see 'Extending a finished run' in docs/checkpoints.md"]
