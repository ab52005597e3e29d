"""ZeRO stages 2 and 3 shard over the ranks on the model's device type, not on the machine's accelerator.

FSDP2 given no device mesh builds one for ``torch``'s current accelerator and moves the parameters there: on a
machine with GPUs, a run launched with ``device='cpu'`` had every rank's model put on the first GPU while the engine
fed it host tensors (found by reading the CUDA-only paths). The machine here has no GPU, so torch's accelerator query
is made to answer as it does on one; that query is the only part faked.
"""
import torch
from torch import nn

import colossal_lite


def test_a_cpu_run_stays_on_the_cpu_on_a_machine_with_an_accelerator(launched, monkeypatch):
    launched(dict(zero=dict(stage=3)))
    monkeypatch.setattr(torch._C, "_get_accelerator", lambda: torch.device("cuda"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    engine, *_ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(),
                                          verbose=False)
    assert {p.device.type for p in engine.model.parameters()} == {"cpu"}
    before = [p.detach().full_tensor().clone() for p in engine.model.parameters()]
    engine.zero_grad()
    engine.backward(engine.criterion(engine(torch.randn(3, 4)), torch.randn(3, 2)))
    assert engine.step()
    assert all(not torch.equal(b, p.detach().full_tensor()) for b, p in zip(before, engine.model.parameters()))
