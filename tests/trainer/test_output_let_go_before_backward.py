"""The training step's output lives through the backward only when a hook may read it after the loss.

A hand loop written ``loss = criterion(model(x), y); loss.backward()`` lets the output go before the backward;
the Trainer kept it (``state.output``, for ``after_train_iter``) through the backward's peak, where a language
model's logits are often the step's largest tensor: on one H200 the Trainer with ``LossHook`` alone peaked at
one bf16 GPT-2 logits tensor (785 MiB) above that hand loop (``benchmarks/gpu_check.py``, issue 31). The
Trainer now lets it go unless a hook handling an event after the loss reads it (``BaseHook.reads_train_output``);
the built-in hooks that do not read it say so, and a hook of one's own keeps it unless it says otherwise.

The check is by mechanism: the model keeps a weak reference to the output it returns, and a gradient hook on its
first layer's weight (which runs inside the backward, after the criterion's backward) records whether the output
is still alive. The criterion (a sum) saves no tensor for its backward, so only a Python reference keeps it.
"""
import weakref

import pytest
import torch
from torch import nn

from colossal_lite.engine.accumulation import AccumulationWindow
from colossal_lite.engine.auto_batch import AutoMicroBatcher
from colossal_lite.engine.engine import Engine
from colossal_lite.nn.metric import Accuracy
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import (
    AccuracyHook,
    BaseHook,
    EMAHook,
    LossHook,
    LRSchedulerHook,
    SaveCheckpointHook,
    ThroughputHook,
)


class WatchedOutput(nn.Module):
    """Records, at each backward through its first layer, whether its last output was still alive."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)
        self.out_ref = None
        self.alive_in_backward = []
        self.fc1.weight.register_hook(self._note)

    def _note(self, grad):
        self.alive_in_backward.append(self.out_ref() is not None)
        return grad

    def forward(self, x):
        out = self.fc2(torch.tanh(self.fc1(x)))
        self.out_ref = weakref.ref(out)
        return out


def sum_loss(output, label):
    return output.sum() - label.sum() * 0  # SumBackward saves no tensor: only a reference keeps the output


def batches(n=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


class ReadsOutput(BaseHook):
    """A hook of one's own reading the output in after_train_iter (the default: it may)."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def after_train_iter(self, trainer, output, label, loss):
        self.rows.append(output.shape[0])


class Declares(ReadsOutput):
    reads_train_output = False

    def after_train_iter(self, trainer, output, label, loss):
        self.rows.append(output)


def fit(hooks, auto=False, accumulation=1):
    """``hooks``: a list, or a function of the engine that makes one."""
    model = WatchedOutput()
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), sum_loss,
                    window=AccumulationWindow(accumulation))
    if auto:
        engine.auto_batcher = AutoMicroBatcher()
    Trainer(engine).fit(batches(), epochs=1, hooks=hooks(engine) if callable(hooks) else hooks)
    return model


@pytest.mark.parametrize("auto", [False, True], ids=["plain", "auto-micro-batching"])
def test_the_output_is_let_go_before_the_backward_when_no_hook_reads_it(tmp_path, auto):
    def hooks(engine):  # the built-in hooks that handle an event after the loss, AccuracyHook aside
        schedule = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
        return [LossHook(), LRSchedulerHook(schedule, by_epoch=False), ThroughputHook(),
                SaveCheckpointHook("2ba", checkpoint_dir=tmp_path), EMAHook(decay=0.9)]

    model = fit(hooks, auto=auto)
    assert model.alive_in_backward == [False] * 4


@pytest.mark.parametrize("hook", [ReadsOutput, lambda: AccuracyHook(Accuracy(), track_train=True)],
                         ids=["own-hook", "AccuracyHook"])
def test_a_hook_that_may_read_it_keeps_it_and_gets_it(hook):
    h = hook()
    model = fit([LossHook(), h], accumulation=2)
    assert model.alive_in_backward == [True] * 4
    if isinstance(h, ReadsOutput):
        assert h.rows == [4] * 4  # the output itself, after the backward and the update


def test_a_hook_that_says_it_does_not_read_it_gets_none():
    h = Declares()
    model = fit([h])
    assert model.alive_in_backward == [False] * 4
    assert h.rows == [None] * 4


def test_letting_it_go_changes_no_number():
    """The same run with the output kept (a hook that may read it) and let go: parameters bitwise equal."""
    kept, let_go = fit([LossHook(), ReadsOutput()]), fit([LossHook()])
    for a, b in zip(kept.parameters(), let_go.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("returned", [False, True])
def test_execute_schedule_lets_the_output_go_when_it_is_not_returned(returned):
    """Legacy's loop ``engine.execute_schedule(it, return_output_label=False)`` asks for the loss alone: the output
    was kept through the backward all the same (found by the memory probe)."""
    model = WatchedOutput()
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), sum_loss, window=AccumulationWindow(1))
    output, _, loss = engine.execute_schedule(iter(batches(1)), return_output_label=returned)
    assert model.alive_in_backward == [returned] and (output is not None) is returned and loss is not None


def test_the_last_evaluation_batch_is_let_go_when_the_evaluation_ends():
    """Its output lived on in ``state.output`` into the training forward after an evaluation inside ``fit`` (found
    by the memory probe)."""

    class AtEpochStart(BaseHook):
        def __init__(self, model):
            super().__init__()
            self.model, self.alive = model, []

        def before_train_epoch(self, trainer):
            if trainer.state.epoch:  # the model's last forward was the evaluation's last batch
                self.alive.append(self.model.out_ref() is not None)

    model = WatchedOutput()
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), sum_loss, window=AccumulationWindow(1))
    watch = AtEpochStart(model)
    Trainer(engine).fit(batches(2), epochs=2, test_dataloader=batches(2), hooks=[LossHook(), watch])
    assert watch.alive == [False]
