"""Trainer.fit / evaluate / predict: loop order, events, equivalence with the engine loop, intervals, test mode."""
import copy
import re

import pytest
import torch
from torch import nn

from colossal_lite.amp.precision import BF16Precision
from colossal_lite.engine.accumulation import AccumulationDataLoader, AccumulationWindow
from colossal_lite.engine.engine import Engine
from colossal_lite.trainer import Event, State, TestModeFailed, Trainer
from colossal_lite.trainer.hooks import BaseHook, LossHook


def make_batches(n, batch_size=4, features=6, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch_size, features, generator=g), torch.randint(0, classes, (batch_size,), generator=g))
            for _ in range(n)]


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def make_engine(model, accumulation=1, lr=0.1, momentum=0.9, precision=None):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    window = AccumulationWindow(accumulation)
    return Engine(model, opt, nn.CrossEntropyLoss(), window=window, precision=precision), window


class Recorder(BaseHook):
    """Records the name of every event it receives (it handles them all)."""

    def __init__(self):
        super().__init__()
        self.calls = []


def _recording(name):
    def handler(self, trainer, *args):
        self.calls.append(name)

    return handler


for _event in Event:
    setattr(Recorder, _event.value, _recording(_event.value))


def train_iter(zero_grad: bool, step: bool):
    names = ["before_train_iter"]
    if zero_grad:
        names.append("before_zero_grad")
    names += ["after_batch_loaded", "before_forward", "after_forward", "after_loss", "before_backward",
              "after_backward"]
    if step:
        names += ["after_grad_norm", "before_optimizer_step", "after_optimizer_step"]
    names.append("after_train_iter")
    return names


def test_event_order_with_accumulation_and_evaluation():
    model = make_model()
    engine, window = make_engine(model, accumulation=2)
    train = AccumulationDataLoader(make_batches(3), window)  # windows [b0, b1] and a partial [b2]
    test = make_batches(2, seed=1)
    rec = Recorder()
    Trainer(engine).fit(train, epochs=2, test_dataloader=test, hooks=[rec])

    evaluation = (["before_test", "before_test_epoch"] + ["before_test_iter", "after_test_iter"] * 2
                  + ["after_test_epoch", "after_test"])
    epoch = (["before_train_epoch"] + train_iter(True, False) + train_iter(False, True) + train_iter(True, True)
             + ["after_train_epoch"] + evaluation)
    assert rec.calls == ["after_hook_is_attached", "before_train"] + epoch + epoch + ["after_train", "after_hook_is_detached"]


def test_step_and_iteration_counters_respect_accumulation():
    model = make_model()
    engine, window = make_engine(model, accumulation=2)
    train = AccumulationDataLoader(make_batches(5), window)
    seen = []

    class Watch(BaseHook):
        def after_train_iter(self, trainer, output, label, loss):
            st = trainer.state
            seen.append((st.batch_idx, st.step, st.stepped, st.updated))

    trainer = Trainer(engine)
    trainer.fit(train, epochs=2, hooks=[Watch()])
    assert trainer.steps_per_epoch == 3  # ceil(5 / 2)
    assert trainer.cur_step == 6 == engine.num_updates
    assert trainer.cur_epoch == 2 and trainer.max_epochs == 2
    assert trainer.state.iteration == 10
    # (micro-batches done in the epoch, optimizer steps done, this iteration stepped, parameters changed)
    assert seen[:5] == [(1, 0, False, False), (2, 1, True, True), (3, 1, False, False), (4, 2, True, True),
                        (5, 3, True, True)]


def engine_loop(model, batches, epochs, accumulation, precision=None):
    engine, window = make_engine(model, accumulation, precision=precision)
    loader = AccumulationDataLoader(batches, window)
    for _ in range(epochs):
        it = iter(loader)
        for _ in range(len(loader)):
            engine.zero_grad()
            engine.execute_schedule(it)
            engine.step()
    return engine


def test_fit_equals_engine_loop_with_partial_window():
    batches = make_batches(5)
    ref_model = make_model()
    model = copy.deepcopy(ref_model)
    ref = engine_loop(ref_model, batches, epochs=3, accumulation=2)

    engine, window = make_engine(model, accumulation=2)
    Trainer(engine).fit(AccumulationDataLoader(batches, window), epochs=3, hooks=[LossHook()])
    assert engine.num_updates == ref.num_updates == 9
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


def test_fit_equals_engine_loop_under_bf16_autocast():
    """With autocast the Trainer calls the engine's own forward and criterion (not the bare model), as the loop does."""
    batches = make_batches(5)
    ref_model = make_model()
    model = copy.deepcopy(ref_model)
    ref = engine_loop(ref_model, batches, epochs=2, accumulation=2, precision=BF16Precision("cpu"))

    engine, window = make_engine(model, accumulation=2, precision=BF16Precision("cpu"))
    outputs = []

    class Watch(BaseHook):
        def after_train_iter(self, trainer, output, label, loss):
            outputs.append(output.dtype)

    Trainer(engine).fit(AccumulationDataLoader(batches, window), epochs=2, hooks=[Watch()])
    assert outputs and set(outputs) == {torch.bfloat16}  # the forward ran under autocast
    assert engine.num_updates == ref.num_updates == 6
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


def test_the_engine_always_calls_its_parts_so_a_users_own_precision_and_strategy_are_never_skipped():
    from colossal_lite.amp.precision import FP32Precision
    from colossal_lite.engine.strategy import SingleProcess

    calls = []

    class CountingPrecision(FP32Precision):  # fp32 arithmetic, like the do-nothing part it extends
        def autocast(self):
            calls.append("autocast")
            return super().autocast()

        def backward(self, loss, weight=None):
            calls.append("backward")
            super().backward(loss, weight)

        def step(self, optimizer):
            calls.append("step")
            super().step(optimizer)

    class CountingStrategy(SingleProcess):
        def set_gradient_sync(self, model, sync):
            calls.append(f"sync={sync}")

        def reduce_gradients(self, model):
            calls.append("reduce")

        def clip_grad_norm_(self, parameters, max_norm):
            calls.append("clip")
            return super().clip_grad_norm_(parameters, max_norm)

    batches = make_batches(4)
    model = make_model()
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                    precision=CountingPrecision(), strategy=CountingStrategy(), window=AccumulationWindow(2),
                    clip_grad_norm=1.0)
    Trainer(engine).fit(AccumulationDataLoader(batches, engine.window), epochs=1)
    # Sync is decided before each forward (where DDP reads it) and again at the backward (where FSDP2 reads it):
    # off for the window's first micro-batch, back on after its backward, on for the last; forward and criterion
    # under autocast.
    window = ["sync=False", "autocast", "autocast", "sync=False", "backward", "sync=True",
              "sync=True", "autocast", "autocast", "sync=True", "backward", "reduce", "clip", "step"]
    assert calls == window * 2

    x, y = batches[0]
    bf16, _ = make_engine(make_model(), precision=BF16Precision("cpu"))
    assert bf16(x).dtype == torch.bfloat16
    model = make_model()
    bare = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1))  # no criterion: the clear error stays
    with pytest.raises(RuntimeError, match="initialize\\(\\) got no criterion"):
        bare.criterion(bare(x), y)


def test_hooks_sorted_by_priority_ties_keep_order_and_list_untouched():
    order = []

    class Tagged(BaseHook):
        def __init__(self, tag, priority):
            super().__init__(priority)
            self.tag = tag

        def before_train(self, trainer):
            order.append(self.tag)

    hooks = [Tagged("a5", 5), Tagged("b1", 1), Tagged("c5", 5), Tagged("d0", 0), Tagged("e1", 1)]
    original = list(hooks)
    engine, _ = make_engine(make_model())
    trainer = Trainer(engine)
    trainer.fit(make_batches(1), epochs=1, hooks=hooks)
    assert order == ["d0", "b1", "e1", "a5", "c5"]
    assert hooks == original  # the user's list is not sorted in place
    assert [h.tag for h in trainer.hooks] == order


def test_subclass_without_super_init_still_works():
    class Forgetful(BaseHook):
        def __init__(self, note):  # no super().__init__()
            self.note = note
            self.epochs = 0

        def after_train_epoch(self, trainer):
            self.epochs += 1

    hook = Forgetful("x")
    engine, _ = make_engine(make_model())
    Trainer(engine).fit(make_batches(2), epochs=2, hooks=[hook, LossHook()])
    assert hook.priority == 10 and hook.epochs == 2


def test_skipped_events_are_not_called_and_are_read_at_each_fit():
    class Partial(Recorder):
        def __init__(self, skip):
            super().__init__()
            self.skip = skip

        @property
        def skipped_events(self):
            return self.skip

    hook = Partial(("after_train_iter", "before_forward"))
    engine, _ = make_engine(make_model())
    trainer = Trainer(engine)
    trainer.fit(make_batches(2), epochs=1, hooks=[hook])
    assert "before_train_iter" in hook.calls and "after_train_iter" not in hook.calls
    assert "before_forward" not in hook.calls
    hook.calls.clear()
    hook.skip = ()
    trainer.fit(make_batches(2), epochs=2, hooks=[hook])
    assert hook.calls.count("after_train_iter") == 2 and hook.calls.count("before_forward") == 2


def test_bad_hooks_get_clear_errors():
    engine, _ = make_engine(make_model())
    trainer = Trainer(engine)
    with pytest.raises(TypeError, match=r"hooks\[1\] is a str, not a hook: subclass colossal_lite.trainer.hooks.BaseHook"):
        trainer.fit(make_batches(1), epochs=1, hooks=[LossHook(), "LossHook"])
    with pytest.raises(TypeError, match="must be a number"):
        LossHook(priority="high")


def test_hooks_replacing_batch_and_loss_change_training_as_computed_by_hand():
    batches = make_batches(3)
    ref_model = make_model()
    model = copy.deepcopy(ref_model)

    class DoubleInputs(BaseHook):
        def after_batch_loaded(self, trainer):
            x, y = trainer.state.batch
            trainer.state.batch = (x * 2, y)  # the trainer splits the new batch again

    class TripleLoss(BaseHook):
        def after_loss(self, trainer):
            trainer.state.loss = trainer.state.loss * 3

    seen_losses = []

    class Watch(BaseHook):
        def after_train_iter(self, trainer, output, label, loss):
            seen_losses.append(loss.detach().clone())

    engine, _ = make_engine(model)
    Trainer(engine).fit(batches, epochs=1, hooks=[DoubleInputs(), TripleLoss(), Watch()])

    opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    expected_losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = 3 * nn.functional.cross_entropy(ref_model(2 * x), y)
        loss.backward()
        opt.step()
        expected_losses.append(loss.detach())
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(torch.stack(seen_losses), torch.stack(expected_losses))


def test_an_iterations_outputs_loss_and_graph_are_freed_before_the_next_forward():
    """The last iteration's output and loss (and so its autograd graph) are let go when it ends, not kept
    alive through the next forward, where freeing the old graph would fall among that step's allocations."""
    import weakref

    seen = []

    class Watch(BaseHook):
        def after_train_iter(self, trainer, output, label, loss):
            assert trainer.state.output is output and trainer.state.loss is loss  # still set for the hooks
            self.refs = (weakref.ref(output), weakref.ref(loss))  # (the graph is only reachable through them)

        def before_forward(self, trainer):
            if hasattr(self, "refs"):
                seen.append([ref() is None for ref in self.refs])
                seen.append([trainer.state.output is None, trainer.state.loss is None])

    engine, _ = make_engine(make_model(), accumulation=2)
    Trainer(engine).fit(make_batches(5), epochs=1, hooks=[LossHook(), Watch()])
    assert len(seen) == 8 and all(all(flags) for flags in seen), seen


def test_grad_norm_event_receives_the_norm_and_engine_is_restored():
    norms = []

    class Norms(BaseHook):
        def after_grad_norm(self, trainer, grad_norm):
            norms.append(grad_norm.clone())

    model = make_model()
    engine, _ = make_engine(model)
    Trainer(engine).fit(make_batches(2), epochs=1, hooks=[Norms()])
    assert len(norms) == 2 and all(n > 0 for n in norms)
    x, y = make_batches(1)[0]  # the engine alone, after fit, measures no norm: nothing of the run is left on it
    engine.zero_grad()
    engine.backward(engine.criterion(engine(x), y))
    engine.grad_norm = None
    assert engine.step() and engine.grad_norm is None and len(norms) == 2


def recorder_steps(event_name):
    class StepsAt(BaseHook):
        def __init__(self):
            self.at = []

    def handler(self, trainer, *args):
        self.at.append((trainer.cur_epoch, trainer.cur_step))

    setattr(StepsAt, event_name, handler)
    return StepsAt()


def test_evaluation_schedule_epoch_interval_and_final_epoch():
    engine, _ = make_engine(make_model())
    hook = recorder_steps("before_test")
    # interval 2 over 3 epochs of 2 steps: after epochs 2 and 3 (the last), never before training
    Trainer(engine).fit(make_batches(2), epochs=3, test_dataloader=make_batches(1), test_interval=2, hooks=[hook])
    assert hook.at == [(1, 4), (2, 6)]


@pytest.mark.parametrize("interval, expected_steps", [("2ba", [2, 4, 6, 8]), ("0.5dur", [4, 8]), ("2ep", [8]),
                                                      (1, [4, 8])])
def test_time_string_test_intervals(interval, expected_steps):
    engine, _ = make_engine(make_model())
    hook = recorder_steps("before_test")
    Trainer(engine).fit(make_batches(4), epochs=2, test_dataloader=make_batches(1), test_interval=interval,
                        hooks=[hook])
    assert [step for _, step in hook.at] == expected_steps


def test_max_duration_in_steps_stops_mid_epoch_and_next_fit_continues():
    engine, _ = make_engine(make_model())
    trainer = Trainer(engine)
    hook = recorder_steps("before_test")
    trainer.fit(make_batches(4), max_duration="6ba", test_dataloader=make_batches(1), hooks=[hook])
    assert (trainer.cur_step, trainer.max_steps, trainer.max_epochs) == (6, 6, 2)
    assert (trainer.cur_epoch, trainer.state.batch_idx) == (1, 2)  # epoch 1 was cut short at its 2nd batch
    assert hook.at == [(0, 4), (1, 6)]  # after epoch 0, and at the end of training
    trainer.fit(make_batches(4), epochs=2)  # finishes epoch 1 only
    assert (trainer.cur_step, trainer.cur_epoch, trainer.state.batch_idx) == (8, 2, 0)
    assert engine.num_updates == 8


@pytest.mark.parametrize("kind", ["list", "DataLoader"])
def test_a_second_fit_after_a_cut_inside_an_accumulation_epoch_trains_as_one_fit_and_the_hand_loop(kind):
    """Continuing inside the epoch reads the batches already trained and drops them; the wrapped loader announced
    each one's place, and the last (not a window's first) was still announced at the next window's zero_grad, which
    then kept the cut run's last gradients: the first update of the second fit added them in (found by a probe)."""
    import colossal_lite

    batches, accumulation = make_batches(8), 3  # windows of 3, 3 and 2 micro-batches per epoch

    def hand(updates):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        done = 0
        while True:
            for start in range(0, len(batches), accumulation):
                window = batches[start:start + accumulation]
                opt.zero_grad()
                for x, y in window:
                    (nn.functional.cross_entropy(model(x), y) / len(window)).backward()
                opt.step()
                done += 1
                if done == updates:
                    return model

    def library(durations):
        model = make_model()
        loader = batches if kind == "list" else torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])),
            batch_size=4)
        engine, loader, _, _ = colossal_lite.initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), nn.CrossEntropyLoss(), loader,
            config=dict(gradient_accumulation=accumulation), verbose=False)
        trainer = Trainer(engine)
        for duration in durations:
            trainer.fit(loader, max_duration=duration, log_dir=False, display_progress=False)
        assert engine.num_updates == 10
        return model

    expected = hand(10)
    for durations in (["10ba"], ["5ba", "10ba"]):  # the cut: after batch 5 of epoch 1, a window's last
        got = library(durations)
        for (name, p), q in zip(got.state_dict().items(), expected.state_dict().values()):
            assert torch.equal(p, q), (durations, name)


def test_max_duration_epochs_and_length_errors():
    engine, _ = make_engine(make_model())
    trainer = Trainer(engine)
    trainer.fit(make_batches(2), max_duration="2ep")
    assert (trainer.cur_epoch, trainer.cur_step) == (2, 4)
    with pytest.raises(ValueError, match="give max_duration or epochs/max_steps, not both"):
        trainer.fit(make_batches(2), epochs=3, max_duration="3ep")
    with pytest.raises(ValueError, match="'dur' is a fraction of the run, so it cannot set the run's length"):
        trainer.fit(make_batches(2), max_duration="0.5dur")
    with pytest.raises(ValueError, match="fit needs the run's length"):
        trainer.fit(make_batches(2))
    with pytest.raises(ValueError, match=r"fit\(test_interval='3xx'\): invalid time '3xx'"):
        trainer.fit(make_batches(2), epochs=3, test_dataloader=make_batches(1), test_interval="3xx")
    # a loader without len trains (tests/trainer/test_fit_unsized_loader.py); an iterator is used up after one epoch
    with pytest.raises(ValueError, match="yielded no batch in epoch 1"):
        Trainer(engine).fit(iter(make_batches(2)), epochs=3)


def test_cur_epoch_setter_resumes_at_that_epoch():
    engine, _ = make_engine(make_model())
    trainer = Trainer(engine)
    trainer.cur_epoch = 2
    hook = recorder_steps("before_train_epoch")
    trainer.fit(make_batches(3), epochs=4, hooks=[hook])
    assert hook.at == [(2, 6), (3, 9)]
    assert trainer.cur_step == 12 and engine.num_updates == 6


def test_stop_training_flag_and_state_dict_round_trip():
    class StopAtThree(BaseHook):
        def after_train_iter(self, trainer, *args):
            if trainer.cur_step == 3:
                trainer.state.stop_training = True
                trainer.state.stop_reason = "enough"

    logs = []

    class ListLogger:
        def info(self, msg):
            logs.append(msg)

    engine, _ = make_engine(make_model())
    class Counter(BaseHook):
        def __init__(self):
            self.n = 0

        def after_train_iter(self, trainer, *args):
            self.n += 1

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, state):
            self.n = state["n"]

    trainer = Trainer(engine, logger=ListLogger())
    trainer.fit(make_batches(4), epochs=5, hooks=[LossHook(), Counter(), StopAtThree()])
    assert trainer.cur_step == 3 and engine.num_updates == 3
    assert "Training stopped at epoch 0, step 3: enough" in logs
    saved = trainer.state_dict()
    assert saved["progress"] == {"epoch": 0, "step": 3, "iteration": 3, "batch_idx": 3}
    assert saved["hooks"] == {"Counter.0": {"n": 3}} and saved["trackers"] == {}
    assert saved["history"]["names"] == ["train/Loss_step", "lr", "train/Loss"]  # the epoch cut short at step 3
    assert saved["history"]["step"].tolist() == [1, 1, 2, 2, 3, 3, 3]

    state = State()
    state.load_state_dict(saved["progress"])
    assert (state.epoch, state.step, state.batch_idx) == (0, 3, 3)
    other = Trainer(engine)
    other.load_state_dict(saved)
    counter = Counter()
    other.fit(make_batches(4), epochs=1, hooks=[LossHook(), counter])
    assert other.cur_step == 4 and counter.n == 4  # resumed inside epoch 0: one batch left; the count went on


@pytest.mark.parametrize("event,at_epoch", [("before_train", 0), ("before_train_epoch", 0), ("before_train_epoch", 1)])
def test_a_stop_asked_before_a_batch_runs_trains_no_batch(event, at_epoch):
    """A stop set in before_train or before_train_epoch ran one more micro-batch (an update without accumulation,
    half a window thrown away with it) and recorded an empty epoch (Loss nan) with its end events (found by a
    probe): the epoch does not start, the run ends as the epochs before it left it."""
    class Stop(BaseHook):
        pass

    def stop(self, trainer):
        if trainer.cur_epoch == at_epoch:
            trainer.state.stop_training, trainer.state.stop_reason = True, "budget spent"
    setattr(Stop, event, stop)
    logs = []

    class ListLogger:
        def info(self, msg):
            logs.append(msg)

    reference = make_model()
    ref_engine, _ = make_engine(reference, accumulation=2)
    Trainer(ref_engine).fit(make_batches(4), epochs=at_epoch, hooks=[LossHook()])  # (0 epochs: untouched)
    model = make_model()
    engine, _ = make_engine(model, accumulation=2)
    events = Recorder()
    trainer = Trainer(engine, logger=ListLogger())
    trainer.fit(make_batches(4), epochs=3, hooks=[Stop(), LossHook(), events])
    for a, b in zip(model.state_dict().values(), reference.state_dict().values()):
        assert torch.equal(a, b)
    assert trainer.cur_step == 2 * at_epoch and (trainer.cur_epoch, trainer.state.batch_idx) == (at_epoch, 0)
    assert events.calls.count("before_train_iter") == 4 * at_epoch
    assert events.calls.count("after_train_epoch") == at_epoch and events.calls[-2:] == ["after_train", "after_hook_is_detached"]
    _check_one_finite_loss_per_epoch(at_epoch, trainer)
    assert f"Training stopped at epoch {at_epoch}, step {2 * at_epoch}: budget spent" in logs
    # the next fit starts the epoch the stop kept from starting
    trainer.fit(make_batches(4), epochs=at_epoch + 1, hooks=[LossHook()])
    assert trainer.cur_step == 2 * (at_epoch + 1) and trainer.cur_epoch == at_epoch + 1


def _check_one_finite_loss_per_epoch(epochs, trainer):
    """One finite train Loss per epoch that ran, at its last step (none for the epoch that did not start)."""
    series = trainer.history.series("train/Loss") if "train/Loss" in trainer.history.names else []
    assert [step for step, _ in series] == [2 * (e + 1) for e in range(epochs)]
    assert all(value == value for _, value in series)  # (not NaN)


def test_evaluate_and_predict():
    model = make_model()
    engine, _ = make_engine(model)
    trainer = Trainer(engine)
    test = make_batches(3, seed=2)
    result = trainer.evaluate(test, hooks=[LossHook()])
    x = torch.cat([b[0] for b in test])
    y = torch.cat([b[1] for b in test])
    with torch.no_grad():
        expected = nn.functional.cross_entropy(model(x), y).item()
    assert result["Loss"] == pytest.approx(expected, rel=1e-6)
    assert engine.training  # evaluate puts the engine back in the mode it found
    out = trainer.predict(x[:2])
    assert out.shape == (2, 3) and not out.requires_grad and engine.training


def test_test_mode_runs_one_step_and_one_eval_batch_then_gives_a_verdict():
    rec = Recorder()
    logs = []

    class ListLogger:
        def info(self, msg):
            logs.append(msg)

        def error(self, msg):
            logs.append(msg)

    model = make_model()
    engine, window = make_engine(model, accumulation=2)
    trainer = Trainer(engine, logger=ListLogger())
    before = [p.detach().clone() for p in model.parameters()]
    history = trainer.fit(AccumulationDataLoader(make_batches(6), window), epochs=10, test_dataloader=make_batches(4),
                          hooks=[rec, LossHook()], test_mode=True)
    result = trainer.test_mode_result
    assert history is trainer.history  # fit returns the history in test mode too; the verdict is kept apart
    assert result.ok and bool(result)
    assert str(result).startswith("test mode: 2 train batches and 1 eval batch ran (train loss ")
    assert re.search(r"optimizer step applied, checkpoint round trip OK \([^)]*\)\), loss finite: OK$", str(result)), str(result)
    assert logs[-1] == str(result)
    assert rec.calls.count("after_train_iter") == 2 and rec.calls.count("after_test_iter") == 1
    assert rec.calls.count("after_optimizer_step") == 1
    assert engine.num_updates == 1 and any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert (trainer.cur_epoch, trainer.cur_step, trainer.state.iteration) == (0, 0, 0)  # progress not advanced


def test_test_mode_puts_the_hooks_states_back_and_the_run_after_it_stops_as_without_it():
    """What a hook learns from test mode's one batch does not carry into the run: an early stop that kept the
    one-batch evaluation's loss as its best stopped the following fit after 2 of 5 improving epochs. The LR
    scheduler keeps the step, as the model and optimizer do."""
    from colossal_lite.trainer.hooks import EarlyStoppingHook, LRSchedulerHook

    def run(test_mode_first):
        model = make_model()
        engine, _ = make_engine(model)
        stop = EarlyStoppingHook(monitor="test/Loss", patience=0)
        scheduler = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
        hooks = [LossHook(), stop, LRSchedulerHook(scheduler, by_epoch=False)]
        trainer = Trainer(engine)
        if test_mode_first:
            trainer.fit(make_batches(4), epochs=1, test_dataloader=make_batches(2, seed=9), hooks=hooks,
                        test_mode=True)
            assert stop.state_dict() == EarlyStoppingHook(monitor="test/Loss", patience=0).state_dict()
            assert scheduler.last_epoch == 1  # (the scheduler keeps test mode's step)
        trainer.fit(make_batches(4), epochs=5, test_dataloader=make_batches(2, seed=9), hooks=hooks, log_dir=False)
        return trainer.history["test/Loss"]

    losses = run(test_mode_first=False)
    assert len(losses) == 5 and losses == sorted(losses, reverse=True)  # (improving: no early stop)
    assert len(run(test_mode_first=True)) == 5


def test_test_mode_reports_a_non_finite_loss():
    class NaNLoss(BaseHook):
        def after_loss(self, trainer):
            trainer.state.loss = trainer.state.loss * float("nan")

    engine, _ = make_engine(make_model())
    logs = []

    class ListLogger:
        def info(self, msg):
            logs.append(msg)

        def error(self, msg):
            logs.append("ERROR " + msg)

    trainer = Trainer(engine, logger=ListLogger())
    with pytest.raises(TestModeFailed) as failed:
        trainer.fit(make_batches(3), epochs=1, hooks=[NaNLoss()], test_mode=True)
    result = failed.value.result
    assert str(failed.value) == result.message and trainer.test_mode_result is result and not result.ok
    assert "1 train batch ran" in result.message and "no test_dataloader given" in result.message
    assert result.message.endswith("loss finite: FAILED (a loss or a parameter is NaN or inf)")
    assert not [line for line in logs if "test mode" in line]  # the verdict is the error's message, not logged too


def test_a_loader_that_yields_fewer_batches_than_its_len_gets_a_clear_error():
    class Overstated:
        def __init__(self, batches):
            self.batches = batches

        def __len__(self):
            return len(self.batches) + 2

        def __iter__(self):
            return iter(self.batches)

    engine, _ = make_engine(make_model())
    with pytest.raises(RuntimeError, match=r"stopped after 3 batches of an epoch, but its len\(\) is 5"):
        Trainer(engine).fit(Overstated(make_batches(3)), epochs=1)
