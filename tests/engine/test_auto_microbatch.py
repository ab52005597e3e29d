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
model.calls.clear()  # an evaluation batch of 4 per rank: only rank 1 runs out again, and both split it
engine.eval()
engine.execute_schedule(iter([(x[half], y[half])]), forward_only=True)
json.dump(dict(parts=engine.auto_batcher.parts, params=[p.tolist() for p in model.inner.parameters()],
               eval_calls=model.calls), open({out!r} + f".{{rank}}", "w"))
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
    assert r0["eval_calls"] == r1["eval_calls"] == [4, 2, 2]
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


# -- where 'auto' meets buffers, random numbers, dict outputs and the loss a user reads ----------------------------
class LateOOM(torch.nn.Module):
    """BatchNorm and dropout, and an out-of-memory error raised after the forward ran (as a real one is, inside
    the model or its backward) for batches of more than ``limit`` samples; a dict output."""

    def __init__(self, limit):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.3),
                                        torch.nn.Linear(8, 4))
        self.limit, self.calls = limit, []

    def forward(self, x):
        self.calls.append(x.shape[0])
        out = self.body(x)
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError("injected after the forward")
        return {"logits": out, "scale": torch.ones(())}


def train_late(launched, accumulation, limit, batches):
    launched({})
    torch.manual_seed(0)
    model = LateOOM(limit)
    engine = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      lambda out, y: torch.nn.functional.cross_entropy(out["logits"], y),
                                      config=dict(gradient_accumulation=accumulation), verbose=False)[0]
    it, outputs = iter(batches), []
    for _ in batches:  # the legacy loop: zero_grad and step every iteration, applied at a window's end
        engine.zero_grad()
        outputs.append(engine.execute_schedule(it)[0])
        engine.step()
    return model, outputs


def test_a_failed_try_leaves_no_buffer_update_or_random_draw_and_outputs_keep_their_type(launched):
    """A try that ran out of memory after its forward had updated BatchNorm's statistics and drawn dropout's
    masks: the retry now starts from the state before it, so the pieces train bit for bit as a fixed accumulation
    of them does (buffers too); a dict output stays a dict, split or not (it became a list of dicts)."""
    x, y = make_batches(2, b=8, din=6, dout=4)[0][0], torch.randint(0, 4, (8,))
    auto, outputs = train_late(launched, "auto", 4, [(x, y), (x.flip(0), y.flip(0))])
    assert auto.calls == [8, 4, 4, 4, 4]  # the second batch starts with the first one's split
    halves = [(x[:4], y[:4]), (x[4:], y[4:]), (x.flip(0)[:4], y.flip(0)[:4]), (x.flip(0)[4:], y.flip(0)[4:])]
    fixed, _ = train_late(launched, 2, 8, halves)
    for (name, a), b in zip(auto.state_dict().items(), fixed.state_dict().values()):
        assert torch.equal(a, b), name
    assert all(type(o) is dict and o["logits"].shape == (8, 4) and o["scale"].dim() == 0 for o in outputs)
    _, unsplit = train_late(launched, "auto", 8, [(x, y)])
    assert type(unsplit[0]) is dict and unsplit[0]["logits"].shape == (8, 4)


def test_the_loss_a_user_reads_is_the_batchs_under_every_reduction_and_an_unsplittable_batch_keeps_the_split(
        launched, tmp_path):
    """The loss 'auto' returns joins its pieces as the reduction does: a sum's were weighed by their share of the
    samples (a split batch reported half its loss), a token mean's by samples instead of tokens. A batch that no
    split fits raises, and the next batch starts with the split the one before it needed, not pieces of one."""
    helpers = _token_model(tmp_path)
    x, y = helpers.token_batches()
    # (under 'mean' a split batch's loss is its pieces' means weighed by their samples, as its gradient is, which
    # with padding is not the whole batch's token mean: the other two reductions add up exactly)
    for reduction in ("sum", "per-token-mean"):
        losses = []
        for limit in (4, 2):  # whole, then split in two
            launched({})
            torch.manual_seed(0)
            model = helpers.TinyLM(limit=limit)
            engine = helpers.train(colossal_lite, model, reduction, "auto", [])
            engine.zero_grad()
            losses.append(engine.execute_schedule(iter([(x, y)]))[2])
        assert losses[1].item() == pytest.approx(losses[0].item(), rel=1e-6), reduction
    launched({})
    model = helpers.TinyLM(limit=2)
    engine = helpers.train(colossal_lite, model, "mean", "auto", [(x, y)])  # settles on 2 pieces of 2
    model.limit = 0
    with pytest.raises(torch.OutOfMemoryError, match="even micro-batches of 1 sample run out of memory"):
        engine.execute_schedule(iter([(x, y)]))
    assert engine.auto_batcher.parts == 2


DDP_BUFFERS_SCRIPT = r'''
import json, sys
import torch
sys.path.insert(0, {folder!r})
import colossal_lite
from colossal_lite.core import global_context as gpc
from late_oom import LateOOM
colossal_lite.launch_from_torch(config={{}}, verbose=False)
rank = gpc.get_global_rank()
g = torch.Generator().manual_seed(rank)
x, y = torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)

def train(accumulation, limit, batches):
    torch.manual_seed(0)
    model = LateOOM(limit)
    engine = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      lambda out, y: torch.nn.functional.cross_entropy(out["logits"], y),
                                      config=dict(gradient_accumulation=accumulation), verbose=False)[0]
    it = iter(batches)
    for _ in batches:
        engine.zero_grad()
        engine.execute_schedule(it)
        engine.step()
    # the evaluation after training: its forward brings the ranks' buffers together, as after a synced step
    engine.eval()
    evaluated = engine.execute_schedule(iter([(x[:4], y[:4])]), forward_only=True)[0]["logits"]
    return model, evaluated

auto, auto_eval = train("auto", 8 if rank == 0 else 4, [(x, y), (x.flip(0), y.flip(0))])  # only rank 1 runs out
fixed, fixed_eval = train(2, 8, [(x[:4], y[:4]), (x[4:], y[4:]), (x.flip(0)[:4], y.flip(0)[:4]),
                                 (x.flip(0)[4:], y.flip(0)[4:])])
json.dump(dict(calls=auto.calls, equal=all(torch.equal(a, b) for a, b in zip(auto.state_dict().values(),
                                                                          fixed.state_dict().values())),
               eval_equal=torch.equal(auto_eval, fixed_eval),
               mean=auto.body[1].running_mean.tolist()), open({out!r} + f".{{rank}}", "w"))
gpc.destroy()
'''


def test_two_ranks_under_ddp_with_buffers_split_together_when_one_runs_out(tmp_path):
    """DDP brings the ranks' buffers together at a forward that follows a synced one; every piece of 'auto' runs
    without gradient sync, so after the first try no forward brought them together again (BatchNorm's statistics
    drifted apart), and a rank whose forward raised was left expecting that broadcast while the other went on to
    the flag all-reduce: the run hung. Each try now starts with the broadcast on every rank."""
    (tmp_path / "late_oom.py").write_text("import torch\n\n\n" + __import__("inspect").getsource(LateOOM))
    script = tmp_path / "ddp_buffers_rank.py"
    script.write_text(DDP_BUFFERS_SCRIPT.format(folder=str(tmp_path), out=str(tmp_path / "res")))
    run_ranks(script, nproc=2, timeout=120)
    r0, r1 = (json.loads((tmp_path / f"res.{r}").read_text()) for r in (0, 1))
    assert r0["calls"] == [8, 4, 4, 4, 4, 4] and r1["calls"] == [8, 4, 4, 4, 4, 4]  # (the last: the evaluation)
    # bit for bit as DDP's accumulation over the same pieces, buffers included (the ranks' own statistics differ
    # after each training forward, as under DDP: the broadcast is at the next one)
    assert r0["equal"] and r1["equal"]
    # and the evaluation after training reads rank 0's statistics on every rank, as after DDP's own steps (rank 1
    # evaluated with its own: every piece ran without sync, which turned DDP's broadcast off)
    assert r0["eval_equal"] and r1["eval_equal"]
    assert r0["mean"] == r1["mean"]


def test_the_split_the_run_settled_on_is_in_the_checkpoint(launched, tmp_path):
    """A resumed run starts with the split the run had settled on (it tried the first batch whole again, so its
    parameters drifted from the uninterrupted run's, and a model whose forward had changed buffers before running
    out of memory was left changed)."""
    helpers = _token_model(tmp_path)
    x, y = helpers.token_batches()
    launched({})
    engine = helpers.train(colossal_lite, helpers.TinyLM(limit=2), "mean", "auto", [(x, y)])
    state = engine.state_dict()
    assert state["accumulation"]["auto_parts"] == 2
    resumed_model = helpers.TinyLM(limit=2)
    resumed = helpers.train(colossal_lite, resumed_model, "mean", "auto", [])
    resumed.load_state_dict(state)
    resumed.zero_grad()
    resumed.execute_schedule(iter([(x, y)]))
    assert resumed_model.calls == [2, 2]  # no whole try first


# -- evaluation: a batch that runs out of memory is run in pieces too ------------------------------------------
def test_an_evaluation_batch_that_runs_out_is_split_and_reads_as_a_loop_that_evaluates_in_chunks(launched):
    """Evaluation batches are often larger than training's (no gradients are kept); under 'auto' one that ran out
    of memory stopped the run. Its forward now runs in pieces: the output is the chunks' outputs joined and the
    loss the criterion's on them, bit for bit what a loop that evaluates in chunks computes, and the metrics a
    user reads are the whole batch's. Evaluation keeps a split of its own: training's is left as it was."""
    from colossal_lite.nn.metric import Accuracy
    from colossal_lite.trainer import Trainer
    from colossal_lite.trainer.hooks import AccuracyHook, LossHook

    x, y = make_batches(1, b=8)[0]
    model = OOMAbove(make_model(), limit=3)
    engine, _ = train(model, dict(gradient_accumulation="auto"), make_batches(2, b=2), launched)
    model.calls.clear()
    engine.eval()
    output, label, loss = engine.execute_schedule(iter([(x, y)]), forward_only=True)
    assert model.calls == [8, 4, 2, 2, 2, 2]  # whole and halves fail; quarters run
    assert (engine.auto_batcher.parts, engine.auto_batcher.eval_parts) == (1, 4)
    with torch.no_grad():
        chunked = torch.cat([model.inner(x[i:i + 2]) for i in range(0, 8, 2)])
        assert torch.equal(output, chunked) and label is y
        assert torch.equal(loss, torch.nn.CrossEntropyLoss()(chunked, y))

    model.calls.clear()
    trainer = Trainer(engine)
    batches = make_batches(3, b=8, seed=5)
    metrics = trainer.evaluate(batches, hooks=[LossHook(), AccuracyHook(Accuracy())])
    assert model.calls == [2] * 12  # every later evaluation batch starts with the split the last one needed
    with torch.no_grad():
        outs = [torch.cat([model.inner(bx[i:i + 2]) for i in range(0, 8, 2)]) for bx, _ in batches]
    correct = sum(int((out.argmax(1) == by).sum()) for out, (_, by) in zip(outs, batches))
    assert metrics["Accuracy"] == pytest.approx(correct / 24, abs=1e-7)
    losses = [float(torch.nn.CrossEntropyLoss()(out, by)) for out, (_, by) in zip(outs, batches)]
    assert metrics["Loss"] == pytest.approx(sum(losses) / 3, rel=1e-6)

    model.limit = 0
    with pytest.raises(torch.OutOfMemoryError, match=r"even micro-batches of 1 sample .*evaluation batch of 8"):
        engine.execute_schedule(iter([(x, y)]), forward_only=True)
    assert engine.auto_batcher.eval_parts == 4  # the next evaluation batch starts where this one did


class OwnLossLM(torch.nn.Module):
    """A language model that computes its own per-token mean loss (as Hugging Face models do); a forward of more
    than ``limit`` sequences runs out of memory."""

    def __init__(self, limit):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head, self.limit = torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11), limit

    def forward(self, input_ids, labels):
        if input_ids.shape[0] > self.limit:
            raise torch.OutOfMemoryError("injected")
        logits = self.head(self.emb(input_ids))
        return {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()),
                "logits": logits}


def test_a_split_evaluation_batch_joins_a_models_own_loss_as_the_reduction_does(launched):
    """A model's own per-token mean loss, evaluated in pieces holding different numbers of real tokens: the loss
    read is the whole batch's token mean (the pieces' means weighed by their tokens), not their plain mean."""
    g = torch.Generator().manual_seed(3)
    ids, labels = torch.randint(0, 11, (4, 6), generator=g), torch.randint(0, 11, (4, 6), generator=g)
    labels[0, 1:] = labels[1, 2:] = -100  # the first half holds 3 real tokens, the second 12
    batch = {"input_ids": ids, "labels": labels}
    losses = []
    for limit in (4, 1):
        launched({})
        model = OwnLossLM(limit)
        engine = colossal_lite.initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.1),
            colossal_lite.engine.ModelLoss(num_tokens=lambda b: (b["labels"] != -100).sum()),
            config=dict(gradient_accumulation="auto", grad_reduction="per-token-mean"), verbose=False)[0]
        engine.eval()
        losses.append(engine.execute_schedule(iter([batch]), forward_only=True)[2])
    assert engine.auto_batcher.eval_parts == 4
    assert losses[1].item() == pytest.approx(losses[0].item(), rel=1e-6)
    model.limit = 4
    with torch.no_grad():
        halves = [model(ids[i:i + 2], labels[i:i + 2])["loss"] for i in (0, 2)]
    assert abs((halves[0] + halves[1]).item() / 2 - losses[0].item()) > 0.01  # a plain mean would be told apart
