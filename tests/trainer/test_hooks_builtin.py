"""Built-in hooks: metric values, LR in state, log lines, TensorBoard, timing, memory, throughput, early stopping, MixUp."""
import copy
import re
import sys

import pytest
import torch
from torch import nn

from colossal_lite.engine.accumulation import AccumulationDataLoader, AccumulationWindow
from colossal_lite.engine.engine import Engine
from colossal_lite.functional import mixup_batch, mixup_loss
from colossal_lite.nn.metric import Accuracy
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import (
    AccuracyHook,
    AccuracyMetric,
    BaseHook,
    EarlyStoppingHook,
    LogMemoryByEpochHook,
    LogMetricByEpochHook,
    LogMetricByStepHook,
    LogTimingByEpochHook,
    LossHook,
    LossMetric,
    LRSchedulerHook,
    MixUp,
    SaveCheckpointHook,
    TensorboardHook,
    ThroughputHook,
)
from colossal_lite.utils import MultiTimer


def make_batches(n, batch_size=4, seed=0, sizes=None):
    g = torch.Generator().manual_seed(seed)
    sizes = sizes or [batch_size] * n
    return [(torch.randn(b, 6, generator=g), torch.randint(0, 3, (b,), generator=g)) for b in sizes]


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def make_engine(model, accumulation=1, lr=0.1):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    window = AccumulationWindow(accumulation)
    return Engine(model, opt, nn.CrossEntropyLoss(), window=window), window


class ListLogger:
    """Collects what hooks log (they log through ``logger.info`` on rank 0)."""

    def __init__(self):
        self.lines = []

    def info(self, msg):
        self.lines.append(msg)

    error = warning = info


def test_loss_and_accuracy_are_per_sample_means_and_reading_twice_gives_the_same_value():
    model = make_model()
    engine, _ = make_engine(model)
    test = make_batches(3, sizes=[4, 4, 2], seed=3)  # unequal batches: weighted by samples
    trainer = Trainer(engine)
    result = trainer.evaluate(test, hooks=[LossHook(), AccuracyHook(Accuracy())])
    x = torch.cat([b[0] for b in test])
    y = torch.cat([b[1] for b in test])
    with torch.no_grad():
        logits = model(x)
    assert result["Loss"] == pytest.approx(nn.functional.cross_entropy(logits, y).item(), rel=1e-6)
    assert result["Accuracy"] == pytest.approx((logits.argmax(-1) == y).float().mean().item())
    metric = trainer.states["metrics"]["test"]["Loss"]
    assert metric.get_accumulated_value() == metric.get_accumulated_value() == result["Loss"]


def test_loss_metric_accumulates_on_the_device_and_caches_until_update():
    metric = LossMetric(epoch_only=False)
    metric.update(torch.tensor(2.0), 2)
    metric.update(torch.tensor(5.0), 1)
    assert isinstance(metric.last_step_value(), torch.Tensor)
    assert metric.get_accumulated_value() == pytest.approx(3.0)
    metric.update(torch.tensor(1.0), 1)
    assert metric.get_accumulated_value() == pytest.approx(2.5)
    metric.reset()
    assert metric.get_accumulated_value() != metric.get_accumulated_value()  # NaN: nothing measured


def test_loss_metric_sums_weighted_losses_and_keeps_no_graph():
    import weakref

    metric = LossMetric(epoch_only=False)
    w = torch.tensor(1.5, requires_grad=True)
    losses = [(w * 2).reshape(1), (w * 4).to(torch.bfloat16), w * 1]  # shape (1,), bf16, with a graph
    for loss, n in zip(losses, (3, 1, 2)):
        metric.update(loss, n)
    assert metric.last_step_value().grad_fn is None  # what hooks and the display read carries no graph
    assert metric.get_accumulated_value() == pytest.approx((3.0 * 3 + 6.0 * 1 + 1.5 * 2) / 6)
    assert not metric._sum._total.requires_grad
    with pytest.raises(RuntimeError, match=r"one number per batch, got a tensor of shape \(2,\)"):
        metric.update(torch.ones(2), 1)
    assert metric.get_accumulated_value() == pytest.approx((3.0 * 3 + 6.0 * 1 + 1.5 * 2) / 6)  # nothing lost

    # a training loss's graph is not kept (it would hold activations when backward has not run yet)
    metric.reset()
    first = w * 3
    gone = weakref.ref(first)
    metric.update(first, 1)
    del first
    assert gone() is None
    metric.update(w * 1, 1)
    assert metric.get_accumulated_value() == pytest.approx((4.5 + 1.5) / 2)


def test_metrics_keep_no_tensor_of_an_earlier_step():
    """Only the last step's value stays referenced: small tensors kept alive across steps scatter over the
    CPU heap between the step's large buffers and make glibc trim and regrow it (page faults every step)."""
    import weakref

    loss_metric = LossMetric(epoch_only=False)
    acc_metric = AccuracyMetric(epoch_only=False, accuracy_func=lambda logits, y: (logits.argmax(-1) == y).sum())
    seen = []
    for step in range(5):
        loss = torch.tensor(0.5 + step)
        logits, labels = torch.randn(4, 3), torch.tensor([0, 1, 2, 0])
        loss_metric.update(loss, 4)
        acc_metric.update(logits, labels)
        seen.append((weakref.ref(loss), weakref.ref(acc_metric._last_correct)))
        del loss, logits, labels
    assert [loss() is None for loss, _ in seen] == [True] * 4 + [False]
    assert [correct() is None for _, correct in seen] == [True] * 4 + [False]
    assert loss_metric.get_accumulated_value() == pytest.approx(2.5)


def test_loss_metric_sums_in_float64_so_a_long_epoch_keeps_its_precision():
    metric = LossMetric(epoch_only=False)
    loss = torch.tensor(0.1)
    for _ in range(100_000):  # float32 alone drifts by ~1e-4 relative over this many adds
        metric.update(loss, 7)
    assert metric._sum.value(metric.device).dtype == torch.float64
    assert metric.get_accumulated_value() == pytest.approx(float(torch.tensor(0.1)), rel=1e-6)


def test_running_sum_keeps_integer_counts_exact_and_takes_a_fractional_value_after_them():
    from colossal_lite.trainer.hooks._metric_hook import _RunningSum

    counts = _RunningSum()
    for _ in range(40):  # more than a fold
        counts.add(torch.tensor(3))
    assert counts._part.dtype == torch.int64 and float(counts.value(torch.device("cpu"))) == 120.0
    counts.add(torch.tensor(0.5), 2)  # a fractional value after integer ones
    counts.add(torch.tensor(1), 0.25)  # a fractional weight
    assert float(counts.value(torch.device("cpu"))) == 121.25
    with pytest.raises(RuntimeError):
        counts.add(torch.ones(2))  # a real error still surfaces


def test_metric_partial_state_is_a_copy_the_running_sum_does_not_change():
    import copy

    def same(a, b):
        return a.keys() == b.keys() and all(
            torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)

    metric = LossMetric(epoch_only=False)
    for loss in (2.0,) * 20:  # a fold and a part
        metric.update(torch.tensor(loss), 1)
    state = metric.partial_state()
    saved = copy.deepcopy(state)
    metric.update(torch.tensor(4.0), 1)
    assert same(state, saved)
    resumed = LossMetric(epoch_only=False)
    resumed.load_partial_state(state)
    resumed.update(torch.tensor(4.0), 1)
    assert same(state, saved)  # loading did not alias the saved tensors either
    assert resumed.get_accumulated_value() == metric.get_accumulated_value() == pytest.approx(44.0 / 21)
    older = LossMetric(epoch_only=False)  # a checkpoint that saved the sum alone (no separate part)
    older.load_partial_state({"sum": torch.tensor(40.0, dtype=torch.float64), "count": 20})
    older.update(torch.tensor(4.0), 1)
    assert older.get_accumulated_value() == pytest.approx(44.0 / 21)


def test_accuracy_metric_counts_in_place_and_rejects_a_per_sample_result():
    metric = AccuracyMetric(epoch_only=True, accuracy_func=lambda logits, y: (logits.argmax(-1) == y).sum())
    logits = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    metric.update(logits, torch.tensor([1, 1, 1]))
    metric.update(logits[:1], torch.tensor([0]))
    assert metric.get_accumulated_value() == pytest.approx(2 / 4)
    assert metric.last_step_value().item() == 0.0
    bad = AccuracyMetric(epoch_only=True, accuracy_func=lambda logits, y: logits.argmax(-1) == y)
    with pytest.raises(RuntimeError, match="number correct"):
        bad.update(logits, torch.tensor([1, 1, 1]))


def test_loss_hook_weighs_by_the_labels_first_dimension():
    engine, _ = make_engine(make_model())
    batches = make_batches(3)
    x, y = batches[-1]
    batches[-1] = (x[:2], y[:2])  # a short last batch
    result = Trainer(engine).evaluate(batches, hooks=[LossHook()])
    with torch.no_grad():
        per_sample = torch.cat([nn.functional.cross_entropy(engine.unwrapped_model(bx), by, reduction="none")
                                for bx, by in batches])
    assert result["Loss"] == pytest.approx(per_sample.mean().item(), rel=1e-5)


def test_state_lr_follows_the_scheduler_and_can_be_set():
    model = make_model()
    engine, window = make_engine(model, accumulation=1)
    sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
    seen = []

    class Watch(BaseHook):
        def after_train_iter(self, trainer, *args):
            seen.append((trainer.state.lr, trainer.states["metrics"]["train"]["LR"].last_step_value()))

    trainer = Trainer(engine)
    trainer.fit(make_batches(3), epochs=1, hooks=[LRSchedulerHook(sched, by_epoch=False), Watch()])
    assert seen == [pytest.approx((0.05, 0.05)), pytest.approx((0.025, 0.025)), pytest.approx((0.0125, 0.0125))]
    trainer.state.lr = 0.5  # set by hand: no longer read from the scheduler
    sched.step()
    assert trainer.state.lr == 0.5


def test_train_accuracy_and_output_label_requirement():
    engine, _ = make_engine(make_model())
    trainer = Trainer(engine)
    trainer.fit(make_batches(3), epochs=1, hooks=[AccuracyHook(Accuracy(), track_train=True)])
    assert 0.0 <= trainer.states["metrics"]["train"]["Accuracy"].get_accumulated_value() <= 1.0
    with pytest.raises(RuntimeError, match="call fit/evaluate with return_output_label=True"):
        trainer.evaluate(make_batches(1), hooks=[AccuracyHook(Accuracy())], return_output_label=False)


def test_two_accuracies_need_two_names_and_each_reads_its_own():
    """imagenet's main.py reports Acc@1 and Acc@5: a second AccuracyHook replaced the first's metric without a
    word, so the history's 'Accuracy' was the top-5 figure (found by a probe)."""
    def top2(logits, targets):
        return (logits.topk(2, dim=1).indices == targets.view(-1, 1)).any(dim=1).sum()

    model = make_model()
    engine, _ = make_engine(model)
    test = make_batches(3, sizes=[4, 4, 2], seed=3)
    with pytest.raises(ValueError, match=r"AccuracyHook reports the test metric 'Accuracy', which another hook of "
                                         r"this run reports already, and would replace it: give one of them another "
                                         r"name, e.g. AccuracyHook\(..., name='Accuracy_top5'\)"):
        Trainer(engine).evaluate(test, hooks=[AccuracyHook(Accuracy()), AccuracyHook(top2)])
    with pytest.raises(ValueError, match=r"LossHook reports the train metric 'Loss'.*: keep one LossHook"):
        Trainer(engine).fit(make_batches(2), epochs=1, hooks=[LossHook(), LossHook()])
    with pytest.raises(ValueError, match=r"AccuracyHook\(name='a/b'\)"):
        AccuracyHook(top2, name="a/b")
    with pytest.raises(TypeError, match=r"AccuracyHook\(accuracy_func=...\): got the class Accuracy, not a "
                                        r"metric; pass an instance: Accuracy\(\)"):
        AccuracyHook(Accuracy)  # (it failed at the first evaluation batch with torch's TypeError)
    trainer = Trainer(engine)
    history = trainer.fit(make_batches(2), epochs=1, test_dataloader=test,
                          hooks=[AccuracyHook(Accuracy()), AccuracyHook(top2, name="Accuracy_top2", track_train=True)])
    x, y = torch.cat([b[0] for b in test]), torch.cat([b[1] for b in test])
    with torch.no_grad():
        logits = model(x)
    assert history["test/Accuracy"] == [int((logits.argmax(-1) == y).sum()) / len(y)]  # (counts: exact)
    assert history["test/Accuracy_top2"] == [int(top2(logits, y)) / len(y)]
    assert history["test/Accuracy_top2"] != history["test/Accuracy"]
    assert "train/Accuracy_top2" in history.names and "train/Accuracy" not in history.names


@pytest.mark.slow  # takes seconds without starting a process
def test_accuracy_hook_accepts_torchmetrics():
    torchmetrics = pytest.importorskip("torchmetrics")
    engine, _ = make_engine(make_model())
    metric = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")
    result = Trainer(engine).evaluate(make_batches(2), hooks=[AccuracyHook(metric)])
    assert 0.0 <= result["Accuracy"] <= 1.0


def test_lr_scheduler_hook_steps_per_update_and_stores_lr():
    model = make_model()
    engine, window = make_engine(model, accumulation=2)
    sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)  # a raw torch scheduler
    trainer = Trainer(engine)
    trainer.fit(AccumulationDataLoader(make_batches(4), window), epochs=1,
                hooks=[LRSchedulerHook(sched, by_epoch=False)])
    assert engine.num_updates == 2 and sched.last_epoch == 2  # once per optimizer update, not per micro-batch
    assert trainer.state.lr == pytest.approx(0.025)
    assert trainer.states["metrics"]["train"]["LR"].get_accumulated_value() == pytest.approx(0.025)

    sched2 = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
    trainer.fit(AccumulationDataLoader(make_batches(4), window), epochs=2,
                hooks=[LRSchedulerHook(sched2, by_epoch=True, store_lr_in_state=False)])
    assert sched2.last_epoch == 1  # one more epoch ran: one step
    assert "LR" not in trainer.states["metrics"]["train"]


def test_per_epoch_schedule_steps_once_per_epoch_when_max_steps_cuts_an_epoch_short():
    engine, _ = make_engine(make_model())
    sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
    trainer = Trainer(engine)
    hooks = [LRSchedulerHook(sched, by_epoch=True)]
    trainer.fit(make_batches(4), max_steps=3, hooks=hooks)  # stops 3 batches into epoch 0
    assert trainer.state.batch_idx == 3 and sched.last_epoch == 0  # the epoch did not end: no step
    trainer.fit(make_batches(4), epochs=2, hooks=hooks)  # finishes epoch 0, then runs epoch 1
    assert trainer.cur_epoch == 2 and sched.last_epoch == 2  # one step per finished epoch
    assert trainer.state.lr == pytest.approx(0.1 * 0.5 ** 2)


def test_log_metric_by_epoch_hook_lines_and_interval():
    logger = ListLogger()
    engine, _ = make_engine(make_model())
    sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=100)
    hooks = [LossHook(), AccuracyHook(Accuracy()), LRSchedulerHook(sched, by_epoch=True),
             LogMetricByEpochHook(logger, interval="2ep")]
    Trainer(engine).fit(make_batches(2), epochs=4, test_dataloader=make_batches(1), test_interval=2, hooks=hooks)
    train = [line for line in logger.lines if "/ Train]" in line]
    test = [line for line in logger.lines if "/ Test]" in line]
    assert [line.split(":")[0] for line in train] == ["[Epoch 1 / Train]", "[Epoch 3 / Train]"]
    assert re.fullmatch(r"\[Epoch 1 / Train\]: Loss = [0-9.]+ \| LR = 0\.1", train[0])
    assert re.fullmatch(r"\[Epoch 3 / Test\]: Loss = [0-9.]+ \| Accuracy = [0-9.]+", test[-1])
    assert len(test) == 2


def test_tensorboard_hook_writes_nothing_in_test_mode(tmp_path):
    """A test-mode fit before the real one left its step-1 points in the event file, beside the real run's (a
    second train point at step 1, an evaluation at step 1 that never happened; found by a probe)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    engine, _ = make_engine(make_model())
    hook = TensorboardHook(str(tmp_path))
    trainer = Trainer(engine)
    kwargs = dict(test_dataloader=make_batches(2), hooks=[LossHook(), hook])
    trainer.fit(make_batches(3), epochs=1, test_mode=True, **kwargs)
    trainer.fit(make_batches(3), epochs=1, **kwargs)
    hook.close()
    acc = EventAccumulator(str(tmp_path / "global_rank_0"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("Loss/train")] == [1, 2, 3]
    assert [e.step for e in acc.Scalars("Loss/test")] == [3]
    assert not trainer.state.test_mode


def test_tensorboard_hook_after_a_crash_and_resume_has_one_point_per_step(tmp_path):
    """A run resumed from a checkpoint older than the crashed run's last points wrote those steps again, beside the
    crashed run's (two points at a step; found by the outputs probe): the resumed run hides them, as
    TensorBoardTracker does."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def fit(**kwargs):
        engine, _ = make_engine(make_model())
        hook = TensorboardHook(str(tmp_path / "tb"))
        Trainer(engine).fit(make_batches(3), epochs=2, test_dataloader=make_batches(2),
                            hooks=[LossHook(), hook, SaveCheckpointHook(1, str(tmp_path / "ck"))], **kwargs)
        hook.close()

    fit()
    (tmp_path / "ck" / "last").write_text("epoch0-step3\n")  # the crash came before epoch 1's checkpoint
    fit(resume_from="last")
    acc = EventAccumulator(str(tmp_path / "tb" / "global_rank_0"), purge_orphaned_data=True)
    acc.Reload()
    assert [e.step for e in acc.Scalars("Loss/train")] == [1, 2, 3, 4, 5, 6]
    assert [e.step for e in acc.Scalars("Loss/test")] == [3, 6]


def test_tensorboard_hook_writes_readable_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    class Recorder(BaseHook):
        losses = []

        def after_train_iter(self, trainer, output, label, loss):
            self.losses.append(loss.item())

    engine, _ = make_engine(make_model())
    hook = TensorboardHook(str(tmp_path))
    hook.flush_every = 2  # points are buffered on the device: written when 2 are kept and at each epoch's end
    recorder = Recorder()
    # LogMetricByEpochHook also reads the test loss: the second read must not change it
    logger = ListLogger()
    Trainer(engine).fit(make_batches(3), epochs=2, test_dataloader=make_batches(2),
                        hooks=[LossHook(), LogMetricByEpochHook(logger), hook, recorder,
                               LRSchedulerHook(torch.optim.lr_scheduler.StepLR(engine.optimizer, 2, 0.5), False)])
    hook.close()
    acc = EventAccumulator(str(tmp_path / "global_rank_0"))
    acc.Reload()
    train = acc.Scalars("Loss/train")
    test = acc.Scalars("Loss/test")
    assert [e.step for e in train] == [1, 2, 3, 4, 5, 6]
    assert [e.step for e in test] == [3, 6]
    assert [e.value for e in train] == pytest.approx(recorder.losses, rel=1e-6)  # each step's own loss
    lr = acc.Scalars("LR/train")  # host numbers, kept beside the device values
    assert [(e.step, round(e.value, 6)) for e in lr] == [(1, 0.1), (2, 0.05), (3, 0.05), (4, 0.025), (5, 0.025),
                                                       (6, 0.0125)]
    logged = float(re.search(r"\[Epoch 1 / Test\]: Loss = ([0-9.]+)", " ".join(logger.lines)).group(1))
    assert test[-1].value == pytest.approx(logged, rel=1e-4)


def test_tensorboard_step_series_takes_one_number_per_step_and_names_a_metric_that_gives_more():
    from colossal_lite.trainer._series import StepSeries

    series = StepSeries(4, "Margin")
    series.add(torch.tensor([0.5]), 1)  # shape (1,): one number
    series.add(torch.tensor(0.25, requires_grad=True) * 2, 2)
    series.add(3.0, 3)
    assert series.drain() == [(1, 0.5), (2, 0.5), (3, 3.0)]
    with pytest.raises(ValueError, match=r"train metric 'Margin' gave a step value of shape \(3,\)"):
        series.add(torch.ones(3), 4)


def test_tensorboard_hook_without_tensorboard_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"TensorboardHook needs the tensorboard package, which is not installed: "
                                          r"pip install tensorboard"):
        TensorboardHook("unused")


def test_timing_and_throughput_hooks_work_without_a_timer_given_to_the_trainer():
    logger = ListLogger()
    engine, _ = make_engine(make_model())
    trainer = Trainer(engine)  # no timer
    hooks = [ThroughputHook(ignored_steps=1), LogTimingByEpochHook(None, logger, ignore_num_train_steps=1),
             LogMetricByEpochHook(logger)]
    trainer.fit(make_batches(4), epochs=1, test_dataloader=make_batches(2), hooks=hooks)
    text = "\n".join(logger.lines)
    assert re.search(r"\[Epoch 0 / Train\]: Train-epoch: last = [0-9.e-]+ s, mean = [0-9.e-]+ s \| "
                     r"Train-step: last = [0-9.e-]+ s, mean = [0-9.e-]+ s \| #steps/epoch = 4", text), text
    assert re.search(r"\[Epoch 0 / Test\]: Test-epoch: last = [0-9.e-]+ s.* \| Test-step: last = ", text), text
    assert re.search(r"\[Epoch 0 / Train\]: Throughput = [0-9.e+]+ sample_per_sec", text), text
    assert trainer.states["metrics"]["train"]["Throughput"].get_accumulated_value() > 0
    assert trainer.timer is None  # the hook's timer was used for that run only

    timer = MultiTimer()
    Trainer(engine, timer=timer).fit(make_batches(2), epochs=1, hooks=[LogTimingByEpochHook(MultiTimer(), logger)])
    assert "Train-step" in timer  # with a trainer timer, that one is used


def test_the_logged_throughput_is_the_recorded_one_whichever_hook_reads_it_first():
    """The epoch's time after its last iteration (and on a GPU the device's queued work) joined the figure in the
    hook's own epoch-end handler: a log hook of the same priority listed before it (the docs' own order) logged a
    figure above the one the history, the metrics file and ``evaluate`` then held (found by a probe). The first read
    closes the epoch now, whoever makes it."""
    logger = ListLogger()
    engine, _ = make_engine(make_model())
    trainer = Trainer(engine)
    trainer.fit(make_batches(4), epochs=2, test_dataloader=make_batches(2),
                hooks=[LogMetricByEpochHook(logger), ThroughputHook()])
    logged = {phase: [float(v) for v in re.findall(rf"\[Epoch \d / {phase}\]: Throughput = ([0-9.e+]+) sample_per_sec",
                                                    "\n".join(logger.lines))] for phase in ("Train", "Test")}
    for phase in ("Train", "Test"):
        recorded = trainer.history[f"{phase.lower()}/Throughput"]
        assert len(logged[phase]) == len(recorded) == 2, (logger.lines, recorded)
        assert logged[phase] == [float(f"{v:.5g}") for v in recorded], (phase, logged[phase], recorded)
    results = trainer.evaluate(make_batches(2), hooks=[LogMetricByEpochHook(logger), ThroughputHook()])
    said = re.findall(r"\[Evaluation\]: Throughput = ([0-9.e+]+) sample_per_sec", "\n".join(logger.lines))
    assert [float(v) for v in said] == [float(f"{results['Throughput']:.5g}")], (said, results)


def test_memory_hook_reports_process_memory():
    logger = ListLogger()
    engine, _ = make_engine(make_model())
    Trainer(engine).fit(make_batches(2), epochs=1, test_dataloader=make_batches(1),
                        hooks=[LogMemoryByEpochHook(logger, report_cpu=True)])
    assert [line.split(":")[0] for line in logger.lines] == ["Before-train", "[Epoch 0 / Train]", "[Epoch 0 / Test]"]
    assert all("CPU: RSS" in line for line in logger.lines)


def test_step_metrics_are_a_live_view_whatever_the_hook_order():
    engine, _ = make_engine(make_model())
    seen = {}

    class Peek(BaseHook):
        def after_train_iter(self, trainer, *args):
            seen.update(trainer.states["step_metrics"])

    sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=100)
    # LogMetricByStepHook listed before the hooks whose metrics it shows
    Trainer(engine).fit(make_batches(2), epochs=1, hooks=[LogMetricByStepHook(), Peek(), LossHook(priority=10),
                                                          LRSchedulerHook(sched, by_epoch=False, priority=10),
                                                          ThroughputHook()])
    assert set(seen) == {"loss", "lr", "throughput"}
    assert isinstance(seen["loss"], torch.Tensor)  # not read from the device per step


def test_early_stopping_stops_after_patience_checks_without_improvement():
    logger = ListLogger()
    engine, _ = make_engine(make_model())
    trainer = Trainer(engine, logger=logger)
    # training lowers the loss, so in 'max' mode every check after the first is "no improvement"
    early = EarlyStoppingHook("Loss", mode="max", patience=2, logger=logger)
    trainer.fit(make_batches(2), epochs=10, hooks=[LossHook(), early])
    assert trainer.cur_epoch == 3 and trainer.cur_step == 6
    assert trainer.state.stop_reason.startswith("EarlyStoppingHook: train/Loss did not improve by more than 0 for "
                                                "2 checks (last ")
    assert any(line.startswith("Training stopped at epoch 2, step 6: EarlyStoppingHook") for line in logger.lines)


def test_a_run_whose_patience_is_spent_trains_no_further_when_fit_or_resumed_again(tmp_path):
    """An early-stopped script run again with resume_from='auto' trained one more check every time (the stop was
    not kept; found by a probe): the hook's spent patience stops the run before its first batch. A larger
    patience goes on."""
    from colossal_lite.trainer.hooks import SaveCheckpointHook

    def run(patience, trainer=None):
        engine, _ = make_engine(make_model())
        trainer = trainer or Trainer(engine, logger=ListLogger())
        early = EarlyStoppingHook("Loss", mode="max", patience=patience)
        trainer.fit(make_batches(2), epochs=10, resume_from="auto",
                    hooks=[LossHook(), early, SaveCheckpointHook(1, tmp_path / "ck")])
        return trainer, early

    first, early = run(2)
    assert (first.cur_epoch, first.cur_step, early.wait) == (3, 6, 2)
    first.fit(make_batches(2), epochs=10, hooks=[LossHook(), early])  # the same trainer, fit again
    assert first.cur_step == 6
    again, early = run(2)  # the script run again
    assert (again.cur_epoch, again.cur_step, early.wait) == (3, 6, 2)
    assert again.state.stop_reason == ("EarlyStoppingHook: Loss had not improved for 2 checks when the run stopped "
                                       f"(best {early.best:.6g} at epoch 0); give a larger patience to train further")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith("epoch")) == [
        "epoch0-step2", "epoch1-step4", "epoch2-step6"]
    longer, early = run(3)  # a larger patience: one more check
    assert (longer.cur_epoch, longer.cur_step, early.wait) == (4, 8, 3)


def test_early_stopping_argument_errors():
    with pytest.raises(ValueError, match="use 'min' .* or 'max'"):
        EarlyStoppingHook("Loss", mode="lowest")
    engine, _ = make_engine(make_model())
    trainer = Trainer(engine)
    with pytest.raises(ValueError, match=r"no test metric 'Accuracy'. The hooks of this run give train metrics "
                                         r"\['Loss'\] and test metrics \['Loss'\]; add the hook"):
        trainer.fit(make_batches(2), epochs=1, test_dataloader=make_batches(1),
                    hooks=[LossHook(), EarlyStoppingHook("test/Accuracy")])
    assert not trainer.state.fitting and trainer._step is None  # the failed attach was cleaned up


def test_hook_arguments_of_the_wrong_kind_name_the_argument_and_what_to_give():
    """A string where a bool or a number is meant was taken (``by_epoch='no'`` is true: the scheduler stepped per
    epoch) or failed deep inside (``decay='0.9'``: a bare comparison TypeError). Found by a probe."""
    from colossal_lite.trainer.hooks import EMAHook, LRSchedulerHook

    scheduler = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(make_model().parameters(), lr=0.1), step_size=1)
    with pytest.raises(TypeError, match=r"LRSchedulerHook\(by_epoch='no'\): give True .* or False"):
        LRSchedulerHook(scheduler, by_epoch="no")
    assert LRSchedulerHook(scheduler, by_epoch=0).by_epoch is False  # an int is a truth value, as legacy took it
    with pytest.raises(TypeError, match=r"EMAHook\(decay='0.9'\): give a number in \[0, 1\]"):
        EMAHook(decay="0.9")
    with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
        EMAHook(decay=1.5)


def test_a_loader_that_drop_last_empties_is_named_as_the_cause():
    from torch.utils.data import DataLoader, TensorDataset

    engine, _ = make_engine(make_model())
    loader = DataLoader(TensorDataset(torch.randn(6, 6), torch.randint(0, 3, (6,))), batch_size=8, drop_last=True)
    with pytest.raises(ValueError, match=r"len\(train_dataloader\) == 0: its 6 samples \(on this rank\) are fewer "
                                         r"than batch_size=8, and drop_last=True drops that partial batch"):
        Trainer(engine).fit(loader, epochs=1)
    with pytest.raises(ValueError, match=r"len\(train_dataloader\) == 0$"):
        Trainer(engine).fit([], epochs=1)


@pytest.mark.parametrize("interpolate_loss", [True, False])
def test_mixup_hook_equals_the_functional_form(interpolate_loss):
    batches = make_batches(3)
    ref_model = make_model()
    model = copy.deepcopy(ref_model)
    losses = []

    class Watch(BaseHook):
        def after_train_iter(self, trainer, output, label, loss):
            losses.append(loss.detach().clone())
            assert label.dtype == torch.int64  # the hooks after the loss see the original labels

    engine, _ = make_engine(model)
    torch.manual_seed(123)
    Trainer(engine).fit(batches, epochs=1, hooks=[MixUp(alpha=0.4, interpolate_loss=interpolate_loss), Watch()])

    torch.manual_seed(123)
    opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    expected = []
    for x, y in batches:
        opt.zero_grad()
        mixed, y_perm, mixing = mixup_batch(x, y, alpha=0.4)
        loss = mixup_loss(nn.functional.cross_entropy, ref_model(mixed), y, y_perm, mixing)
        loss.backward()
        opt.step()
        expected.append(loss.detach())
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected))
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b)


def test_mixup_leaves_evaluation_alone():
    model = make_model()
    engine, _ = make_engine(model)
    test = make_batches(2)
    plain = Trainer(engine).evaluate(test, hooks=[LossHook()])
    mixed = Trainer(engine).evaluate(test, hooks=[LossHook(), MixUp(alpha=1.0)])
    assert plain["Loss"] == mixed["Loss"]


def test_mixup_refuses_a_loss_the_model_computes_itself():
    model = make_model()
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1))  # no criterion: the model's own loss
    with pytest.raises(ValueError, match=r"no criterion: its model computes its own loss.*Pass a criterion"):
        Trainer(engine).fit(make_batches(1), epochs=1, hooks=[MixUp()], display_progress=False)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), make_model().parameters()))  # nothing trained


def test_loss_sum_weighs_each_part_by_its_batch_size_and_resumes_bit_for_bit():
    """Values of one weight are summed unweighted and multiplied when folded; a smaller last batch starts a new
    part. A partial state taken anywhere continues to the uninterrupted run's exact float64 sum."""
    losses = [(0.1 * (i % 7) + 0.013 * i, 4) for i in range(37)] + [(0.77, 2), (0.31, 2), (0.5, 4)]
    expected = sum(v * n for v, n in losses) / sum(n for _, n in losses)
    whole = LossMetric(epoch_only=False)
    for v, n in losses:
        whole.update(torch.tensor(v), n)
    assert whole.get_accumulated_value() == pytest.approx(expected, rel=1e-6)
    for cut in (5, 16, 17, 37, 38):
        first = LossMetric(epoch_only=False)
        for v, n in losses[:cut]:
            first.update(torch.tensor(v), n)
        resumed = LossMetric(epoch_only=False)
        resumed.load_partial_state(first.partial_state())
        for v, n in losses[cut:]:
            resumed.update(torch.tensor(v), n)
        assert resumed.get_accumulated_value() == whole.get_accumulated_value(), f"cut at {cut}"


def test_a_hook_of_ones_own_sets_values_in_step_metrics_as_legacy_hooks_did(capsys):
    """Legacy ``states['step_metrics']`` was a dict a hook could add to; here it was a read-only view and the
    assignment raised TypeError (found by the legacy-scripts probe). Own values show in the progress line."""
    class GradNote(BaseHook):
        def after_train_iter(self, trainer, *args):
            trainer.states["step_metrics"]["note"] = 7.5
            with pytest.raises(KeyError, match=r"is the metric 'loss''s value, read from the metric"):
                trainer.states["step_metrics"]["loss"] = 0.0

    engine, _ = make_engine(make_model())
    trainer = Trainer(engine)
    trainer.fit(make_batches(3), epochs=1, display_progress=True,
                hooks=[LossHook(), LogMetricByStepHook(), GradNote(priority=20)])
    assert trainer.states["step_metrics"]["note"] == 7.5 and set(trainer.states["step_metrics"]) == {"loss", "note"}
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[Epoch 0 / Train]")][-1]
    assert line.endswith("note=7.5") and " loss=" in line, line
    del trainer.states["step_metrics"]["note"]
    assert set(trainer.states["step_metrics"]) == {"loss"}
