"""gradient_accumulation='auto': an injected out-of-memory error splits the batch; the result equals the unsplit run."""
import json
from pathlib import Path

import torch
from dist_helpers import run_ranks
from engine_helpers import make_batches, make_model

import colossal_lite


class OOMAbove(torch.nn.Module):
    """The real model, but a batch larger than ``limit`` raises the out-of-memory error a GPU would."""

    def __init__(self, inner, limit):
        super().__init__()
        self.inner, self.limit = inner, limit
        self.calls = []

    def forward(self, x):
        self.calls.append(x.shape[0])
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"injected: {x.shape[0]} samples > {self.limit}")
        return self.inner(x)


def train(model, config, batches, launched):
    launched(config)
    engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                    torch.nn.CrossEntropyLoss(), batches, verbose=False)
    it = iter(loader)
    losses = []
    for _ in batches:
        engine.zero_grad()
        _, _, loss = engine.execute_schedule(it)
        engine.step()
        losses.append(float(loss.detach()))
    return engine, losses


def test_auto_split_equals_unsplit_run(launched):
    batches = make_batches(3, b=8)
    ref, ref_losses = train(make_model(), {}, batches, launched)
    model = OOMAbove(make_model(), limit=3)
    engine, losses = train(model, dict(gradient_accumulation="auto"), batches, launched)
    assert model.calls[:4] == [8, 4, 2, 2]  # 1 part fails, 2 parts fail, 4 parts of 2 succeed
    assert engine.auto_batcher.parts == 4
    assert engine.num_updates == 3
    for p, q in zip(model.inner.parameters(), ref.model.parameters()):
        torch.testing.assert_close(p, q)
    assert losses == __import__("pytest").approx(ref_losses, rel=1e-5)


RANK_SCRIPT = r'''
import json, sys
import torch
sys.path.insert(0, {tests!r})
import colossal_lite
from colossal_lite.core import global_context as gpc
from engine_helpers import make_batches, make_model
from test_auto_microbatch_model import OOMAbove
colossal_lite.launch_from_torch(config=dict(gradient_accumulation="auto"), verbose=False)
rank = gpc.get_global_rank()
model = OOMAbove(make_model(), limit=8 if rank == 0 else 2)  # only rank 1 runs out
engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                torch.nn.CrossEntropyLoss(), make_batches(3, b=8), verbose=False)
it = iter(loader)
for _ in range(3):
    engine.zero_grad()
    x, y = next(it)
    half = slice(rank * 4, rank * 4 + 4)
    engine.execute_schedule(iter([(x[half], y[half])]))
    engine.step()
json.dump(dict(parts=engine.auto_batcher.parts, params=[p.tolist() for p in model.inner.parameters()]),
          open({out!r} + f".{{rank}}", "w"))
gpc.destroy()
'''


def test_two_ranks_agree_on_the_split(tmp_path):
    tests = Path(__file__).parents[1]
    (tmp_path / "test_auto_microbatch_model.py").write_text(
        "import torch\n" + __import__("inspect").getsource(OOMAbove))
    script = tmp_path / "auto_rank.py"
    script.write_text(RANK_SCRIPT.format(tests=str(tests), out=str(tmp_path / "res")))
    run_ranks(script, nproc=2, timeout=180)
    r0, r1 = (json.loads((tmp_path / f"res.{r}").read_text()) for r in (0, 1))
    assert r0["parts"] == r1["parts"] == 2  # rank 1's limit of 2 forced both ranks to 2 parts of 2
    ref = make_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in make_batches(3, b=8):
        opt.zero_grad()
        torch.nn.CrossEntropyLoss()(ref(x), y).backward()
        opt.step()
    for got in (r0, r1):
        for p, q in zip(got["params"], ref.parameters()):
            torch.testing.assert_close(torch.tensor(p), q.detach(), rtol=1e-5, atol=1e-6)
