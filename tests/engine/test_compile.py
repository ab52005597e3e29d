"""compile=...: the model runs through torch.compile and trains to the same parameters as eager."""
import pytest
import torch
from engine_helpers import make_batches, make_model

import colossal_lite
from colossal_lite.checkpoint import load_weights
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import SaveCheckpointHook
from colossal_lite.utils import load_checkpoint, save_checkpoint


def run(config, launched):
    launched(config)
    model = make_model()
    engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                    torch.nn.CrossEntropyLoss(), make_batches(3), verbose=False)
    for x, y in loader:
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        engine.step()
    return engine


@pytest.mark.slow  # takes seconds without starting a process
def test_compiled_model_matches_eager(launched):
    eager = run({}, launched)
    compiled = run(dict(compile=dict(backend="aot_eager")), launched)
    assert hasattr(compiled.model, "_orig_mod")  # really wrapped by torch.compile
    assert isinstance(compiled.unwrapped_model, torch.nn.Sequential)
    assert compiled.compile_time_s is not None and compiled.compile_time_s > 0
    assert list(compiled.state_dict()["model"]) == list(eager.state_dict()["model"])  # no _orig_mod. prefixes
    for p, q in zip(compiled.unwrapped_model.parameters(), eager.unwrapped_model.parameters()):
        torch.testing.assert_close(p, q)


@pytest.mark.slow  # compiling takes seconds
def test_a_checkpoint_of_a_compiled_run_loads_into_a_plain_model(launched, tmp_path):
    """compile=True wraps the model in torch.compile's ``_orig_mod``: neither the run's checkpoint folder nor a
    legacy ``save_checkpoint`` file of the compiled model keeps that prefix, so both load into the plain model.
    (aot_eager: the same ``_orig_mod`` wrapper as inductor's, without starting a C++ compiler.)"""
    launched(dict(compile=dict(backend="aot_eager")))
    model = make_model()
    engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                    torch.nn.CrossEntropyLoss(), make_batches(2), verbose=False)
    assert hasattr(engine.model, "_orig_mod")  # really compiled
    Trainer(engine).fit(loader, epochs=1, hooks=[SaveCheckpointHook(1, tmp_path / "ck")])
    trained = {k: v.detach().clone() for k, v in engine.unwrapped_model.state_dict().items()}
    assert not torch.equal(trained["0.weight"], make_model().state_dict()["0.weight"])  # the steps changed it

    plain = make_model(seed=1)
    plain.load_state_dict(load_weights(tmp_path / "ck"))  # strict: every key, none with _orig_mod.
    for name, value in plain.state_dict().items():
        assert torch.equal(value, trained[name]), name

    save_checkpoint(tmp_path / "legacy.pt", 0, engine.model)  # the compiled module itself
    assert list(torch.load(tmp_path / "legacy.pt", weights_only=True)["model"]) == list(trained)
    plain = make_model(seed=1)
    load_checkpoint(tmp_path / "legacy.pt", plain)
    for name, value in plain.state_dict().items():
        assert torch.equal(value, trained[name]), name
