"""SaveCheckpointHook / LoadCheckpointHook / fit(resume_from=...): contents, intervals, retention, best, legacy loading."""
import json
import os
import tempfile

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import colossal_lite
from colossal_lite.checkpoint import CheckpointError, CheckpointManager, CheckpointNotFoundError, read_checkpoint
from colossal_lite.core import global_context as gpc
from colossal_lite.trainer import TestModeFailed, Trainer
from colossal_lite.trainer.hooks import (
    BaseHook,
    EarlyStoppingHook,
    LoadCheckpointHook,
    LossHook,
    LRSchedulerHook,
    SaveCheckpointHook,
)
from colossal_lite.utils import get_dataloader, save_checkpoint

CONFIG = dict(gradient_accumulation=2)


@pytest.fixture(autouse=True)
def clean():
    yield
    gpc.destroy()


def build(n=40):
    """40 samples in batches of 4 with accumulation 2: 10 micro-batches, 5 optimizer steps per epoch."""
    gpc.destroy()
    colossal_lite.launch_from_torch(config=CONFIG, seed=5, verbose=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.8)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
    engine, loader, _, sched = colossal_lite.initialize(model, opt, nn.CrossEntropyLoss(),
                                                        get_dataloader(data, shuffle=True, batch_size=4),
                                                        lr_scheduler=sched, verbose=False)
    return model, engine, loader, sched


def eval_loader():
    g = torch.Generator().manual_seed(9)
    return DataLoader(TensorDataset(torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g)),
                      batch_size=4)


def fit(hooks=lambda sched, model: [], epochs=2, **kwargs):
    model, engine, loader, sched = build()
    trainer = Trainer(engine)
    trainer.fit(loader, epochs=epochs, hooks=[LossHook(), LRSchedulerHook(sched, by_epoch=False)] + hooks(sched, model),
                **kwargs)
    return model, trainer


def names(folder):
    """The checkpoints and pointers of a folder (not the run's metrics.jsonl beside them)."""
    return sorted((n for n in os.listdir(folder) if n != "metrics.jsonl"), key=lambda n: (n in ("best", "last"), int(n.split("step")[1].split("-")[0])
                                                    if n.startswith("epoch") else 0, n))


def same_params(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


class Extra(BaseHook):
    """Adds its own entries to each checkpoint (shared and per rank) and reads them back."""

    def __init__(self):
        super().__init__()
        self.read = None

    def on_save_checkpoint(self, trainer, checkpoint):
        checkpoint["hooks"]["extra"] = {"saved_at_step": trainer.cur_step}
        checkpoint["rank_state"]["hooks"]["extra"] = torch.tensor([trainer.cur_step])

    def on_load_checkpoint(self, trainer, checkpoint):
        self.read = (checkpoint["hooks"]["extra"], checkpoint["rank_state"]["hooks"]["extra"].tolist())


# -- what a checkpoint holds -------------------------------------------------------------------
def test_a_checkpoint_holds_the_whole_run_and_hooks_add_their_own_entries(tmp_path):
    ck = tmp_path / "ck"
    extra = Extra()
    fit(lambda s, m: [EarlyStoppingHook("train/Loss", patience=9), extra, SaveCheckpointHook(1, ck)])
    assert names(ck) == ["epoch0-step5", "epoch1-step10", "last"]  # named after the epoch that ended
    shared, rank = read_checkpoint(ck / "epoch0-step5")
    assert set(shared) == {"engine", "lr_schedulers", "trainer", "hooks", "colossal_lite"}
    assert set(shared["engine"]) == {"model", "optimizer", "optimizer_class", "precision", "accumulation",
                                     "num_updates"}
    assert shared["engine"]["optimizer_class"] == "SGD"
    assert shared["engine"]["num_updates"] == 5 and shared["engine"]["optimizer"]["state"]  # momentum buffers
    assert shared["lr_schedulers"]["LRSchedulerHook.0"]["seen_updates"] == 5
    assert shared["trainer"]["progress"] == {"epoch": 1, "step": 5, "iteration": 10, "batch_idx": 0}
    assert set(shared["trainer"]["hooks"]["EarlyStoppingHook.0"]) == {"best", "best_epoch", "wait"}
    assert shared["hooks"] == {"extra": {"saved_at_step": 5}}
    assert shared["colossal_lite"] == {"version": colossal_lite.__version__, "world_size": 1, "format": 1,
                                       "batches_per_epoch": 10}
    assert set(rank["rng"]) >= {"python", "torch"}
    assert rank["data"]["sampler"] == {"epoch": 1, "offset": 0}
    assert rank["hooks"]["extra"].tolist() == [5]
    meta = json.loads((ck / "epoch0-step5" / "meta.json").read_text())
    assert (meta["epoch"], meta["step"], meta["config"]["gradient_accumulation"]) == (0, 5, 2)
    assert set(meta["metrics"]) == {"train/Loss", "train/LR"}  # a whole epoch's train metrics, no evaluation
    # the hook reads its entries back on resume (fit(resume_from=a folder))
    extra2 = Extra()
    fit(lambda s, m: [EarlyStoppingHook("train/Loss", patience=9), extra2], epochs=1, resume_from=ck / "epoch0-step5")
    assert extra2.read == ({"saved_at_step": 5}, [5])


# -- intervals ---------------------------------------------------------------------------------
@pytest.mark.parametrize("interval,save_by_iter,expected", [
    (2, False, ["epoch1-step10", "epoch3-step20"]),  # every 2 epochs
    ("2ep", False, ["epoch1-step10", "epoch3-step20"]),
    (3, True, ["epoch0-step3", "epoch1-step6", "epoch1-step9", "epoch2-step12", "epoch2-step15", "epoch3-step18",
               "epoch3-step20"]),  # every 3 optimizer steps, plus the final one
    ("7ba", False, ["epoch1-step7", "epoch2-step14", "epoch3-step20"]),
    ("0.5dur", False, ["epoch1-step10", "epoch3-step20"]),  # half of the run's 20 steps
])
def test_intervals_count_epochs_or_optimizer_steps(tmp_path, interval, save_by_iter, expected):
    fit(lambda s, m: [SaveCheckpointHook(interval, tmp_path / "ck", save_by_iter=save_by_iter)], epochs=4)
    assert names(tmp_path / "ck") == expected + ["last"]
    assert (tmp_path / "ck" / "last").read_text().strip() == expected[-1]


def test_wrong_arguments_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"SaveCheckpointHook\(checkpoint_dir=None\): give the folder the checkpoints "
                                         r"go to, e.g. SaveCheckpointHook\(checkpoint_dir='runs/ck'\)"):
        SaveCheckpointHook(1)
    with pytest.raises(ValueError, match=r"save_by_iter counts optimizer steps, but the interval is in epochs; use "
                                         r"interval='500ba' or an int"):
        SaveCheckpointHook("2ep", "ck", save_by_iter=True)
    with pytest.raises(ValueError, match=r"SaveCheckpointHook\(interval='2 weeks'\): invalid time '2 weeks'"):
        SaveCheckpointHook("2 weeks", "ck")
    with pytest.raises(ValueError, match=r"save_best='Loss'\): use None or \(metric, 'min' \| 'max'\)"):
        SaveCheckpointHook(1, "ck", save_best="Loss")
    with pytest.raises(ValueError, match=r"keep_last_n=0\): use None \(keep all\) or an int >= 1"):
        SaveCheckpointHook(1, "ck", keep_last_n=0)


def test_model_argument_must_be_the_engines_model(tmp_path):
    with pytest.raises(ValueError, match=r"SaveCheckpointHook\(model=...\) is not the engine's model"):
        fit(lambda s, m: [SaveCheckpointHook(1, tmp_path / "ck", model=nn.Linear(2, 2))])
    fit(lambda s, m: [SaveCheckpointHook(1, tmp_path / "ck2", model=m)], epochs=1)  # legacy: model=model is fine
    assert names(tmp_path / "ck2") == ["epoch0-step5", "last"]


# -- retention and best ------------------------------------------------------------------------
def _metas(folder):
    return {p.name: json.loads((p / "meta.json").read_text()) for p in CheckpointManager(folder).list_checkpoints()}


@pytest.mark.slow  # takes seconds without starting a process
def test_retention_keeps_exactly_the_newest_and_best_and_best_survives_a_resume(tmp_path):
    every = dict(test_dataloader=eval_loader(), test_interval="2ba", epochs=3)
    # the reference: every checkpoint kept, so the best one can be found by reading them all
    fit(lambda s, m: [SaveCheckpointHook("1ba", tmp_path / "all", save_best=("Loss", "min"))], **every)
    metas = _metas(tmp_path / "all")
    scored = {n: m["metrics"]["Loss"] for n, m in metas.items() if m["metrics"]["Loss"] is not None}
    assert len(scored) == 8  # test Loss right after each of the 7 evaluations at 2, 4, ..., 14 and at the end (15)
    assert all(m["metrics"]["Loss"] == m["metrics"].get("test/Loss") for m in metas.values() if m["metrics"]["Loss"])
    best = min(scored, key=scored.get)
    assert (tmp_path / "all" / "best").read_text().strip() == best

    # the same run with keep_last_n=2, stopped after 9 steps and resumed
    hook = lambda s, m: [SaveCheckpointHook("1ba", tmp_path / "kept", save_best=("Loss", "min"), keep_last_n=2)]  # noqa
    fit(hook, max_steps=9, **every)
    first = names(tmp_path / "kept")
    kept_best = (tmp_path / "kept" / "best").read_text().strip()
    assert first == sorted({kept_best, "epoch1-step8", "epoch1-step9"}, key=lambda n: int(n.split("step")[1])) \
        + ["best", "last"]
    fit(hook, resume_from="auto", **every)
    assert (tmp_path / "kept" / "best").read_text().strip() == best  # compared with the best of before the resume
    assert names(tmp_path / "kept") == sorted({best, "epoch2-step14", "epoch2-step15"},
                                              key=lambda n: int(n.split("step")[1])) + ["best", "last"]


# -- fit(resume_from=...) ----------------------------------------------------------------------
def test_resume_from_needs_a_place_to_look_and_auto_starts_fresh_when_there_is_nothing(tmp_path, capfd):
    with pytest.raises(ValueError, match=r"fit\(resume_from='auto'\) looks for checkpoints in the checkpoint_dir of a "
                                         r"SaveCheckpointHook, and hooks has none"):
        fit(resume_from="auto")
    with pytest.raises(CheckpointNotFoundError, match=r"no 'last' checkpoint in .*ck: .*last does not exist"):
        fit(lambda s, m: [SaveCheckpointHook(1, tmp_path / "ck")], resume_from="last")
    with pytest.raises(CheckpointNotFoundError, match=r"checkpoint .*nowhere does not exist"):
        fit(resume_from=tmp_path / "nowhere")
    model, trainer = fit(lambda s, m: [SaveCheckpointHook(1, tmp_path / "ck")], resume_from="auto")
    assert "resume_from='auto': no checkpoint in" in capfd.readouterr().out
    assert trainer.cur_step == 10
    again, trainer = fit(lambda s, m: [SaveCheckpointHook(1, tmp_path / "ck")], epochs=3, resume_from="last")
    assert trainer.cur_step == 15 and "resumed from" in capfd.readouterr().out
    longer, _ = fit(epochs=3)
    assert same_params(again, longer)


def test_resume_from_a_run_folder_without_a_last_pointer_takes_its_newest_checkpoint(tmp_path, capfd):
    """A run saved with save_last=False: its folder stands for its newest complete checkpoint, as with 'auto'
    (it said the folder was no complete checkpoint), and the log names the one taken."""
    fit(lambda s, m: [SaveCheckpointHook(1, tmp_path / "ck", save_last=False)], epochs=2)
    assert "last" not in names(tmp_path / "ck")
    _, trainer = fit(epochs=3, resume_from=tmp_path / "ck")
    assert trainer.cur_step == 15 and f"resumed from {tmp_path / 'ck' / 'epoch1-step10'}" in capfd.readouterr().out


def test_a_missing_checkpoint_is_named_once_when_it_is_the_checkpoint_dir_itself(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointNotFoundError) as caught:
        fit(resume_from="runs/ck")
    assert str(caught.value) == "checkpoint runs/ck does not exist"  # it added "(also looked for runs/ck/runs/ck)"
    with pytest.raises(CheckpointNotFoundError, match=r"does not exist \(also looked for .*ck/epoch9-step9\)"):
        CheckpointManager(tmp_path / "ck", cleanup=False).resolve("epoch9-step9")  # a name inside another folder


def test_a_file_of_a_checkpoint_folder_says_to_give_the_folder(tmp_path):
    fit(lambda s, m: [SaveCheckpointHook(1, tmp_path / "ck")], epochs=1)
    folder = tmp_path / "ck" / "epoch0-step5"
    with pytest.raises(CheckpointError) as caught:
        fit(resume_from=folder / "shared.pt")
    assert f"{folder / 'shared.pt'} is one file of the checkpoint folder {folder}" in str(caught.value)
    assert f"give the folder instead ('{folder}')" in str(caught.value)
    # the legacy hook said "is not a save_checkpoint file: it has no 'model' entry" (found by the checkpoint probe)
    with pytest.raises(CheckpointError, match=r"rank0\.pt is one file of the checkpoint folder .*give the folder"):
        fit(lambda s, m: [LoadCheckpointHook(str(folder / "rank0.pt"))])


# -- LoadCheckpointHook (legacy) ----------------------------------------------------------------
def test_load_checkpoint_hook_latest_or_given_epoch_continues_the_run(tmp_path):
    fit(lambda s, m: [SaveCheckpointHook(1, tmp_path / "ck")], epochs=2)
    want, _ = fit(epochs=3)
    latest, trainer = fit(lambda s, m: [LoadCheckpointHook(tmp_path / "ck")], epochs=3)  # epoch=-1: the latest
    assert same_params(latest, want) and trainer.cur_step == 15
    from_0, trainer = fit(lambda s, m: [LoadCheckpointHook(tmp_path / "ck", epoch=0)], epochs=3)  # after epoch 0
    assert same_params(from_0, want) and trainer.cur_step == 15
    with pytest.raises(CheckpointNotFoundError, match=r"LoadCheckpointHook\(epoch=7\): no checkpoint of epoch 7 in "
                                                      r".*ck; it has epochs \[0, 1\]"):
        fit(lambda s, m: [LoadCheckpointHook(tmp_path / "ck", epoch=7)])
    with pytest.raises(FileNotFoundError, match=r"LoadCheckpointHook: .*missing does not exist"):
        fit(lambda s, m: [LoadCheckpointHook(tmp_path / "missing")])


class Probe(BaseHook):
    """Records the model weights and optimizer state when training starts."""

    def __init__(self):
        super().__init__(priority=5)

    def before_train_epoch(self, trainer):
        if not hasattr(self, "weights"):
            self.weights = [p.detach().clone() for p in trainer.engine.unwrapped_model.parameters()]
            self.optimizer_state = len(trainer.engine.optimizer.state)
            self.start = (trainer.cur_epoch, trainer.cur_step)


def test_load_checkpoint_hook_finetune_loads_weights_only_and_starts_from_zero(tmp_path):
    trained, _ = fit(lambda s, m: [SaveCheckpointHook(1, tmp_path / "ck")], epochs=2)
    probe = Probe()
    _, trainer = fit(lambda s, m: [LoadCheckpointHook(tmp_path / "ck", finetune=True), probe], epochs=1)
    assert all(torch.equal(a, b) for a, b in zip(probe.weights, trained.parameters()))
    assert probe.optimizer_state == 0 and probe.start == (0, 0)  # no momentum buffers; progress from the start
    assert trainer.cur_step == 5


def test_load_checkpoint_hook_reads_a_legacy_single_file(tmp_path):
    trained, trainer = fit(epochs=1)
    scheduler = next(h.lr_scheduler for h in trainer.hooks if isinstance(h, LRSchedulerHook))
    save_checkpoint(tmp_path / "legacy.pt", 0, trained, trainer.engine.optimizer, scheduler)
    probe = Probe()
    fit(lambda s, m: [LoadCheckpointHook(tmp_path / "legacy.pt"), probe], epochs=2)
    assert all(torch.equal(a, b) for a, b in zip(probe.weights, trained.parameters()))
    assert probe.optimizer_state > 0 and probe.start == (1, 5)  # the file holds finished epoch 0: epoch 1 is next


# -- test mode ---------------------------------------------------------------------------------
def _test_mode_folders():
    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("colossal_lite-test-mode-")}


def test_test_mode_runs_a_checkpoint_round_trip_and_leaves_nothing_behind(tmp_path):
    before = _test_mode_folders()
    _, engine, loader, sched = build()
    trainer = Trainer(engine)
    trainer.fit(loader, epochs=1, test_mode=True, hooks=[LossHook(), LRSchedulerHook(sched, by_epoch=False), Extra(),
                                                          SaveCheckpointHook(1, tmp_path / "ck")])
    result = trainer.test_mode_result
    assert result.ok and result.checkpoint.startswith("checkpoint round trip OK (")
    assert ", checkpoint round trip OK (" in str(result) and str(result).endswith("loss finite: OK")
    assert not (tmp_path / "ck").exists()  # test mode writes nothing into the run's folder
    assert _test_mode_folders() == before


class Unstorable(BaseHook):
    def on_save_checkpoint(self, trainer, checkpoint):
        checkpoint["hooks"]["bad"] = object()


def test_test_mode_reports_a_failed_round_trip():
    before = _test_mode_folders()
    _, engine, loader, _ = build()
    with pytest.raises(TestModeFailed) as failed:
        Trainer(engine).fit(loader, epochs=1, test_mode=True, hooks=[LossHook(), Unstorable()])
    result = failed.value.result
    assert not result.ok
    assert "checkpoint round trip FAILED (UnsupportedValueError: cannot store shared_state['hooks']['bad'] in a " \
           "checkpoint: a builtins.object is not a tensor or a plain Python value" in str(result)
    assert str(result).endswith("loss finite: FAILED (the checkpoint round trip failed)")
    assert _test_mode_folders() == before


# -- a list of steps (issue 23) ----------------------------------------------------------------
@pytest.mark.parametrize("interval,expected", [
    ([3, 8, 15], ["epoch0-step3", "epoch1-step8", "epoch2-step15", "epoch3-step20"]),  # plus the final one
    ((8, 3), ["epoch0-step3", "epoch1-step8", "epoch3-step20"]),  # any order
    (["0.65dur", "3ep", "2ba"], ["epoch0-step2", "epoch2-step13", "epoch2-step15", "epoch3-step20"]),
    ([4, 20], ["epoch0-step4", "epoch3-step20"]),  # the last step listed: written once
])
def test_a_list_saves_at_exactly_those_optimizer_steps(tmp_path, interval, expected):
    fit(lambda s, m: [SaveCheckpointHook(interval, tmp_path / "ck")], epochs=4)  # 20 optimizer steps
    assert names(tmp_path / "ck") == expected + ["last"]
    for name in expected:
        assert (tmp_path / "ck" / name / "meta.json").is_file()
    assert (tmp_path / "ck" / "last").read_text().strip() == expected[-1]


def test_a_list_of_steps_goes_on_after_a_resume(tmp_path):
    ck = tmp_path / "ck"
    fit(lambda s, m: [SaveCheckpointHook([3, 8, 15], ck)], epochs=2)  # stops at step 10
    assert names(ck) == ["epoch0-step3", "epoch1-step8", "epoch1-step10", "last"]
    fit(lambda s, m: [SaveCheckpointHook([3, 8, 15], ck)], epochs=4, resume_from=ck / "epoch1-step8")
    assert names(ck) == ["epoch0-step3", "epoch1-step8", "epoch1-step10", "epoch2-step15", "epoch3-step20", "last"]


def test_a_wrong_list_is_refused():
    with pytest.raises(ValueError, match=r"SaveCheckpointHook\(interval=\[\]\): the list of steps is empty"):
        SaveCheckpointHook([], "ck")
    with pytest.raises(ValueError, match=r"SaveCheckpointHook\(interval=\[0, 5\]\): invalid time 0"):
        SaveCheckpointHook([0, 5], "ck")
    assert repr(SaveCheckpointHook([200, "0.5dur"], "ck")) == \
        "SaveCheckpointHook(interval='[200ba, 0.5dur]', checkpoint_dir='ck')"
