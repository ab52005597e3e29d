"""The epoch log line shows the learning rate the epoch trained at, as the history does.

``LRSchedulerHook`` steps its scheduler at the epoch's end before ``LogMetricByEpochHook`` writes the line (and,
by update, after the epoch's last update), so a line that read the scheduler then showed the LR of the epoch
after it: ``LR = 0.7`` for an epoch trained at 1.0.
"""
import re

import pytest
import torch
from torch import nn

from colossal_lite.engine.accumulation import AccumulationDataLoader, AccumulationWindow
from colossal_lite.engine.engine import Engine, EngineLRScheduler
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import LogMetricByEpochHook, LossHook, LRSchedulerHook


class Lines:
    """A logger that keeps what it is given."""

    def __init__(self):
        self.lines = []

    def info(self, msg, *args, **kwargs):
        self.lines.append(str(msg))

    warning = error = info


def _fit(by_epoch, epochs=3, batches=4, accumulation=1, max_steps=None, plateau=False):
    """``plateau``: a ReduceLROnPlateau on the test loss that halves the LR after every evaluation."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    window = AccumulationWindow(accumulation)
    engine = Engine(model, optimizer, nn.CrossEntropyLoss(), window=window)
    if plateau:  # (no test loss is below inf * (1 - 10): never an improvement)
        schedule = LRSchedulerHook(torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0,
                                                                              threshold=10.0),
                                   by_epoch=True, monitor="test/Loss")
    else:
        schedule = LRSchedulerHook(EngineLRScheduler(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1,
                                                                                     gamma=0.7), engine),
                                   by_epoch=by_epoch)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(batches)]
    logger, trainer = Lines(), Trainer(engine)
    trainer.fit(AccumulationDataLoader(data, window), epochs=epochs, max_steps=max_steps, display_progress=False,
                test_dataloader=data if plateau else None, hooks=[LossHook(), schedule, LogMetricByEpochHook(logger)],
                log_dir=False)
    shown = [m.group(1) for line in logger.lines for m in [re.search(r"/ Train\]: .*LR = (\S+)", line)] if m]
    return shown, trainer.history


def test_per_epoch_schedule_the_line_shows_the_lr_the_epoch_trained_at():
    shown, history = _fit(by_epoch=True)
    assert shown == ["1", "0.7", "0.49"]  # StepLR(gamma=0.7) stepped once per epoch, from 1.0
    assert [float(v) for v in shown] == pytest.approx([epoch["lr"] for epoch in history.epochs])


def test_per_update_schedule_the_line_shows_the_lr_of_the_epochs_last_update():
    shown, history = _fit(by_epoch=False, epochs=2, batches=4, accumulation=2)  # 2 updates per epoch
    assert shown == ["0.7", "0.343"]  # updates 2 and 4 trained at 0.7 ** 1 and 0.7 ** 3
    assert [float(v) for v in shown] == pytest.approx([epoch["lr"] for epoch in history.epochs])


def test_an_epoch_cut_short_shows_the_lr_its_steps_trained_at():
    # 4 steps per epoch, max_steps=6: epoch 1 is cut after 2 steps, which trained at 0.7. The cut epoch's end
    # steps no scheduler, so nothing notes its LR; the line showed 1, the LR noted at epoch 0's end
    shown, history = _fit(by_epoch=True, epochs=3, max_steps=6)
    assert shown == ["1", "0.7"]
    assert history["lr"][4:] == pytest.approx([0.7, 0.7])
    assert [float(v) for v in shown] == pytest.approx([epoch["lr"] for epoch in history.epochs])


def test_a_schedule_on_a_test_metric_the_line_shows_the_lr_the_epoch_trained_at():
    # the scheduler steps after each evaluation, so after the train line is written: epoch 1 trained at 0.5
    # and its line showed 1, the LR noted when the scheduler stepped after epoch 0's evaluation
    shown, history = _fit(by_epoch=True, epochs=3, plateau=True)
    assert shown == ["1", "0.5", "0.25"]
    assert [float(v) for v in shown] == pytest.approx([epoch["lr"] for epoch in history.epochs])
