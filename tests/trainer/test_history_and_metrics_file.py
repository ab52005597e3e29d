"""fit's history and metrics file: the values a hand-written loop computes, the same after a crash and a resume
(in memory and on disk, no step twice), the same on both ranks of a 2-process run, and the trackers they feed."""
import csv
import json
import math
import textwrap

import pytest
import torch
from dist_helpers import run_ranks
from hook_helpers import crash_at
from torch import nn
from torch.utils.data import TensorDataset

from colossal_lite.engine.engine import Engine
from colossal_lite.nn.metric import Accuracy
from colossal_lite.trainer import Trainer
from colossal_lite.trainer._recorder import Recorder
from colossal_lite.trainer.history import is_measured
from colossal_lite.trainer.hooks import AccuracyHook, BaseHook, LossHook, LRSchedulerHook, SaveCheckpointHook
from colossal_lite.trainer.trackers import MetricsFile, TensorBoardTracker, Tracker
from colossal_lite.utils import get_dataloader


def dataset(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def build(shuffle=True):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    engine = Engine(model, opt, nn.CrossEntropyLoss())
    return model, engine, sched, get_dataloader(dataset(), shuffle=shuffle, seed=7, batch_size=8)


def hooks_for(sched):
    return [LossHook(), AccuracyHook(Accuracy(), track_train=True), LRSchedulerHook(sched, by_epoch=False)]


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_history_holds_what_a_hand_written_loop_computes(tmp_path):
    model, engine, sched, loader = build(shuffle=False)
    test = [(x, y) for x, y in get_dataloader(dataset(12, seed=1), batch_size=6)]
    history = Trainer(engine).fit(loader, epochs=2, test_dataloader=test, hooks=hooks_for(sched), log_dir=tmp_path)

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    data, losses, lrs, epoch_loss, test_loss = dataset(), [], [], [], []
    for _ in range(2):
        weighted = 0.0
        for i in range(0, 40, 8):
            x, y = data[i:i + 8]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(ref(x), y)
            loss.backward()
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            ref_sched.step()
            losses.append(loss.item())
            weighted += loss.item() * 8
        epoch_loss.append(weighted / 40)
        with torch.no_grad():
            test_loss.append(sum(nn.functional.cross_entropy(ref(x), y).item() * 6 for x, y in test) / 12)

    assert history["train/Loss_step"] == pytest.approx(losses, rel=1e-6)
    assert history["lr"] == pytest.approx(lrs, rel=1e-12)  # the LR each step used (the schedule moved after it)
    assert history["train/Loss"] == pytest.approx(epoch_loss, rel=1e-6)
    assert history["test/Loss"] == pytest.approx(test_loss, rel=1e-5)
    assert [row["step"] for row in history.steps] == list(range(1, 11))
    assert [(row["epoch"], row["step"]) for row in history.epochs] == [(0, 5), (1, 10)]
    assert history.epochs[1]["lr"] == lrs[-1] and 0 <= history.epochs[0]["train/Accuracy"] <= 1
    assert all(isinstance(r["value"], float) for r in history)  # plain Python numbers
    # the file holds the same records, one JSON object per line
    lines = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["epoch"], r["name"], r["value"]) for r in lines] == history.without_time()
    assert all(set(r) == {"step", "epoch", "name", "value", "time"} for r in lines)


def test_a_resumed_run_has_the_uninterrupted_runs_history_and_file(tmp_path, monkeypatch):
    monkeypatch.setattr(Recorder, "flush_every", 2)  # flushes inside epochs too
    _, engine, sched, loader = build()
    test = [(x, y) for x, y in get_dataloader(dataset(12, seed=1), batch_size=6)]
    ref = Trainer(engine).fit(loader, epochs=3, test_dataloader=test, hooks=hooks_for(sched) + [
        SaveCheckpointHook("4ba", tmp_path / "ref")])
    assert len(ref.steps) == 15

    _, engine, sched, loader = build()
    with pytest.raises(RuntimeError, match="simulated crash"):  # after the checkpoint of step 8 and the epoch end
        Trainer(engine).fit(loader, epochs=3, test_dataloader=test, hooks=hooks_for(sched) + [  # of step 10
            SaveCheckpointHook("4ba", tmp_path / "run"), crash_at(11)])
    written = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert max(r["step"] for r in written) >= 10  # the crashed run wrote past its last checkpoint

    _, engine, sched, loader = build()
    trainer = Trainer(engine)
    resumed = trainer.fit(loader, epochs=3, test_dataloader=test, resume_from="last",
                          hooks=hooks_for(sched) + [SaveCheckpointHook("4ba", tmp_path / "run")])
    assert trainer.restored_from.name == "epoch1-step8"
    # each save's seconds are measured with a clock, so they cannot be equal between two runs: they are compared
    # by where they were recorded, and everything else bit for bit (without_measured leaves out only them here)
    assert {name for name in ref.names if is_measured(name)} == {"checkpoint/blocking_s", "checkpoint/total_s"}
    assert ref.series("checkpoint/total_s")[0][0] == 4 and len(ref.without_measured()) == len(ref) - 2 * 4
    assert resumed.without_measured() == ref.without_measured()
    # step 8's times were recorded after its checkpoint was taken: the resumed run takes them back from its folder
    assert [s for s, _ in resumed.series("checkpoint/total_s")] == [4, 8, 12, 15]
    on_disk = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in on_disk if r["name"] == "checkpoint/blocking_s"] == [4, 8, 12, 15]
    on_disk = [(r["step"], r["epoch"], r["name"], r["value"]) for r in on_disk if not is_measured(r["name"])]
    assert on_disk == ref.without_measured()  # appended across the resume, no step twice
    assert on_disk == [(r["step"], r["epoch"], r["name"], r["value"])
                       for r in read_jsonl(tmp_path / "ref" / "metrics.jsonl") if not is_measured(r["name"])]


def test_a_later_fit_goes_on_with_the_history_and_the_csv_form_matches(tmp_path):
    _, engine, sched, loader = build()
    trainer = Trainer(engine)
    first = trainer.fit(loader, epochs=1, hooks=hooks_for(sched), trackers=[MetricsFile(tmp_path, csv=True)])
    assert len(first.steps) == 5
    second = trainer.fit(loader, epochs=2, hooks=hooks_for(sched), trackers=[MetricsFile(tmp_path, csv=True)])
    assert second is trainer.history and [row["step"] for row in second.steps] == list(range(1, 11))
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["step", "epoch", "name", "value", "time"]
    assert [(int(r["step"]), int(r["epoch"]), r["name"], float(r["value"])) for r in rows] == second.without_time()


class EpochValues(BaseHook):
    """The train metrics' values at the end of each finished epoch, as a user's hook reads them."""

    def __init__(self, seen):
        super().__init__(priority=100)
        self.seen = seen

    def after_train_epoch(self, trainer):
        if trainer.state.epoch_finished:
            self.seen.append((trainer.cur_epoch, {name: metric.get_accumulated_value()
                                                  for name, metric in trainer.states["metrics"]["train"].items()}))


@pytest.mark.parametrize("same_hooks", [False, True])
def test_a_later_fit_that_continues_a_cut_epoch_records_what_an_uninterrupted_run_does(tmp_path, same_hooks):
    # The later fit reset the epoch's train sums and recorded its values over the batches after the cut only, and
    # the cut fit's values of that epoch (and of the evaluation after them) stayed: epoch 1 had two train/Loss.
    test = [(x, y) for x, y in get_dataloader(dataset(12, seed=1), batch_size=6)]
    ref_values, values = [], []
    ref_model, engine, sched, loader = build()
    ref = Trainer(engine).fit(loader, epochs=3, test_dataloader=test, log_dir=tmp_path / "ref",
                              hooks=hooks_for(sched) + [EpochValues(ref_values)])

    model, engine, sched, loader = build()
    trainer = Trainer(engine)
    hooks = hooks_for(sched) + [EpochValues(values)]
    cut = trainer.fit(loader, epochs=3, max_steps=7, test_dataloader=test, log_dir=tmp_path / "run", hooks=hooks)
    assert (trainer.cur_epoch, trainer.state.batch_idx) == (1, 2)  # 5 steps per epoch: cut 2 steps into epoch 1
    assert cut.series("train/Loss")[-1][0] == 7  # this fit's own history: epoch 1's first 2 steps, evaluated
    trainer.record_values({"own/value": 1.5})  # recorded between the fits by the user: it stays
    trainer.fit(loader, epochs=3, test_dataloader=test, log_dir=tmp_path / "run",
                hooks=hooks if same_hooks else hooks_for(sched) + [EpochValues(values)])
    assert values == ref_values  # each epoch's values over all its batches, bit for bit
    assert [epoch for epoch, _ in values] == [0, 1, 2]
    own = (7, 1, "own/value", 1.5)
    assert own in trainer.history.without_time()
    assert [r for r in trainer.history.without_time() if r != own] == ref.without_time()  # each epoch's values once
    on_disk = [(r["step"], r["epoch"], r["name"], r["value"]) for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert [r for r in on_disk if r != own] == ref.without_time()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


class Collect(Tracker):
    """A tracker in a few lines: what it was given, and how the run ended."""

    def __init__(self):
        self.points, self.status, self.checkpoints = [], [], []

    def log_metrics(self, metrics, step, epoch, time):
        self.points.extend((step, epoch, name, value) for name, value in metrics.items())

    def log_checkpoint(self, path):
        self.checkpoints.append(path)

    def finish(self, status="FINISHED"):
        self.status.append(status)


def test_a_users_tracker_gets_every_record_the_final_checkpoint_and_the_end(tmp_path):
    _, engine, sched, loader = build()
    mine = Collect()
    history = Trainer(engine).fit(loader, epochs=2, hooks=hooks_for(sched) + [SaveCheckpointHook(1, tmp_path)],
                                  trackers=[mine])
    assert mine.points == history.without_time() and mine.status == ["FINISHED"]
    assert [p.name for p in mine.checkpoints] == ["epoch1-step10"]
    assert (tmp_path / "metrics.jsonl").is_file()  # the default file, next to the checkpoints

    crashed = Collect()
    _, engine, sched, loader = build()
    with pytest.raises(RuntimeError, match="simulated crash"):
        Trainer(engine).fit(loader, epochs=2, hooks=hooks_for(sched) + [crash_at(3)], trackers=[crashed], log_dir=False)
    assert crashed.status == ["FAILED"] and crashed.checkpoints == []


def test_tensorboard_tracker_writes_the_history(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, engine, sched, loader = build()
    history = Trainer(engine).fit(loader, epochs=2, hooks=hooks_for(sched), log_dir=tmp_path,
                                  trackers=[TensorBoardTracker()])
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == set(history.names)
    for name in history.names:
        points = [(e.step, e.value) for e in acc.Scalars(name)]
        assert points == [(s, pytest.approx(v, rel=1e-6)) for s, v in history.series(name)], name


def test_bad_trackers_and_log_dirs_say_what_to_fix(tmp_path):
    _, engine, sched, loader = build()
    trainer = Trainer(engine)
    with pytest.raises(TypeError, match=r"fit\(trackers=...\)\[0\] is a str, not a tracker"):
        trainer.fit(loader, epochs=1, trackers=["mlflow"])
    with pytest.raises(TypeError, match="must be a list of trackers"):
        trainer.fit(loader, epochs=1, trackers=Collect())
    with pytest.raises(TypeError, match=r"fit\(log_dir=3\)"):
        trainer.fit(loader, epochs=1, log_dir=3)
    with pytest.raises(ValueError, match=r"TensorBoardTracker has nowhere to write: give it log_dir=..., or give "
                                         r"fit a log_dir"):
        trainer.fit(loader, epochs=1, trackers=[TensorBoardTracker()])
    trainer.fit(loader, epochs=1, log_dir=False)
    assert list(tmp_path.iterdir()) == []


TWO_RANKS = textwrap.dedent('''
    import json, sys
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    import colossal_lite
    from colossal_lite.core import global_context as gpc
    from colossal_lite.trainer import Trainer
    from colossal_lite.trainer.hooks import BaseHook, LossHook, LRSchedulerHook
    from colossal_lite.utils import get_dataloader

    class OwnLoss(BaseHook):
        def __init__(self):
            super().__init__(priority=100)
            self.losses = []
        def after_train_iter(self, trainer, output, label, loss):
            self.losses.append(loss.item())

    out = sys.argv[1]
    colossal_lite.launch_from_torch(config=dict(), seed=1, verbose=False)
    rank = gpc.get_global_rank()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    engine, loader, _, _ = colossal_lite.initialize(model, opt, nn.CrossEntropyLoss(),
                                                    get_dataloader(data, batch_size=4, shuffle=True), verbose=False)
    own = OwnLoss()
    history = Trainer(engine).fit(loader, epochs=2, log_dir=out,
                                  hooks=[LossHook(), LRSchedulerHook(sched, by_epoch=False), own])
    line = json.dumps({"rank": rank, "history": history.without_time(), "own": own.losses})
    print(line + "\\n", end="", flush=True)
    gpc.destroy()
''')


def test_two_ranks_record_the_same_history_and_rank_0_writes_the_file(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(TWO_RANKS)
    proc = run_ranks(script, [tmp_path / "out"], nproc=2, timeout=120)
    ranks = {r["rank"]: r for r in (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))}
    assert sorted(ranks) == [0, 1]
    assert ranks[0]["history"] == ranks[1]["history"]
    steps = [v for _, _, name, v in ranks[0]["history"] if name == "train/Loss_step"]
    both = [(a + b) / 2 for a, b in zip(ranks[0]["own"], ranks[1]["own"])]
    assert len(steps) == 8 and steps == pytest.approx(both, rel=1e-6)  # the step value is the ranks' mean
    epochs = [v for _, _, name, v in ranks[0]["history"] if name == "train/Loss"]
    assert epochs[0] == pytest.approx(sum(ranks[0]["own"][:4] + ranks[1]["own"][:4]) / 8, rel=1e-6)
    written = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [[r["step"], r["epoch"], r["name"], r["value"]] for r in written] == ranks[0]["history"]
    assert not math.isnan(steps[-1])


def test_the_docs_page_runs_and_its_file_has_each_step_once(tmp_path):
    from dist_helpers import doc_python_blocks, run_python

    (tmp_path / "page.py").write_text("".join(doc_python_blocks("docs/metrics.md")))
    out = run_python(tmp_path / "page.py", cwd=tmp_path, timeout=180).stdout
    assert "24 steps 0.1" in out and "step 32: test accuracy" in out and "run finished" in out, out
    records = read_jsonl(tmp_path / "runs" / "metrics_demo" / "metrics.jsonl")
    steps = [r["step"] for r in records if r["name"] == "train/Loss_step"]
    assert steps == list(range(1, 33))


def test_a_history_keeps_columns_round_trips_and_names_what_it_has():
    from colossal_lite.trainer.history import History

    history = History({"step": s, "epoch": s // 10, "name": n, "value": s * 0.5, "time": 1.0}
                      for s in range(1, 31) for n in ("train/Loss_step", "lr"))
    history.add([{"step": 30, "epoch": 2, "name": "test/Loss", "value": 0.25, "time": 2.0}])
    state = history.state_dict()
    assert all(isinstance(state[k], torch.Tensor) for k in ("step", "epoch", "name", "value", "time"))
    again = History()
    again.load_state_dict(state)
    assert again.records == history.records and len(again) == 61
    assert again.series("test/Loss") == [(30, 0.25)] and again.last("lr") == 15.0
    with pytest.raises(KeyError, match=r"History has no metric 'test/Accuracy'; it has \['train/Loss_step', 'lr', "
                                       r"'test/Loss'\]"):
        again["test/Accuracy"]
    again.truncate(20)
    assert [r["step"] for r in again.records][-1] == 20 and "test/Loss" not in again
    # a flush adds many steps at once: the same records as one step at a time, a name first seen midway included
    points = [(31, 3, 3.0, {"lr": 0.1, "train/Loss_step": 2}), (32, 3, 3.5, {}), (33, 3, 4.0, {"train/new_step": 1.5})]
    one_by_one = History()
    for point in points:
        one_by_one.add_values(*point)
    again.add_points(points)
    assert again.records[-3:] == one_by_one.records and again.names[-1] == "train/new_step"
    assert again.series("train/Loss_step")[-1] == (31, 2.0)


DRAIN = textwrap.dedent('''
    import json
    import torch
    import torch.distributed as dist
    from colossal_lite.trainer._series import StepSeries, drain_series

    dist.init_process_group("gloo")
    r = dist.get_rank()
    loss, rate, own = StepSeries(8, "loss"), StepSeries(8, "rate"), StepSeries(8, "lr", average=False)
    for step in (1, 2, 3):
        loss.add(torch.tensor(float(step + 10 * r)), step)  # device values, averaged
        rate.add(float(step * (r + 1)), step)  # host numbers, averaged
        own.add(torch.tensor(float(r)) if step == 2 else 0.5, step)  # not averaged: each rank keeps its own
    print(json.dumps({"rank": r, "points": drain_series([loss, rate, own])}) + "\\n", end="", flush=True)
    dist.destroy_process_group()
''')


def test_draining_averages_only_the_series_that_ask_for_it_over_two_ranks(tmp_path):
    script = tmp_path / "drain.py"
    script.write_text(DRAIN)
    proc = run_ranks(script, nproc=2, timeout=120)
    got = {r["rank"]: r["points"] for r in (json.loads(line) for line in proc.stdout.splitlines()
                                            if line.startswith("{"))}
    for r in (0, 1):
        loss, rate, own = got[r]
        assert loss == [[1, 6.0], [2, 7.0], [3, 8.0]]  # (step + step + 10) / 2
        assert rate == [[1, 1.5], [2, 3.0], [3, 4.5]]  # (step + 2 step) / 2
        assert own == [[1, 0.5], [2, float(r)], [3, 0.5]]


def test_the_metrics_file_is_strict_json_and_reads_back_nan_and_infinities(tmp_path):
    """JSON has no NaN or infinity, and strict readers (JavaScript's, jq) refuse Python's ``NaN``/``Infinity``
    tokens: a NaN is written null and an infinity 1e999, and the reader gives back what the history holds."""
    from colossal_lite.trainer.hooks import BaseHook
    from colossal_lite.utils.metrics_file import read_metrics

    class Odd(BaseHook):
        def after_train_epoch(self, trainer):
            trainer.record_values({"train/none": math.nan, "train/up": math.inf, "train/down": -math.inf,
                                   "train/plain": 0.25})

    _, engine, _, loader = build()
    history = Trainer(engine).fit(loader, epochs=1, hooks=[LossHook(), Odd()], log_dir=tmp_path)

    def refuse(token):
        raise ValueError(f"not JSON: {token}")
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    written = {r["name"]: r["value"] for r in (json.loads(line, parse_constant=refuse) for line in lines)}
    assert written["train/none"] is None and written["train/plain"] == 0.25
    assert written["train/up"] == math.inf and written["train/down"] == -math.inf  # (Python reads 1e999 so)
    back = {r["name"]: r["value"] for r in read_metrics(tmp_path / "metrics.jsonl")}
    assert math.isnan(back["train/none"]) and math.isnan(history.last("train/none"))
    assert (back["train/up"], back["train/down"]) == (history.last("train/up"), history.last("train/down"))
    assert back["train/Loss"] == history.last("train/Loss")


def test_a_later_fit_on_a_loader_of_another_batch_size_goes_on_past_the_same_samples():
    """The later fit's loader, of another batch size, skipped as many of its own batches as the cut fit had run
    (with batches of 16 after 2 of 8: 32 samples where 16 were seen; with 3 batches an epoch, none of the epoch was
    trained; found by a probe). It goes on past the same samples, as a resume from the checkpoint does, or refuses."""
    _, engine, sched, loader = build()
    trainer = Trainer(engine)
    trainer.fit(loader, epochs=2, max_steps=7, hooks=hooks_for(sched), log_dir=False)
    assert (trainer.cur_epoch, trainer.state.batch_idx, trainer.cur_step) == (1, 2, 7)  # 40 samples, 5 batches of 8
    with pytest.raises(ValueError, match=r"the last fit stopped inside epoch 1, after 2 of its 5 batches per rank, "
                                         r"but this loader's epoch has 3, and no whole number of them covers"):
        trainer.fit(get_dataloader(dataset(), shuffle=True, seed=7, batch_size=16), epochs=2, hooks=hooks_for(sched),
                    log_dir=False)
    assert (trainer.cur_epoch, trainer.state.batch_idx, trainer.cur_step) == (1, 2, 7)  # nothing moved
    halves = get_dataloader(dataset(), shuffle=True, seed=7, batch_size=4)
    trainer.fit(halves, epochs=2, hooks=hooks_for(sched), log_dir=False)
    assert (trainer.cur_epoch, trainer.cur_step) == (2, 7 + 6)  # after batch 4 of 10: the 6 batches of 4 left
