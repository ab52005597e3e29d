"""gradient_accumulation='auto': an injected out-of-memory error splits the batch; the result equals the unsplit run."""
import json
from pathlib import Path

import pytest
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


# -- each gradient reduction: a split batch is the accumulation of its pieces, bit for bit ------------------------
# The pieces of a split batch are run as one window of micro-batches would run them, so the same pieces trained
# with a fixed gradient_accumulation give the same parameters bit for bit (an unsplit batch cannot: its sums run
# in another order). A mean weighs each piece by its share of the samples, a sum adds the pieces' sums, a token
# mean counts each piece's real tokens; a try that ran out of memory after a piece counted nothing of it.
TOKEN_MODEL = r'''
import torch
import torch.nn.functional as F


class TinyLM(torch.nn.Module):
    """Embedding and head over 6-token sequences; a forward of more than ``limit`` samples, or the forward
    numbered in ``fail_calls`` (from 1), raises the out-of-memory error a GPU would."""

    def __init__(self, limit, fail_calls=()):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11)
        self.limit, self.fail_calls, self.calls = limit, set(fail_calls), []

    def forward(self, x):
        self.calls.append(x.shape[0])
        if x.shape[0] > self.limit or len(self.calls) in self.fail_calls:
            raise torch.OutOfMemoryError(f"injected at forward {len(self.calls)} of {x.shape[0]} samples")
        return self.head(self.emb(x))


def token_sum_and_count(out, y):  # grad_reduction='per-token-mean': (loss summed over real tokens, their count)
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum"), (y != -100).sum()


CRITERIA = {
    "mean": lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=-100),
    "sum": lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum"),
    "per-token-mean": token_sum_and_count,
}


def token_batches(rank=0):
    g = torch.Generator().manual_seed(1 + rank)
    x, y = torch.randint(0, 11, (4, 6), generator=g), torch.randint(0, 11, (4, 6), generator=g)
    y[0, 3 - rank:] = -100  # padding: the samples (and the ranks) hold different numbers of real tokens
    y[1, 1:] = -100
    return x, y


def train(colossal_lite, model, reduction, accumulation, batches):
    engine = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), CRITERIA[reduction],
                                      config=dict(gradient_accumulation=accumulation, grad_reduction=reduction),
                                      verbose=False)[0]
    it = iter(batches)
    engine.zero_grad()
    for _ in batches:
        engine.execute_schedule(it)
        engine.step()
    return engine


def train_both(colossal_lite, reduction, fail_calls, pieces, rank=0):
    """(the parameters of 'auto' trained on one batch of 4 with a model that fits 2 samples, those of the batch's
    ``pieces`` equal pieces trained with gradient_accumulation=pieces, the auto model's forward sizes)."""
    x, y = token_batches(rank)
    torch.manual_seed(0)
    auto = TinyLM(limit=2, fail_calls=fail_calls)
    train(colossal_lite, auto, reduction, "auto", [(x, y)])
    torch.manual_seed(0)
    size = 4 // pieces
    accumulated = train(colossal_lite, TinyLM(limit=4), reduction, pieces,
                        [(x[i:i + size], y[i:i + size]) for i in range(0, 4, size)])
    return list(auto.parameters()), list(accumulated.model.parameters()), auto.calls
'''


def _token_model(tmp_path):
    import importlib
    import sys
    (tmp_path / "auto_token_model.py").write_text(TOKEN_MODEL)
    sys.path.insert(0, str(tmp_path))
    try:
        return importlib.import_module("auto_token_model")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("auto_token_model", None)


@pytest.mark.parametrize("reduction", ("mean", "sum", "per-token-mean"))
@pytest.mark.parametrize("fail_calls", ((), (3,)), ids=("split-in-two", "a-piece-fails-after-one-ran"))
def test_a_split_batch_is_the_accumulation_of_its_pieces_under_every_gradient_reduction(
        launched, tmp_path, reduction, fail_calls):
    helpers = _token_model(tmp_path)
    launched({})
    pieces = 4 if fail_calls else 2
    auto, accumulated, calls = helpers.train_both(colossal_lite, reduction, fail_calls, pieces)
    # 4 fails; 2 and 2 fit, or 2 fits, then the injected failure, then 4 pieces of 1
    assert calls == ([4, 2, 2] if not fail_calls else [4, 2, 2, 1, 1, 1, 1])
    for p, q in zip(auto, accumulated):
        assert torch.equal(p, q), (reduction, p, q)


TOKEN_RANK_SCRIPT = r'''
import json, sys
import torch
sys.path.insert(0, {folder!r})
import colossal_lite
from colossal_lite.core import global_context as gpc
from auto_token_model import train_both
colossal_lite.launch_from_torch(config={{}}, verbose=False)
rank = gpc.get_global_rank()
equal = {{}}
for reduction in ("mean", "sum", "per-token-mean"):
    auto, accumulated, calls = train_both(colossal_lite, reduction, (), 2, rank)
    equal[reduction] = calls == [4, 2, 2] and all(torch.equal(p, q) for p, q in zip(auto, accumulated))
json.dump(equal, open({out!r} + f".{{rank}}", "w"))
gpc.destroy()
'''


def test_two_ranks_with_different_token_counts_split_each_reduction_as_accumulation_does(tmp_path):
    # the ranks' gradients meet once per batch: a sum is made whole again over the ranks, a token mean divides
    # by the real tokens of both ranks (rank 1's batch holds one real token more)
    (tmp_path / "auto_token_model.py").write_text(TOKEN_MODEL)
    script = tmp_path / "auto_token_rank.py"
    script.write_text(TOKEN_RANK_SCRIPT.format(folder=str(tmp_path), out=str(tmp_path / "equal")))
    run_ranks(script, nproc=2, timeout=180)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"equal.{rank}").read_text()) == {
            "mean": True, "sum": True, "per-token-mean": True}
