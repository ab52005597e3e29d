"""A criterion that returns ``(loss, extras)`` is answered with what a criterion must return, wherever the loss
reaches the engine (a user loop, ``execute_schedule``, ``Trainer.fit``, automatic micro-batching), instead of
``'tuple' object has no attribute 'ndim'`` from inside the loss guard."""
import pytest
import torch
from engine_helpers import make_batches, make_model

import colossal_lite
from colossal_lite.trainer import Trainer

EXPECTED = ("the loss is a tuple of 2 (Tensor, dict), not a tensor: the criterion LossWithExtras returned it. "
            "A criterion must return one tensor (the loss), or (loss_sum, num_tokens) with grad_reduction = "
            "'per-token-mean'")


class LossWithExtras(torch.nn.Module):
    """A criterion written for a hand-made loop: the loss and some values to log."""

    def forward(self, output, target):
        loss = torch.nn.functional.cross_entropy(output, target)
        return loss, {"accuracy": (output.argmax(1) == target).float().mean()}


def build(launched, config=None, criterion=None):
    launched(config or {})
    model = make_model()
    engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                    criterion or LossWithExtras(), make_batches(4), verbose=False)
    return engine, loader


def test_a_user_loop_hears_what_the_criterion_must_return(launched):
    engine, loader = build(launched)
    x, y = next(iter(loader))
    with pytest.raises(TypeError) as e:
        engine.backward(engine.criterion(engine(x), y))
    message = str(e.value)
    assert message.startswith(EXPECTED), message
    assert "grad_reduction = 'per-token-mean' in the config" in message
    assert "Fix: return only the loss from the criterion" in message
    assert "loss, extras = engine.criterion(output, label); engine.backward(loss)" in message
    # the way the message gives works
    loss, extras = engine.criterion(engine(x), y)
    engine.backward(loss)
    assert engine.step()


@pytest.mark.parametrize("config", [{}, {"gradient_accumulation": "auto"}])
def test_execute_schedule_and_fit_say_it_too(launched, config):
    engine, loader = build(launched, config)
    with pytest.raises(TypeError, match=r"^the loss is a tuple of 2 \(Tensor, dict\), not a tensor: the criterion "
                                        r"LossWithExtras returned it"):
        engine.execute_schedule(iter(loader))
    engine, loader = build(launched, config)
    with pytest.raises(TypeError, match=r"^the loss is a tuple of 2"):
        Trainer(engine).fit(loader, epochs=1)


def test_per_token_mean_names_a_second_item_that_is_not_a_count(launched):
    engine, loader = build(launched, {"grad_reduction": "per-token-mean"})
    x, y = next(iter(loader))
    with pytest.raises(TypeError, match=r"reads a criterion's pair as \(loss_sum, num_tokens\), but its second item "
                                        r"is a dict, not a count"):
        engine.criterion(engine(x), y)


def test_a_function_criterion_is_named_and_a_float_is_refused(launched):
    def token_loss(output, target):
        return torch.nn.functional.cross_entropy(output, target).item()

    engine, loader = build(launched, criterion=token_loss)
    x, y = next(iter(loader))
    with pytest.raises(TypeError, match=r"^the loss is a float, not a tensor: the criterion token_loss returned it"):
        engine.backward(engine.criterion(engine(x), y))
