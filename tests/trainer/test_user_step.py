"""``Trainer.fit(step=...)``: programs that are not one forward and one backward, under the Trainer, against the
loops they replace, bit for bit (issue 33, "a step of the user's own").

pytorch/examples' DCGAN (two engines, two optimizers, two backward calls before the discriminator's step) and
word_language_model (hidden state carried from batch to batch, clipping) run under ``fit`` with a step of the
user's own; the discriminator alone accumulates gradients (``initialize(..., config=...)``); a two-engine run
stopped inside the discriminator's window resumes exactly. Each on one process here and on two ranks in one
launch (``user_step_programs.py``).
"""
import json
import math
from pathlib import Path

import pytest
import torch
import user_step_programs as programs
import word_language_model_loop as lm
from dist_helpers import run_ranks
from sync_counter import count_syncs
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import colossal_lite
from colossal_lite.trainer import Trainer, UserStep
from colossal_lite.trainer.hooks import BaseHook, LossHook

TESTS = Path(__file__).parents[1]


def _assert_gan_same(result, where):
    assert result["differ"] == {}, f"{where}: tensors differ from the hand loop: {result['differ']}"
    assert result["lib_losses"] == result["hand_losses"], f"{where}: Loss_D / Loss_G differ"
    assert len(result["lib_losses"]) == programs.EPOCHS * programs.BATCHES


def _assert_resumed(result, where):
    assert result["differ"] == {}, f"{where}: the resumed run's tensors differ: {result['differ']}"
    assert result["resumed_losses"] == result["full_losses"], f"{where}: the resumed run's losses differ"
    assert len(result["resumed_losses"]) == programs.EPOCHS * programs.BATCHES - 3


def _assert_lm_same(result, where, hand_evals, world=1):
    assert result["differ"] == {}, f"{where}: tensors differ from the hand loop: {result['differ']}"
    assert result["lib_losses"] == result["hand_losses"], f"{where}: the training losses differ"
    assert len(result["lib_losses"]) == lm.EPOCHS * len(lm.batches(lm.build(0, world)[2]))
    # The validation loss is the same sum, in another order: the hand loop adds Python floats, LossHook sums float32
    # tensors (over ranks too), so it agrees to float32 rounding, not bit for bit.
    expected = [sum(total for total, _ in epoch) / sum(n for _, n in epoch) for epoch in hand_evals]
    assert result["lib_test_loss"] == pytest.approx(expected, rel=1e-6), f"{where}: the validation losses differ"


def test_dcgan_under_fit_with_a_user_step_equals_the_hand_loop():
    _assert_gan_same(programs.compare(rank=0, world=1, d_accumulation=1), "1 process")


def test_the_discriminator_alone_accumulates_and_equals_the_careful_hand_loop():
    result = programs.compare(rank=0, world=1, d_accumulation=2)
    _assert_gan_same(result, "1 process, discriminator accumulating 2")
    plain = programs.compare(rank=0, world=1, d_accumulation=1)
    assert result["lib_losses"] != plain["lib_losses"], "accumulation for the discriminator changed nothing"


def test_a_two_engine_run_resumes_exactly_from_inside_the_discriminators_window(tmp_path):
    _assert_resumed(programs.resume(rank=0, d_accumulation=2, checkpoint_dir=tmp_path / "ck"), "1 process")


def test_word_language_model_under_fit_equals_the_hand_loop():
    result = lm.differences(rank=0, world=1)
    _assert_lm_same(result, "1 process", [[e] for e in result["hand_evals"]])


@pytest.mark.timeout(300)
def test_the_programs_on_two_ranks_equal_their_hand_loops_and_resume_exactly(tmp_path):
    run_ranks(TESTS / "user_step_programs.py", [tmp_path / "result", tmp_path / "ck"], nproc=2, timeout=240)
    results = [json.loads((tmp_path / f"result.rank{rank}").read_text()) for rank in (0, 1)]
    for rank, result in enumerate(results):
        _assert_gan_same(result["gan"], f"rank {rank}")
        _assert_gan_same(result["gan_d_accumulation"], f"rank {rank}, discriminator accumulating 2")
        _assert_resumed(result["resume"], f"rank {rank}")
        _assert_resumed(result["resume_d_zero2"], f"rank {rank}, the discriminator under ZeRO stage 2")
        _assert_lm_same(result["lm"], f"rank {rank}", list(zip(*(r["lm"]["hand_evals"] for r in results))),
                       world=2)
    assert results[0]["gan"]["lib_losses"] != results[1]["gan"]["lib_losses"], "both ranks trained on the same data"


# -- a step that uses the Trainer's engine only ----------------------------------------------------------------
def _classifier():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _batches(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


def _plain_step(trainer, batch):
    engine = trainer.engine
    x, y = batch
    engine.zero_grad()
    output = engine(x)
    loss = engine.criterion(output, y)
    engine.backward(loss)
    engine.step()
    return output, y, loss


def _fit(step, accumulation=1, **kwargs):
    model, optimizer = _classifier()
    engine, *_ = colossal_lite.initialize(model, optimizer, nn.CrossEntropyLoss(), verbose=False,
                                          config=dict(gradient_accumulation=accumulation))
    trainer = Trainer(engine)
    history = trainer.fit(_batches(), epochs=2, test_dataloader=_batches(3, seed=1), step=step,
                          hooks=[LossHook()], log_dir=False, **kwargs)
    return model, trainer, history


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_bare_function_step_equals_the_trainers_own_step(accumulation):
    """Windows (the epoch's last one short), history, the per-step LR record (``after_optimizer_step`` fires) and the
    default evaluation (the Trainer's engine and criterion) are those of a fit without a step of the user's."""
    own, own_trainer, own_history = _fit(None, accumulation)
    user, user_trainer, user_history = _fit(_plain_step, accumulation)
    for (name, a), (_, b) in zip(list(own.state_dict().items()), list(user.state_dict().items())):
        assert torch.equal(a, b), f"{name} differs"
    assert user_history.without_time() == own_history.without_time()
    assert len(user_history["lr"]) == math.ceil(5 / accumulation) * 2
    assert user_trainer.cur_step == own_trainer.cur_step == math.ceil(5 / accumulation) * 2


def test_a_user_step_adds_no_host_device_sync_per_step():
    """The syncs of a run (reading the loss guard at the epoch's end...) do not grow with its steps."""
    def syncs(n):
        engine = _engine(2)
        with count_syncs() as calls:
            Trainer(engine).fit(_batches(n), epochs=1, step=_plain_step, hooks=[LossHook()], log_dir=False)
        return {method: len(where) for method, where in calls.items()}

    assert syncs(4) == syncs(12)


def test_a_forward_after_an_engines_step_leaves_its_window_closed():
    """DCGAN's discriminator judges the generator's output after its own step: that forward opens a micro-batch of
    its window that no backward of it belongs to; the step leaves the window at its start, as the Trainer's own
    step does (a sharded checkpoint refuses an open window; an unsharded one would carry its gradients)."""
    net_g, net_d, opt_g, opt_d = programs.build_gan()
    engine_g, *_ = colossal_lite.initialize(net_g, opt_g, nn.BCELoss(), verbose=False)
    engine_d, *_ = colossal_lite.initialize(net_d, opt_d, nn.BCELoss(), verbose=False)
    seen = []

    class Windows(BaseHook):
        def after_train_iter(self, trainer, *args):
            seen.append((engine_d.window.at_start, engine_g.window.at_start))

    step = UserStep(programs.gan_step(engine_g, engine_d, 1), engines={"generator": engine_g})
    Trainer(engine_d).fit(programs.data(0), epochs=1, step=step, hooks=[Windows()], log_dir=False)
    assert seen == [(True, True)] * programs.BATCHES
    assert "window_grads" not in engine_d.state_dict()


def test_every_engine_of_the_step_is_in_eval_mode_inside_the_evaluate_function():
    net_g, net_d, opt_g, opt_d = programs.build_gan()
    engine_g, *_ = colossal_lite.initialize(net_g, opt_g, nn.BCELoss(), verbose=False)
    engine_d, *_ = colossal_lite.initialize(net_d, opt_d, nn.BCELoss(), verbose=False)
    modes = []

    def evaluate(trainer, batch):
        modes.append((engine_g.training, engine_d.training, net_d.training))
        real, _ = batch
        return engine_d.criterion(engine_d(real), torch.ones(real.shape[0], 1))

    step = UserStep(programs.gan_step(engine_g, engine_d, 1), engines={"discriminator": engine_d}, evaluate=evaluate)
    Trainer(engine_g).fit(programs.data(0), epochs=1, test_dataloader=programs.data(1)[:2], step=step, log_dir=False)
    assert modes == [(False, False, False)] * 2
    assert engine_g.training and engine_d.training and net_d.training


@pytest.mark.parametrize("batch_size, seen, counted", [(3, [2], [2]), (2, [2, 1], [2, 0])])
def test_the_evaluate_function_sees_the_real_rows_of_a_distributed_samplers_share(batch_size, seen, counted):
    """Rank 1 of 2 over 5 samples holds positions 1 and 3 and a repeat of 0: the function sees the two real rows
    (a batch that is all padding it sees whole, since every rank runs the same forwards), and no hook counts the
    repeat, as with the Trainer's own evaluation."""
    engine = _engine()
    g = torch.Generator().manual_seed(1)
    test = TensorDataset(torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g))
    loader = DataLoader(test, batch_size=batch_size, sampler=DistributedSampler(test, num_replicas=2, rank=1,
                                                                                shuffle=False))
    rows, hooked = [], []

    def evaluate(trainer, batch):
        x, y = batch
        rows.append(len(y))
        output = engine(x)
        return output, y, engine.criterion(output, y)

    class Counted(BaseHook):
        def after_test_iter(self, trainer, output, label, loss):
            hooked.append((output.shape[0], label.shape[0], loss.item()))

    def train(trainer, batch):
        loss = engine.criterion(engine(batch[0]), batch[1])
        engine.backward(loss)
        engine.step()
        return loss

    step = UserStep(train, evaluate=evaluate)
    Trainer(engine).fit(_batches(1), epochs=1, test_dataloader=loader, step=step, hooks=[Counted()], log_dir=False)
    assert rows == seen
    assert [(n, n) for n, _, _ in hooked] == [(n, n) for n in counted]
    assert all(loss == 0.0 for n, _, loss in hooked if n == 0)  # a batch of repeats weighs nothing


def test_evaluate_runs_the_user_steps_evaluate_function_as_fits_evaluations_do():
    """``trainer.evaluate(loader, step=...)`` after ``fit(step=...)``: the same function over the same batches gives
    fit's last evaluation's values exactly; a bare function is evaluation's step itself; a UserStep without an
    evaluate function evaluates with the Trainer's engine and criterion, as fit does."""
    engine = _engine()
    calls = []

    def evaluate(trainer, batch):
        calls.append(len(batch[1]))
        x, y = batch
        output = engine(x)
        return output, y, engine.criterion(output, y) * 2  # (not the criterion alone: shows which step ran)

    trainer = Trainer(engine)
    step = UserStep(_plain_step, evaluate=evaluate)
    history = trainer.fit(_batches(), epochs=1, test_dataloader=_batches(3, seed=1), step=step, hooks=[LossHook()],
                          log_dir=False)
    assert calls == [4, 4, 4]
    values = trainer.evaluate(_batches(3, seed=1), hooks=[LossHook()], step=step)
    assert values["Loss"] == history["test/Loss"][-1] and calls == [4] * 6
    assert trainer.evaluate(_batches(3, seed=1), hooks=[LossHook()], step=evaluate) == values and len(calls) == 9
    own = trainer.evaluate(_batches(3, seed=1), hooks=[LossHook()])
    assert own["Loss"] == pytest.approx(values["Loss"] / 2, rel=1e-6) and len(calls) == 9
    assert trainer.evaluate(_batches(3, seed=1), hooks=[LossHook()], step=UserStep(_plain_step)) == own


@pytest.mark.parametrize("nan_on", ["trainers_engine", "other_engine"])
def test_a_non_finite_loss_on_any_engine_of_the_step_raises_before_a_checkpoint_takes_it(tmp_path, nan_on):
    """nonfinite_loss='raise' (the default) raises at the epoch's end or the next save, before the weights the NaN
    made are written: on the Trainer's engine it did, on the step's other engine the fit finished and its last
    checkpoint held NaN weights (found by a probe)."""
    from colossal_lite.engine.loss_guard import NonFiniteLossError
    from colossal_lite.trainer.hooks import SaveCheckpointHook

    main, other = _engine(), _engine()

    def step(trainer, batch):
        x, y = batch
        for engine in (main, other):
            engine.zero_grad()
            loss = engine.criterion(engine(x), y)
            if trainer.state.batch_idx == 4 and (engine is main) == (nan_on == "trainers_engine"):
                loss = loss * float("nan")
            engine.backward(loss)
            engine.step()
        return loss

    with pytest.raises(NonFiniteLossError, match="not finite"):
        Trainer(main).fit(_batches(), epochs=1, step=UserStep(step, engines={"main": main, "other": other}),
                          hooks=[SaveCheckpointHook("1ep", tmp_path / "ck")], log_dir=False)
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").glob("epoch*"))


# -- bad input: the message names the fix -------------------------------------------------------------------------
def _engine(accumulation=1, **config):
    model, optimizer = _classifier()
    engine, *_ = colossal_lite.initialize(model, optimizer, nn.CrossEntropyLoss(), verbose=False,
                                          config=dict(gradient_accumulation=accumulation, **config))
    return engine


def test_a_step_that_returns_something_else_is_refused():
    trainer = Trainer(_engine())
    with pytest.raises(TypeError, match=r"returned a 2-item tuple; return the loss \(a tensor\), \(output, label, "
                                        r"loss\)"):
        trainer.fit(_batches(), epochs=1, step=lambda trainer, batch: (1, 2), log_dir=False)


def test_a_step_that_forgets_engine_step_is_refused():
    def no_step(trainer, batch):
        x, y = batch
        trainer.engine.zero_grad()
        trainer.engine.backward(trainer.engine.criterion(trainer.engine(x), y))

    with pytest.raises(RuntimeError, match=r"did not call step\(\) on it: call engine.step\(\) after "
                                           r"engine.backward\(loss\)"):
        Trainer(_engine()).fit(_batches(), epochs=1, step=no_step, log_dir=False)


def test_hooks_that_act_inside_the_trainers_own_step_are_refused():
    class Inside(BaseHook):
        def after_loss(self, trainer):
            pass

    with pytest.raises(ValueError, match=r"these hooks handle them: Inside.after_loss. Do what they do inside your "
                                         r"step function"):
        Trainer(_engine()).fit(_batches(), epochs=1, step=_plain_step, hooks=[Inside()], log_dir=False)


def test_bad_steps_and_engines_are_refused_with_the_fix():
    engine = _engine()
    with pytest.raises(TypeError, match=r"fit\(step=...\) must be a function \(trainer, batch\) -> loss or a "
                                        r"UserStep"):
        Trainer(engine).fit(_batches(), epochs=1, step=42, log_dir=False)
    with pytest.raises(TypeError, match=r"must be a dict of engines by name, e.g. engines=\{'generator'"):
        UserStep(_plain_step, engines=[engine])
    with pytest.raises(TypeError, match=r"'d' is a Sequential, not an Engine; give the engine colossal_lite.initialize"):
        UserStep(_plain_step, engines={"d": nn.Sequential()})
    with pytest.raises(ValueError, match=r"'b' and 'a' are the same engine; name each engine once"):
        UserStep(_plain_step, engines={"a": engine, "b": engine})
    with pytest.raises(TypeError, match=r"evaluate\(step=...\) must be a function \(trainer, batch\) -> loss or "
                                        r"\(output, label, loss\), or the UserStep given to fit, got int"):
        Trainer(engine).evaluate(_batches(), step=42)


def test_engines_of_different_accumulation_need_a_loader_with_a_length():
    main, other = _engine(1), _engine(2)
    unsized = (batch for batch in _batches())
    with pytest.raises(ValueError, match=r"engine 'other' accumulates 2 micro-batches and the Trainer's engine 1, "
                                         r"but the train_dataloader has no len\(\)"):
        Trainer(main).fit(unsized, max_steps=2, step=UserStep(_plain_step, engines={"other": other}), log_dir=False)


# -- initialize(config=...): one engine's features -----------------------------------------------------------------
def test_each_engine_keeps_the_features_its_initialize_gave_it():
    a = _engine(2, grad_reduction="sum", clip_grad_norm=0.5)
    b = _engine(1, zero=None, fp16=None)  # None: without the launch config's setting
    assert (a.window.size, a.grad_reduction, a.clip_grad_norm) == (2, "sum", 0.5)
    assert (b.window.size, b.grad_reduction, b.clip_grad_norm) == (1, "mean", 0.0)


@pytest.mark.parametrize("config, error, message", [
    (dict(micro_batch_size=4), ValueError, r"'micro_batch_size' is a setting of the whole process, not of one engine; "
                                           r"set it in the config given to launch"),
    (dict(gradient_accumulaton=2), ValueError, r"'gradient_accumulaton' is not an engine feature; did you mean "
                                               r"'gradient_accumulation'\?"),
    (dict(gradient_accumulation=0), Exception, r"^initialize\(config=...\): .*config key 'gradient_accumulation'"),
    ([("gradient_accumulation", 2)], TypeError, r"must be a dict of this engine's features, e.g. "
                                                r"config=dict\(gradient_accumulation=2\)"),
])
def test_a_bad_engine_config_is_refused_with_the_fix(config, error, message):
    model, optimizer = _classifier()
    with pytest.raises(error, match=message):
        colossal_lite.initialize(model, optimizer, nn.CrossEntropyLoss(), verbose=False, config=config)


def test_test_mode_with_a_step_that_returns_no_loss_gives_its_verdict():
    def silent_step(trainer, batch):
        _plain_step(trainer, batch)  # the step runs; the loss is not handed back

    trainer = Trainer(_engine())
    history = trainer.fit(_batches(), epochs=1, step=silent_step, test_mode=True, log_dir=False)
    result = trainer.test_mode_result
    assert history is trainer.history and result.ok and result.train_loss is None
    assert "(train loss not given (the step returned none); optimizer step applied" in result.message
