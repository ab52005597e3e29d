"""``Trainer.instrument``, the seam ``SpeedReportHook`` measures a run through: a point's handlers are replaced by
what the instrument gives and given back; a run without an instrument calls the hooks' own methods directly."""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import colossal_lite
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import BaseHook, LossHook, SpeedReportHook


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    data = TensorDataset(torch.randn(48, 4), torch.randint(0, 2, (48,)))
    engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                    nn.CrossEntropyLoss(), DataLoader(data, batch_size=8),
                                                    verbose=False)
    return engine, loader


class Probe(BaseHook):
    """Instruments ``after_loss`` and ``before_load`` for the first two optimizer steps, then gives them back.
    ``seen`` is the order of what ran: the instrument's marks, and the hook's own loss and batch events."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def after_hook_is_attached(self, trainer):
        if trainer.state.fitting:
            trainer.instrument(self.wrap, ["after_loss", "before_load"])

    def wrap(self, point, handlers):
        if point == "before_load":
            return handlers + (lambda: self.seen.append("load"),)
        return (lambda trainer: self.seen.append("timed"),) + handlers

    def after_batch_loaded(self, trainer):
        self.seen.append("loaded")

    def after_loss(self, trainer):
        self.seen.append("loss")

    def after_optimizer_step(self, trainer):
        if trainer.state.step == 1:  # (counted after this event: the second step ends here)
            trainer.instrument(None, ["after_loss", "before_load"])


def test_an_instrument_takes_over_points_and_gives_them_back():
    engine, loader = build()
    probe = Probe()
    Trainer(engine).fit(loader, epochs=1, hooks=[probe, LossHook()], log_dir=False)
    instrumented = ["load", "loaded", "timed", "loss"]  # before_load comes before the copy, then the events
    assert probe.seen == instrumented * 2 + ["loaded", "loss"] * 4


def test_a_run_without_an_instrument_calls_the_hooks_own_methods():
    """No wrapper and no per-step check: each event's handlers are the hooks' bound methods, before_load has
    none, after a fit whose SpeedReportHook took every point over."""
    engine, loader = build()
    trainer = Trainer(engine)
    trainer.fit(loader, epochs=1, hooks=[SpeedReportHook(peak_tflops=1.0, report=False), LossHook()], log_dir=False)
    tables = []

    class Look(BaseHook):
        def before_train_iter(self, trainer):
            tables.append((trainer._h.after_train_iter, trainer._h.before_train_iter, trainer._step.before_load))
    look, loss = Look(), LossHook()
    trainer.fit(loader, epochs=trainer.cur_epoch + 1, hooks=[look, loss], log_dir=False)
    after_iter, before_iter, before_load = tables[-1]
    assert after_iter[0] == loss.after_train_iter and len(after_iter) == 2  # (the run's Recorder is the other)
    assert before_iter == (look.before_train_iter,) and before_load == ()


def test_instrument_errors_say_what_to_fix():
    engine, loader = build()
    trainer = Trainer(engine)
    with pytest.raises(RuntimeError, match="Trainer.instrument is for a running fit or evaluate: call it from a "
                                           "hook's after_hook_is_attached or a later event"):
        trainer.instrument(None)

    class Wrong(BaseHook):
        def after_hook_is_attached(self, trainer):
            trainer.instrument(None, ["after_los"])
    with pytest.raises(ValueError, match=r"Trainer.instrument: no point named 'after_los'; the points are the "
                                         r"events' names \(colossal_lite.trainer.events.Event values\) and "
                                         r"'before_load'"):
        trainer.fit(loader, epochs=1, hooks=[Wrong()], log_dir=False)


def test_evaluate_alone_with_the_hook_measures_nothing_and_does_not_fail():
    engine, loader = build()
    result = Trainer(engine).evaluate(loader, hooks=[SpeedReportHook(peak_tflops=1.0, report=False), LossHook()])
    assert set(result) == {"Loss"}


def test_a_point_belongs_to_one_instrument_at_a_time():
    """Two instruments at one point would each build from the hooks' handlers, the later one silently replacing
    the other's functions (a tool attached after SpeedReportHook made it count no step): it is an error naming
    the point and its holder. Points no one else holds can be taken, and a point given back can be taken again."""
    engine, loader = build()
    for hooks in ([SpeedReportHook(peak_tflops=1.0, report=False), Probe()],  # the hook first: it holds the point
                  [Probe(), SpeedReportHook(peak_tflops=1.0, report=False, breakdown_every=1)]):
        with pytest.raises(ValueError, match=r"Trainer.instrument: \w+ takes points another instrument holds: "
                                             r"'(before_load|after_loss)' \((SpeedReportHook|Probe)\)"):
            Trainer(engine).fit(loader, epochs=1, hooks=hooks, log_dir=False)

    class OnTheTest(BaseHook):  # a point the speed report does not take
        def after_hook_is_attached(self, trainer):
            trainer.instrument(lambda point, handlers: handlers + (lambda *args: None,), ["after_test_iter"])
    speed = SpeedReportHook(peak_tflops=1.0, report=False)
    Trainer(engine).fit(loader, epochs=1, hooks=[speed, OnTheTest()], log_dir=False)
    assert speed.figures.steps == 5  # (6 steps, the first the warm-up)

    probe = Probe()  # gives its points back after the second step: the speed report's sampled steps take them
    Trainer(engine).fit(loader, epochs=1, hooks=[probe, SpeedReportHook(peak_tflops=1.0, report=False,
                                                                        warmup_steps=2)], log_dir=False)
    assert probe.seen[:8] == ["load", "loaded", "timed", "loss"] * 2


def test_a_sampled_step_calls_the_handlers_in_priority_order():
    """On a sampled step the breakdown calls the handlers itself: it ran the report's own first, before hooks of a
    lower priority number (at the epochs' ends and starts), where the docs say lower runs first."""
    engine, loader = build()
    order = []

    class Spy(BaseHook):
        def before_train_epoch(self, trainer):
            order.append("spy")

    class Speed(SpeedReportHook):
        def before_train_epoch(self, trainer):
            order.append("speed")
            super().before_train_epoch(trainer)

    Trainer(engine).fit(loader, epochs=3, hooks=[Speed(peak_tflops=1.0, report=False, breakdown_every=1, priority=50),
                                                 Spy(priority=20)], log_dir=False)
    assert order == ["spy", "speed"] * 3
