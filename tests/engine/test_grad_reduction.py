"""grad_reduction: 'sum' and 'per-token-mean' (padded token losses) across micro-batches."""
import pytest
import torch

import colossal_lite

VOCAB, PAD = 7, -100


def token_batches():
    """Micro-batches of padded sequences with very different numbers of real tokens."""
    g = torch.Generator().manual_seed(3)
    batches = []
    for lengths in ([5, 1], [2, 2], [6, 3]):
        x = torch.randn(len(lengths), 6, 4, generator=g)
        y = torch.randint(0, VOCAB, (len(lengths), 6), generator=g)
        for i, n in enumerate(lengths):
            y[i, n:] = PAD
        batches.append((x, y))
    return batches


def token_loss(logits, target):
    """Sum of per-token losses and the count of real (non-pad) tokens."""
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=PAD,
                                             reduction="sum")
    return loss, (target != PAD).sum()


def build():
    torch.manual_seed(0)
    return torch.nn.Linear(4, VOCAB)


def test_per_token_mean_equals_the_mean_over_all_real_tokens(launched):
    batches = token_batches()
    launched(dict(gradient_accumulation=3, grad_reduction="per-token-mean"))
    model = build()
    engine, *_ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5), token_loss, verbose=False)
    for i, (x, y) in enumerate(batches):  # one micro-batch per step() call, as legacy counted
        engine.zero_grad()
        loss = engine.criterion(engine(x), y)  # the per-token mean of this micro-batch
        engine.backward(loss)
        assert engine.step() is (i == 2)
    # by hand: one mean over every real token of the three micro-batches
    ref = build()
    logits = torch.cat([ref(x).reshape(-1, VOCAB) for x, _ in batches])
    target = torch.cat([y.reshape(-1) for _, y in batches])
    torch.nn.functional.cross_entropy(logits, target, ignore_index=PAD).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.5 * p.grad
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    # and it differs from the mean of per-micro-batch means (the padding really matters here)
    naive = build()
    sum(torch.nn.functional.cross_entropy(naive(x).reshape(-1, VOCAB), y.reshape(-1), ignore_index=PAD)
        for x, y in batches).div(3).backward()
    assert not torch.allclose(naive.weight.grad, ref.weight.grad, atol=1e-4)


def test_per_token_mean_without_a_count_is_a_clear_error(launched):
    launched(dict(grad_reduction="per-token-mean"))
    model = build()
    engine, *_ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5),
                                          lambda out, y: out.sum(), verbose=False)
    with pytest.raises(RuntimeError, match="needs each micro-batch's real-token count"):
        engine.backward(engine.criterion(engine(torch.randn(2, 4)), None))


def test_sum_reduction_adds_micro_batch_gradients(launched):
    batches = token_batches()
    launched(dict(gradient_accumulation=3, grad_reduction="sum"))
    model = build()
    engine, *_ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                          lambda o, y: token_loss(o, y)[0], verbose=False)
    for x, y in batches:
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        engine.step()
    ref = build()
    sum(token_loss(ref(x), y)[0] for x, y in batches).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


def test_token_count_does_not_outlive_an_abandoned_window_and_survives_a_resume(launched):
    batches = token_batches()
    launched(dict(gradient_accumulation=2, grad_reduction="per-token-mean"))

    def build_engine():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, VOCAB)
        engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5), token_loss,
                                                        batches, verbose=False)
        return engine, loader

    engine, loader = build_engine()
    for x, y in loader:  # break inside the first window
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        break
    abandoned = engine.reduction.tokens
    assert abandoned is not None
    with pytest.warns(UserWarning, match="stopped inside a window, after 1 of its 2 micro-batches"):
        x, y = next(iter(loader))  # a new epoch starts: the open window (and its tokens) is dropped
    engine.zero_grad()
    loss = engine.criterion(engine(x), y)
    counted = engine.reduction._micro_tokens
    engine.backward(loss)
    assert torch.equal(engine.reduction.tokens, counted) and engine.window.micro_step == 1

    # a state taken mid-window carries the token count, so the resumed update divides by all tokens
    full, _ = build_engine()
    half, _ = build_engine()
    for eng, part in ((full, batches[:2]), (half, batches[:1])):
        for x, y in part:
            eng.zero_grad()
            eng.backward(eng.criterion(eng(x), y))
            eng.step()
    resumed, _ = build_engine()
    resumed.load_state_dict(half.state_dict())
    x, y = batches[1]
    resumed.backward(resumed.criterion(resumed(x), y))
    assert resumed.step() is True
    for p, q in zip(resumed.model.parameters(), full.model.parameters()):
        torch.testing.assert_close(p, q)


RANK_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, {here!r})
import colossal_lite
from colossal_lite.core import global_context as gpc
from test_grad_reduction import VOCAB, token_batches, token_loss
colossal_lite.launch_from_torch(config=dict(gradient_accumulation=2, grad_reduction="per-token-mean"), verbose=False)
rank = gpc.get_global_rank()
torch.manual_seed(0)
model = torch.nn.Linear(4, VOCAB)
engine, *_ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5), token_loss, verbose=False)
batches = token_batches()
mine = [batches[0], batches[1]] if rank == 0 else [batches[2], batches[2]]  # very different token counts per rank
for x, y in mine:
    engine.zero_grad()
    engine.backward(engine.criterion(engine(x), y))
    engine.step()
json.dump([p.tolist() for p in engine.unwrapped_model.parameters()], open({out!r} + str(rank), "w"))
gpc.destroy()
"""


@pytest.mark.slow  # (its ranks import this module, so run_ranks is imported here, out of the slow rule's sight)
def test_per_token_mean_across_two_ranks(tmp_path):
    """Two ranks with different real-token counts: the update is the mean over all tokens of both ranks."""
    import json
    from pathlib import Path

    from dist_helpers import run_ranks

    script = tmp_path / "tokens_rank.py"
    script.write_text(RANK_SCRIPT.format(here=str(Path(__file__).parent), out=str(tmp_path / "r")))
    run_ranks(script, nproc=2, timeout=180)
    batches = token_batches()
    ref = build()
    everything = [batches[0], batches[1], batches[2], batches[2]]
    logits = torch.cat([ref(x).reshape(-1, VOCAB) for x, _ in everything])
    target = torch.cat([y.reshape(-1) for _, y in everything])
    torch.nn.functional.cross_entropy(logits, target, ignore_index=PAD).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.5 * p.grad
    for rank in (0, 1):
        got = json.loads((tmp_path / f"r{rank}").read_text())
        for p, q in zip(got, ref.parameters()):
            torch.testing.assert_close(torch.tensor(p), q.detach())


@pytest.mark.parametrize("own_loss", [False, True], ids=["criterion-pair", "models-own-loss"])
def test_the_loss_a_user_reads_under_per_token_mean_is_the_per_token_loss(launched, own_loss):
    """LossHook weighed each batch's per-token mean by its samples: the epoch's Loss was not the per-token loss of
    the set, and an evaluation on 2 ranks read other figures than on 1 (the batches split otherwise). Each loss is
    weighed by its real tokens now, counted on the device (no host read per step: the syncs of a fit do not grow
    with its steps)."""
    from sync_counter import count_syncs

    from colossal_lite.engine import ModelLoss
    from colossal_lite.trainer import Trainer
    from colossal_lite.trainer.hooks import LossHook

    class OwnTokenLoss(torch.nn.Module):  # a Hugging Face style model: its own per-token mean loss
        def __init__(self):
            super().__init__()
            self.inner = build()

        def forward(self, x, y):
            loss_sum, tokens = token_loss(self.inner(x), y)
            return {"loss": loss_sum / tokens, "logits": self.inner(x)}

    batches = token_batches()
    data = [dict(x=x, y=y) for x, y in batches] if own_loss else batches
    launched(dict(grad_reduction="per-token-mean"))

    def fit(steps):
        model = OwnTokenLoss() if own_loss else build()
        criterion = ModelLoss(num_tokens=lambda b: (b["y"] != PAD).sum()) if own_loss else token_loss
        engine, *_ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.0), criterion,
                                              data_process_func=(lambda b: (b, b["y"])) if own_loss else None,
                                              verbose=False)
        trainer = Trainer(engine)
        with count_syncs() as calls:
            trainer.fit(data * steps, epochs=1, test_dataloader=data, hooks=[LossHook()], log_dir=False)
        return trainer, {method: len(where) for method, where in calls.items()}

    trainer, syncs = fit(1)
    with torch.no_grad():  # lr 0: the model is the initial one throughout, for training and evaluation alike
        sums, tokens = zip(*(token_loss(build()(x), y) for x, y in batches))
    per_token = (sum(sums) / sum(tokens)).item()
    per_sample = sum(s / t * len(y) for s, t, (_, y) in zip(sums, tokens, batches)).item() / 7
    assert abs(per_token - per_sample) > 1e-3  # (the two weighings are told apart on these batches)
    assert trainer.history["train/Loss"][-1] == pytest.approx(per_token, rel=1e-6)
    assert trainer.history["test/Loss"][-1] == pytest.approx(per_token, rel=1e-6)
    assert fit(3)[1] == syncs


def test_a_micro_batch_with_no_real_token_weighs_nothing_and_is_not_a_non_finite_loss(launched):
    """A model's own per-token mean over a micro-batch whose labels are all padding (a one-token document) is 0/0,
    NaN: the loss guard raised NonFiniteLossError although the update was finite, and the Loss a user reads was NaN
    (found by a probe). Such a micro-batch weighs nothing: its loss is 0, the gradients those of the others."""
    from colossal_lite.engine import ModelLoss
    from colossal_lite.trainer import Trainer
    from colossal_lite.trainer.hooks import LossHook

    class OwnTokenLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = build()

        def forward(self, x, y):
            logits = self.inner(x)
            return {"loss": torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1),
                                                            ignore_index=PAD), "logits": logits}

    batches = token_batches()
    batches[1][1][:] = PAD  # the second micro-batch has no real token
    launched(dict(gradient_accumulation=3, grad_reduction="per-token-mean"))
    model = OwnTokenLoss()
    engine, *_ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5),
                                          ModelLoss(num_tokens=lambda b: (b["y"] != PAD).sum()),
                                          data_process_func=lambda b: (b, b["y"]), verbose=False)
    history = Trainer(engine).fit([dict(x=x, y=y) for x, y in batches], epochs=1, hooks=[LossHook()], log_dir=False)
    ref = build()  # by hand: one mean over every real token of the window
    logits = torch.cat([ref(x).reshape(-1, VOCAB) for x, _ in batches])
    target = torch.cat([y.reshape(-1) for _, y in batches])
    loss = torch.nn.functional.cross_entropy(logits, target, ignore_index=PAD)
    loss.backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.5 * p.grad
    # not bitwise: the reference takes one mean over the window's tokens, the engine adds each micro-batch's token
    # sum and divides by the window's count at the step (another order of the same float additions)
    for p, q in zip(model.inner.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    assert history["train/Loss"][-1] == pytest.approx(loss.item(), rel=1e-6)


@pytest.mark.parametrize("mode", ["TORCH", "NAIVE"])
def test_per_token_mean_under_fp16_loss_scaling_skips_no_more_updates_than_a_loop_dividing_first(launched, mode):
    """Each backward starts from its micro-batch's token count (the window's global count is known only at the
    step): with 600 tokens a micro-batch, the gradients were 600 times a per-token mean's, times the loss scale,
    and fp16 overflowed on the windows until the scale had halved about ten times (2 or 3 of 10 updates applied,
    where the loop a Hugging Face user writes, dividing each loss by the window's token count before its backward, applies
    all 10). The count is now weighed by a power of two near 1 / the last window's tokens per rank: only the first
    window, whose count nobody knows yet, can overflow."""
    from colossal_lite.amp import AMP_TYPE

    g = torch.Generator().manual_seed(5)
    windows = []
    for _ in range(10):
        window = []
        for _ in range(2):
            x = torch.randn(4, 150, 4, generator=g)
            y = torch.randint(0, VOCAB, (4, 150), generator=g)
            window.append((x, y))
        windows.append(window)
    launched(dict(gradient_accumulation=2, grad_reduction="per-token-mean",
                  fp16=dict(mode=getattr(AMP_TYPE, mode))))
    model = build()
    engine, *_ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.01), token_loss,
                                          verbose=False)
    for window in windows:
        for x, y in window:
            engine.zero_grad()
            engine.backward(engine.criterion(engine(x), y))
            engine.step()
    # the hand loop: fp16 autocast, a GradScaler with the same initial scale, each loss divided by the window's count
    ref = build()
    optimizer = torch.optim.SGD(ref.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    applied = 0
    for window in windows:
        count = sum((y != PAD).sum() for _, y in window)
        for x, y in window:
            with torch.autocast("cpu", dtype=torch.float16):
                loss_sum, _ = token_loss(ref(x), y)
            scaler.scale(loss_sum / count).backward()
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        applied += scaler.get_scale() >= scale
        optimizer.zero_grad(set_to_none=True)
    assert applied == 10
    assert engine.num_updates == 9  # the first window overflows: its unit is 1
