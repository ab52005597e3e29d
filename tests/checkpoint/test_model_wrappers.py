"""What a checkpoint holds of a model: the user's whole module, with only real wrappers taken off (DDP's
``module``, torch.compile's ``_orig_mod``). A model with a child of its own called ``module`` (a backbone beside a
head, a common wrapper pattern) is the model whole; a state dict saved from a hand-compiled model loads."""
import pytest
import torch
from torch import nn

import colossal_lite
from colossal_lite.checkpoint.model_state import load_model_state, strip_prefix, unwrap_module
from colossal_lite.core import global_context as gpc
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import LossHook, SaveCheckpointHook
from colossal_lite.utils import load_checkpoint, save_checkpoint


class Wrapper(nn.Module):
    """A backbone kept as ``self.module`` and a head beside it."""

    def __init__(self):
        super().__init__()
        self.module = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.module(x)))


class OnlyChild(nn.Module):
    def __init__(self):
        super().__init__()
        self.module = nn.Linear(6, 3)

    def forward(self, x):
        return self.module(x)


@pytest.fixture(autouse=True)
def launched():
    colossal_lite.launch_from_torch(config={}, seed=1, verbose=False)
    yield
    gpc.destroy()


def batches(n=3):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


def train(model, folder, epochs, **fit_kwargs):
    engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                    nn.CrossEntropyLoss(), batches(), verbose=False)
    Trainer(engine).fit(loader, epochs=epochs, hooks=[LossHook(), SaveCheckpointHook(1, folder)],
                        display_progress=False, **fit_kwargs)
    return engine


def test_a_child_called_module_is_part_of_the_model_in_the_engine_and_its_checkpoints(tmp_path):
    torch.manual_seed(0)
    model = Wrapper()
    engine = train(model, tmp_path / "ck", epochs=1)
    assert engine.unwrapped_model is model
    assert set(engine.state_dict()["model"]) == {"module.weight", "module.bias", "head.weight", "head.bias"}

    torch.manual_seed(0)
    whole = train(Wrapper(), tmp_path / "whole", epochs=2)
    torch.manual_seed(5)  # another initialisation: the resume must replace all of it, the head too
    resumed = train(Wrapper(), tmp_path / "ck", epochs=2, resume_from="auto")
    for (name, p), q in zip(whole.unwrapped_model.named_parameters(), resumed.unwrapped_model.parameters()):
        assert torch.equal(p, q), name


def test_the_legacy_save_checkpoint_keeps_the_head_of_such_a_model(tmp_path):
    torch.manual_seed(0)
    model = Wrapper()
    save_checkpoint(tmp_path / "ck.pt", 0, model)
    torch.manual_seed(5)
    other = Wrapper()
    load_checkpoint(tmp_path / "ck.pt", other)
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(p, q), name


def test_real_wrappers_are_taken_off_in_any_nesting():
    model = Wrapper()
    compiled = torch.compile(model)
    assert unwrap_module(compiled) is model
    assert unwrap_module(nn.DataParallel(compiled)) is model


def test_a_state_dict_of_a_hand_compiled_model_loads(tmp_path):
    torch.manual_seed(0)
    source = Wrapper()
    state = torch.compile(source).state_dict()
    assert all(k.startswith("_orig_mod.") for k in state)
    target = Wrapper()
    load_model_state(target, state)
    for (name, p), q in zip(source.named_parameters(), target.parameters()):
        assert torch.equal(p, q), name


def test_a_prefix_that_is_the_models_own_child_stays():
    model = OnlyChild()
    own = model.state_dict()
    assert strip_prefix(dict(own), own).keys() == own.keys()
    ddp_style = {"module." + k: v for k, v in own.items()}  # saved through DDP: one prefix too many
    assert strip_prefix(ddp_style, own).keys() == own.keys()
