"""A nan/inf training loss (config ``nonfinite_loss``): 'raise' (default) stops at the next metric read naming the
first step, without a host sync in the step; 'skip' skips that update like the fp16 loss scaler; 'ignore' trains on.

Before, one inf loss turned every parameter into NaN under fp32 and bf16 while steps kept counting, silently.
Also: ``engine.step()`` with no ``engine.backward()`` since the last update says so, once.
"""
import copy
import json
import textwrap

import pytest
import torch
from dist_helpers import run_ranks
from engine_helpers import make_batches, make_model
from sync_counter import count_syncs

import colossal_lite
from colossal_lite.amp import AMP_TYPE
from colossal_lite.engine.loss_guard import NonFiniteLossError, _finite
from colossal_lite.trainer import Trainer, hooks
from colossal_lite.utils import save_checkpoint

BAD = 5  # the index of the batch whose input is inf (its loss is nan)


def poisoned(n=8, bad=BAD):
    batches = make_batches(n)
    x, y = batches[bad]
    batches[bad] = (torch.full_like(x, float("inf")), y)
    return batches


def build(launched, config, batches, lr=0.1):
    launched(config)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    engine, loader, _, _ = colossal_lite.initialize(model, opt, torch.nn.CrossEntropyLoss(), batches, verbose=False)
    return engine, loader


@pytest.mark.parametrize("precision", [None, AMP_TYPE.BF16])
def test_raise_stops_fit_at_the_epoch_end_naming_the_first_step_and_keeps_nan_out_of_checkpoints(
        launched, tmp_path, precision):
    config = {} if precision is None else dict(fp16=dict(mode=precision))
    engine, loader = build(launched, config, poisoned())
    trainer = Trainer(engine)
    saver = hooks.SaveCheckpointHook("1ba", str(tmp_path / "ck"))
    with pytest.raises(NonFiniteLossError, match=rf"not finite \(nan or inf\) in optimizer step {BAD + 1} .*"
                                                 rf"nonfinite_loss = 'skip'"):
        trainer.fit(loader, epochs=2, hooks=[hooks.LossHook(), saver])
    # every checkpoint written holds finite weights: the ones before the bad step, none after it
    steps = sorted(json.loads(p.read_text())["step"] for p in (tmp_path / "ck").glob("*/meta.json"))
    assert steps == list(range(1, BAD + 1))
    last = (tmp_path / "ck" / "last").read_text().strip()
    assert json.loads((tmp_path / "ck" / last / "meta.json").read_text())["step"] == BAD


def test_raise_makes_no_host_sync_in_the_step_and_reports_through_check(launched):
    engine, loader = build(launched, {}, poisoned())
    with count_syncs() as calls:
        for x, y in loader:
            engine.zero_grad()
            engine.backward(engine.criterion(engine(x), y))
            engine.step()
    assert all(not v for v in calls.values()), calls
    assert engine.num_updates == 8  # the nan update went through: 'raise' stops the run, it does not skip
    with pytest.raises(NonFiniteLossError, match=rf"optimizer step {BAD + 1} "):
        engine.check_loss_finite()


def test_raise_keeps_the_last_good_file_of_a_legacy_save_checkpoint_in_a_users_own_loop(launched, tmp_path):
    """An engine loop of its own never reached the guard's check, so ``save_checkpoint`` wrote nan weights over
    the last good file (found by the docs probe). Saved after each epoch as legacy scripts do: the nan epoch's
    save is refused, naming this rank's first bad step, and the file keeps the epoch before's finite weights."""
    engine, loader = build(launched, {}, make_batches(8))
    path = tmp_path / "ck.pt"
    for epoch, batches in enumerate((make_batches(8), poisoned())):
        for x, y in batches:
            engine.zero_grad()
            engine.backward(engine.criterion(engine(x), y))
            engine.step()
        if epoch == 0:
            save_checkpoint(path, epoch, engine.model, engine.optimizer)
            good = path.read_bytes()
    with pytest.raises(NonFiniteLossError, match=rf"save_checkpoint\('{path}'\): the model's 0.weight, 0.bias, "
                                                 rf"2.weight and 1 more hold nan or inf; this rank's training loss "
                                                 rf"was first not finite in optimizer step {8 + BAD + 1}, so nothing"):
        save_checkpoint(path, 1, engine.model, engine.optimizer)
    assert path.read_bytes() == good
    weights = torch.load(path, weights_only=True)["model"]
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_ignore_saves_what_it_trained(launched, tmp_path):
    engine, loader = build(launched, dict(nonfinite_loss="ignore"), poisoned())
    for x, y in loader:
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        engine.step()
    save_checkpoint(tmp_path / "ck.pt", 0, engine.model, engine.optimizer)
    assert not all(torch.isfinite(t).all() for t in torch.load(tmp_path / "ck.pt")["model"].values())


def test_a_run_with_finite_losses_passes_the_check_and_the_count_continues_after_a_resume(launched):
    engine, loader = build(launched, {}, make_batches(4))
    for x, y in loader:
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        engine.step()
    engine.check_loss_finite()
    state = copy.deepcopy(engine.state_dict())
    engine2, loader2 = build(launched, {}, poisoned(4, bad=2))
    engine2.load_state_dict(state)  # resumed at step 4: the third batch after it is step 7
    for x, y in loader2:
        engine2.zero_grad()
        engine2.backward(engine2.criterion(engine2(x), y))
        engine2.step()
    with pytest.raises(NonFiniteLossError, match=r"optimizer step 7 "):
        engine2.check_loss_finite()


@pytest.mark.parametrize("accumulation", [1, 2])
def test_skip_skips_exactly_the_update_with_the_nan_loss_like_a_hand_written_loop(launched, capsys, accumulation):
    batches = poisoned()
    engine, loader = build(launched, dict(nonfinite_loss="skip", gradient_accumulation=accumulation), batches)
    trainer = Trainer(engine)
    trainer.fit(loader, epochs=1, hooks=[hooks.LossHook()])
    windows = [batches[i:i + accumulation] for i in range(0, len(batches), accumulation)]
    assert engine.num_updates == len(windows) - 1
    assert "a loss of optimizer step" in capsys.readouterr().out
    # the hand-written loop that leaves out the window holding the bad batch
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for window in windows:
        if any(not torch.isfinite(x).all() for x, _ in window):
            continue
        opt.zero_grad()
        for x, y in window:
            (torch.nn.functional.cross_entropy(model(x), y) / len(window)).backward()
        opt.step()
    for mine, ref in zip(engine.unwrapped_model.parameters(), model.parameters()):
        torch.testing.assert_close(mine, ref)


def test_ignore_trains_on_as_before(launched):
    engine, loader = build(launched, dict(nonfinite_loss="ignore"), poisoned())
    Trainer(engine).fit(loader, epochs=1, hooks=[hooks.LossHook()])
    assert engine.num_updates == 8
    assert not all(torch.isfinite(p).all() for p in engine.unwrapped_model.parameters())


def test_the_step_is_exact_within_the_ring_and_said_to_be_an_upper_bound_beyond_it():
    from colossal_lite.engine.loss_guard import RaiseOnNonFinite

    def run(ring_size, losses_per_update, bad):
        guard = RaiseOnNonFinite(ring_size=ring_size)
        guard.start_counting_at(10)
        for update in range(losses_per_update):
            for micro in range(2):
                k = update * 2 + micro
                guard.watch(torch.tensor(float("nan") if k == bad else 1.0))
            guard.end_window()
        with pytest.raises(NonFiniteLossError) as err:
            guard.check()
        return str(err.value)

    assert "in optimizer step 13 (" in run(ring_size=64, losses_per_update=8, bad=5)  # micro-step 5: update 3
    # ring of 4 micro-steps, 16 watched: the bad one fell out of the ring; the oldest kept is named as a bound
    assert "in optimizer step 17 or earlier (" in run(ring_size=4, losses_per_update=8, bad=5)
    guard = RaiseOnNonFinite(ring_size=4)
    for _ in range(9):
        guard.watch(torch.tensor(2.0))
    guard.check()  # all finite, after the ring wrapped: no error


def test_fp16_loss_scaling_skips_such_updates_itself():
    from colossal_lite.amp.precision import NaiveAMPPrecision
    from colossal_lite.engine.loss_guard import IgnoreNonFinite, build_loss_guard

    assert type(build_loss_guard("raise", NaiveAMPPrecision())) is IgnoreNonFinite
    with pytest.raises(ValueError, match=r"nonfinite_loss must be one of \('raise', 'skip', 'ignore'\), got 'stop'"):
        build_loss_guard("stop", None)


def test_step_without_engine_backward_says_so_once(launched, capsys):
    engine, loader = build(launched, {}, make_batches(3))
    before = [p.detach().clone() for p in engine.unwrapped_model.parameters()]
    for x, y in loader:
        engine.zero_grad()
        loss = engine.criterion(engine(x), y)
        loss.backward()  # the mistake: the engine never sees this backward
        assert engine.step() is False
    out = capsys.readouterr().out
    assert out.count("engine.step() was called with no engine.backward(loss) since the last update") == 1
    assert all(torch.equal(a, b) for a, b in zip(before, engine.unwrapped_model.parameters()))


def test_accumulation_micro_steps_do_not_warn(launched, capsys):
    engine, loader = build(launched, dict(gradient_accumulation=2), make_batches(4))
    for x, y in loader:
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        engine.step()
    assert engine.num_updates == 2
    assert "engine.step() was called" not in capsys.readouterr().out


TWO_RANKS = textwrap.dedent('''
    import json, sys
    import torch
    import colossal_lite
    from colossal_lite.core import global_context as gpc
    from colossal_lite.engine.loss_guard import NonFiniteLossError
    from colossal_lite.trainer import Trainer, hooks

    def run(mode, out):
        colossal_lite.launch_from_torch(config=dict(nonfinite_loss=mode), verbose=False)
        rank = gpc.get_global_rank()
        g = torch.Generator().manual_seed(rank)
        batches = [(torch.randn(4, 6, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(6)]
        if rank == 1:  # only rank 1 sees the bad batch, at its fourth step
            batches[3] = (torch.full((4, 6), float("nan")), batches[3][1])
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        engine, loader, _, _ = colossal_lite.initialize(model, opt, torch.nn.CrossEntropyLoss(), batches, verbose=False)
        result = {}
        try:
            Trainer(engine).fit(loader, epochs=1, hooks=[hooks.LossHook()])
        except NonFiniteLossError as err:
            result["error"] = str(err)
        result["updates"] = engine.num_updates
        result["finite"] = all(bool(torch.isfinite(p).all()) for p in engine.unwrapped_model.parameters())
        with open(f"{out}/rank{rank}.json", "w") as f:
            json.dump(result, f)
        gpc.destroy()

    for mode in sys.argv[2:]:  # one launch, the process group made anew for each mode
        run(mode, f"{sys.argv[1]}/{mode}")
''')


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    """Both modes trained in one two-rank launch; ``{mode: [rank 0's result, rank 1's]}``."""
    out = tmp_path_factory.mktemp("nan_two_ranks")
    modes = ["raise", "skip"]
    for mode in modes:
        (out / mode).mkdir()
    script = out / "nan_two_ranks.py"
    script.write_text(TWO_RANKS)
    run_ranks(script, [out, *modes], nproc=2, timeout=180)
    return {mode: [json.loads((out / mode / f"rank{r}.json").read_text()) for r in (0, 1)] for mode in modes}


@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_two_ranks_agree_when_only_one_saw_a_nan_loss(two_rank_results, mode):
    results = two_rank_results[mode]
    if mode == "raise":
        assert all("in optimizer step 4 " in r.get("error", "") for r in results), results
    else:
        assert all("error" not in r and r["updates"] == 5 and r["finite"] for r in results), results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_weights_check_reads_nan_and_inf_anywhere_from_two_numbers(dtype):
    """``check_weights`` reads a tensor's minimum and maximum (nan spreads to both) instead of an ``isfinite`` mask
    as large as the tensor (the memory probe: 28 MiB of temporaries for a 32 MiB state, on its device)."""
    for where in (0, 517, 999):
        for bad in (float("nan"), float("inf"), -float("inf")):
            weights = torch.randn(1000).to(dtype)
            weights[where] = bad
            assert not _finite(weights), (where, bad)
    assert _finite(torch.randn(1000).to(dtype)) and _finite(torch.empty(0, dtype=dtype))
