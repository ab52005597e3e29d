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
