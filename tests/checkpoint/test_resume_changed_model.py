"""Resuming after the model changed: the error names the checkpoint it read and the ways on (issue 29, item 5)."""
import pytest
import torch
from torch import nn

import colossal_lite
from colossal_lite.checkpoint.model_state import ModelMismatchError
from colossal_lite.core import global_context as gpc
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import LoadCheckpointHook, LossHook, SaveCheckpointHook


@pytest.fixture(autouse=True)
def launched():
    colossal_lite.launch_from_torch(config={}, seed=1, verbose=False)
    yield
    gpc.destroy()


def run(model, folder, hooks=(), **fit_kwargs):
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(3)]
    engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
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
