"""What a micro-batch is when the user's own loop iterates a plain loader (no plan): everything between two
``engine.step()`` calls, as legacy Colossal-AI counted; a forward without autograd (evaluation) is no part of it."""
import torch
from engine_helpers import make_batches, make_model
from torch import nn

import colossal_lite

LOSS = nn.CrossEntropyLoss()


def _engine(launched, acc):
    launched(dict(gradient_accumulation=acc))
    model = make_model()
    engine, *_ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), LOSS, verbose=False)
    return engine


def _hand(losses_of, lr=0.1):
    """One SGD step on the gradients of ``losses_of(model)`` (a list of losses already weighed)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for loss in losses_of(model):
        loss.backward()
    opt.step()
    return model


def _assert_equal_params(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def test_two_backward_calls_in_one_micro_batch_add_up(launched):
    """Accumulation 2: the first micro-batch runs two backward calls (a batch in two halves), then step();
    the window closes at the second step(), not at the second backward."""
    engine = _engine(launched, 2)
    (x1, y1), (x2, y2) = make_batches(2)
    engine.zero_grad()
    engine.backward(LOSS(engine(x1[:2]), y1[:2]))
    engine.backward(LOSS(engine(x1[2:]), y1[2:]))
    assert engine.step() is False
    engine.zero_grad()  # inside the window: clears nothing
    engine.backward(LOSS(engine(x2), y2))
    assert engine.step() is True
    ref = _hand(lambda m: [LOSS(m(x1[:2]), y1[:2]) / 2, LOSS(m(x1[2:]), y1[2:]) / 2, LOSS(m(x2), y2) / 2])
    _assert_equal_params(engine.unwrapped_model, ref)


def test_evaluation_inside_a_window_is_no_micro_batch(launched):
    engine = _engine(launched, 2)
    (x1, y1), (x2, y2), (xe, _) = make_batches(3)
    engine.zero_grad()
    engine.backward(LOSS(engine(x1), y1))
    assert engine.step() is False
    with torch.no_grad():  # evaluation between two micro-batches of a window
        engine(xe)
    assert engine.window.micro_step == 1
    engine.zero_grad()
    engine.backward(LOSS(engine(x2), y2))
    assert engine.step() is True
    ref = _hand(lambda m: [LOSS(m(x1), y1) / 2, LOSS(m(x2), y2) / 2])
    _assert_equal_params(engine.unwrapped_model, ref)


def test_a_second_step_call_without_a_micro_batch_does_not_advance_the_window(launched):
    engine = _engine(launched, 2)
    (x1, y1), (x2, y2) = make_batches(2)
    engine.backward(LOSS(engine(x1), y1))
    assert engine.step() is False
    assert engine.step() is False  # nothing ran since the last step(): not a micro-batch
    assert engine.window.micro_step == 1
    engine.backward(LOSS(engine(x2), y2))
    assert engine.step() is True and engine.num_updates == 1


def test_an_epochs_plans_are_each_micro_batchs_own_place():
    """The epoch's places are built from one full window repeated: the same as working out each index alone
    (a last window of the rest divides by its own size, opens and closes where it should)."""
    from colossal_lite.engine.accumulation import AccumulationWindow, MicroBatch

    for size in (1, 2, 3, 4):
        window = AccumulationWindow(size)
        for length in range(14):
            assert window.plans(length) == [window.plan(i, length) for i in range(length)], (size, length)
    assert AccumulationWindow(3).plans(5) == [MicroBatch(3, True, False), MicroBatch(3, False, False),
                                             MicroBatch(3, False, True), MicroBatch(2, True, False),
                                             MicroBatch(2, False, True)]


def test_a_loop_that_breaks_inside_a_window_is_told_at_the_next_epoch_that_the_window_is_dropped(launched, recwarn):
    """Windows start at each epoch's start, so a micro-batch run before a ``break`` inside a window is not applied
    (a hand loop stepping every ``(i + 1) % A`` would carry it over, and legacy's counter did): said at the next
    epoch's start, once. A loop that breaks at a window's end loses nothing and hears nothing (found by a probe
    porting pytorch/examples' mnist with ``--dry-run``)."""
    import pytest

    launched(dict(gradient_accumulation=2))
    model = make_model()
    engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), LOSS,
                                                    make_batches(6), verbose=False)

    def epoch(stop_after):
        for i, (x, y) in enumerate(loader):
            engine.zero_grad()
            engine.backward(engine.criterion(engine(x), y))
            engine.step()
            if i + 1 == stop_after:
                break

    epoch(stop_after=4)  # two whole windows
    epoch(stop_after=3)
    assert not [w for w in recwarn if "inside a window" in str(w.message)]
    with pytest.warns(UserWarning, match=r"stopped inside a window, after 1 of its 2 micro-batches; windows start at "
                                         r"each epoch's start, so their gradients are dropped"):
        epoch(stop_after=6)
    assert engine.num_updates == 2 + 1 + 3


def test_the_trainer_continuing_inside_a_window_says_nothing_of_dropped_windows(launched, recwarn):
    """The Trainer places each micro-batch itself: a fit stopped inside a window by a hook continues it in the next
    fit (nothing is dropped), with no warning."""
    from colossal_lite.trainer import Trainer
    from colossal_lite.trainer.hooks import BaseHook

    class StopAtBatch3(BaseHook):
        def after_train_iter(self, trainer, *args):
            if trainer.state.iteration == 3:
                trainer.state.stop_training = True

    launched(dict(gradient_accumulation=2))
    model = make_model()
    engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), LOSS,
                                                    make_batches(6), verbose=False)
    trainer = Trainer(engine)
    trainer.fit(loader, epochs=1, hooks=[StopAtBatch3()], log_dir=False, display_progress=False)
    assert (trainer.state.batch_idx, engine.window.micro_step) == (3, 1)
    trainer.fit(loader, epochs=1, log_dir=False, display_progress=False)
    assert engine.num_updates == 3
    assert not [w for w in recwarn if "inside a window" in str(w.message)]
