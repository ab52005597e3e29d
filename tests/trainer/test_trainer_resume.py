"""Resuming fit inside an epoch, and the gradient_accumulation='auto' path."""
import copy

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from colossal_lite.engine.accumulation import AccumulationDataLoader, AccumulationWindow
from colossal_lite.engine.auto_batch import AutoMicroBatcher
from colossal_lite.engine.engine import Engine
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import LossHook, MixUp
from colossal_lite.utils import get_dataloader


def dataset(n=40):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def build(accumulation=2):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    window = AccumulationWindow(accumulation)
    engine = Engine(model, opt, nn.CrossEntropyLoss(), window=window)
    loader = AccumulationDataLoader(get_dataloader(dataset(), shuffle=True, seed=7, batch_size=4), window)
    return model, engine, loader


@pytest.mark.parametrize("restore_loader", [True, False])
def test_resume_inside_an_epoch_equals_an_uninterrupted_run(restore_loader):
    ref_model, ref_engine, ref_loader = build()
    Trainer(ref_engine).fit(ref_loader, epochs=3, hooks=[LossHook()])

    _, engine, loader = build()
    trainer = Trainer(engine)
    trainer.fit(loader, epochs=3, max_steps=7, hooks=[LossHook()])  # 5 steps per epoch: stops inside epoch 1
    assert (trainer.cur_epoch, trainer.state.batch_idx, trainer.steps_per_epoch) == (1, 4, 5)
    saved = dict(engine=copy.deepcopy(engine.state_dict()), trainer=trainer.state_dict(), data=loader.state_dict())

    model, engine2, loader2 = build()
    engine2.load_state_dict(saved["engine"])
    trainer2 = Trainer(engine2)
    trainer2.load_state_dict(saved["trainer"])
    if restore_loader:
        loader2.load_state_dict(saved["data"])  # the sampler starts at batch 4 by itself
    # otherwise the trainer moves the sampler to batch 4 of epoch 1
    trainer2.fit(loader2, epochs=3, hooks=[LossHook()])
    assert (trainer2.cur_epoch, trainer2.cur_step) == (3, 15)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


def test_auto_micro_batching_goes_through_the_batcher_and_equals_the_engine_loop():
    ref_model, ref_engine, _ = build(accumulation=1)
    ref_engine.auto_batcher = AutoMicroBatcher()
    batches = [(x.reshape(4, 6), y.reshape(4)) for x, y in zip(dataset().tensors[0].split(4),
                                                                  dataset().tensors[1].split(4))]
    it = iter(batches)
    for _ in batches:
        ref_engine.zero_grad()
        ref_engine.execute_schedule(it)
        ref_engine.step()

    model, engine, _ = build(accumulation=1)
    engine.auto_batcher = AutoMicroBatcher()
    calls = []
    original = engine.auto_batcher.run
    engine.auto_batcher.run = lambda *a, **k: calls.append(1) or original(*a, **k)
    Trainer(engine).fit(batches, epochs=1, hooks=[LossHook()])
    assert len(calls) == len(batches) and engine.num_updates == len(batches)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


def test_hooks_between_forward_and_backward_are_refused_with_auto_micro_batching():
    _, engine, _ = build(accumulation=1)
    engine.auto_batcher = AutoMicroBatcher()
    with pytest.raises(ValueError, match=r"gradient_accumulation='auto' runs forward, loss and backward as one unit.*"
                                         r"these hooks try to: MixUp.after_forward, MixUp.after_loss"):
        trainer = Trainer(engine)
        trainer.fit([(torch.randn(4, 6), torch.zeros(4, dtype=torch.long))], epochs=1, hooks=[MixUp()])
    assert trainer._step is None and not trainer.state.fitting
