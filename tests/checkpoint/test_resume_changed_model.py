"""Resuming after the model or the optimizer class changed: the error names the checkpoint it read and the ways on
(issue 29, item 5)."""
import pytest
import torch
from torch import nn

import colossal_lite
from colossal_lite.checkpoint.model_state import ModelMismatchError
from colossal_lite.checkpoint.optimizer_match import OptimizerMismatchError, check_optimizer_state
from colossal_lite.core import global_context as gpc
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import LoadCheckpointHook, LossHook, SaveCheckpointHook
from colossal_lite.utils import load_checkpoint, save_checkpoint


@pytest.fixture(autouse=True)
def launched():
    colossal_lite.launch_from_torch(config={}, seed=1, verbose=False)
    yield
    gpc.destroy()


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


def run(model, folder, hooks=(), optimizer=sgd, **fit_kwargs):
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(3)]
    engine, loader, _, _ = colossal_lite.initialize(model, optimizer(model.parameters()),
                                                    nn.CrossEntropyLoss(), batches, verbose=False)
    return Trainer(engine).fit(loader, epochs=1, hooks=[LossHook(), SaveCheckpointHook(1, folder), *hooks],
                               **fit_kwargs)


def test_a_changed_layer_size_names_the_checkpoint_and_the_ways_on(tmp_path):
    run(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)), tmp_path / "ck")
    with pytest.raises(ModelMismatchError) as caught:
        run(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)), tmp_path / "ck", resume_from="auto")
    message = str(caught.value)
    assert "shape mismatches" in message and "0.weight: checkpoint (8, 6) vs model (16, 6)" in message
    assert f"Checkpoint read: {tmp_path / 'ck' / 'epoch0-step3'}" in message
    assert "checkpoint_dir='another/folder'" in message and "fit(..., resume_from=None)" in message
    assert "finetune=True" not in message  # shapes differ: loading 'what matches' would fail the same way


def test_an_added_layer_offers_the_weights_that_match(tmp_path):
    run(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)), tmp_path / "ck")
    grown = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3), nn.Linear(3, 3))
    with pytest.raises(ModelMismatchError) as caught:
        run(grown, tmp_path / "ck", resume_from="auto")
    message = str(caught.value)
    assert "missing keys (2): 3.bias, 3.weight" in message
    fix = f"LoadCheckpointHook('{tmp_path / 'ck'}', finetune=True, strict=False)"
    assert fix in message
    # and the way it names works: the matching weights are loaded, training starts from step 0
    history = run(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3), nn.Linear(3, 3)), tmp_path / "new",
                  hooks=[LoadCheckpointHook(str(tmp_path / "ck"), finetune=True, strict=False)])
    assert [r["step"] for r in history.steps][-1] == 3


def model():
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


@pytest.mark.parametrize("saved, resumed, names", [(adam, sgd, ("Adam", "SGD")), (sgd, adam, ("SGD", "Adam"))])
def test_another_optimizer_class_names_the_checkpoint_and_both_classes(tmp_path, saved, resumed, names):
    """It failed with torch's bare KeyError ('momentum', 'step') from inside the optimizer's own code."""
    run(model(), tmp_path / "ck", optimizer=saved)
    with pytest.raises(OptimizerMismatchError) as caught:
        run(model(), tmp_path / "ck", optimizer=resumed, resume_from="auto")
    message = str(caught.value)
    assert f"the checkpoint's optimizer state was written by {names[0]}, and this run's optimizer is {names[1]}" \
        in message
    assert f"Checkpoint read: {tmp_path / 'ck' / 'epoch0-step3'}" in message
    assert f"LoadCheckpointHook('{tmp_path / 'ck'}', finetune=True)" in message
    # and the way it names works
    history = run(model(), tmp_path / "new", optimizer=resumed,
                  hooks=[LoadCheckpointHook(str(tmp_path / "ck"), finetune=True)])
    assert [r["step"] for r in history.steps][-1] == 3


def test_an_older_checkpoint_without_the_class_is_judged_by_its_options():
    """Written before the class was recorded: options of another class on both sides name the difference; an LR
    scheduler's own entries (initial_lr) and options a newer torch added are no difference."""
    params = list(model().parameters())
    with pytest.raises(OptimizerMismatchError, match=r"written by another optimizer class than this run's SGD: its "
                                                     r"options .*betas.* are not SGD's, and it lacks SGD's "
                                                     r"dampening, momentum$"):
        check_optimizer_state(sgd(params), adam(params).state_dict(), None)
    scheduled = sgd(params)
    torch.optim.lr_scheduler.StepLR(scheduled, 2)
    older = scheduled.state_dict()
    for group in older["param_groups"]:
        del group["foreach"], group["fused"]  # (as if written by a torch without these options)
    check_optimizer_state(sgd(params), older, None)


def test_load_checkpoint_into_another_optimizer_class_names_both(tmp_path):
    net = model()
    save_checkpoint(tmp_path / "ck.pt", 1, net, adam(net.parameters()))
    # (a file of objects no engine owns records no class: the options tell)
    with pytest.raises(OptimizerMismatchError, match=rf"cannot load the optimizer state of {tmp_path / 'ck.pt'}: the "
                                                     r"checkpoint's optimizer state was written by another optimizer "
                                                     r"class than this run's SGD: .*; build the optimizer it was "
                                                     r"written with, or load the model alone"):
        load_checkpoint(tmp_path / "ck.pt", net, sgd(net.parameters()))
    assert load_checkpoint(tmp_path / "ck.pt", net) == 1  # the model alone loads
