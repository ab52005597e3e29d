"""compile=...: the model runs through torch.compile and trains to the same parameters as eager."""
import pytest
import torch
from engine_helpers import make_batches, make_model

import colossal_lite


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
