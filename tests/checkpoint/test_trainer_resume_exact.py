"""A run resumed from a trainer checkpoint ends with the parameters of the uninterrupted run, bit for bit.

Each case trains once without checkpoints, once with a SaveCheckpointHook saving at every optimizer
step (which must not change the run), then resumes fresh runs from checkpoints taken between epochs,
mid-epoch, right after an evaluation, inside an accumulation window and with fp16 loss scaling.
The model has dropout (the RNG must be restored), the loader shuffles (the data order must be), the
optimizer is AdamW and the LR schedule moves per step or per epoch. 2 ranks: test_preemption.py.
"""
import json

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import colossal_lite
from colossal_lite.amp import AMP_TYPE
from colossal_lite.checkpoint import CheckpointError, read_checkpoint
from colossal_lite.core import global_context as gpc
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import BaseHook, EarlyStoppingHook, LossHook, LRSchedulerHook, SaveCheckpointHook
from colossal_lite.utils import get_dataloader

pytestmark = pytest.mark.usefixtures("deterministic_algorithms")


class Counting(Dataset):
    """A dataset that counts the samples it loads."""

    def __init__(self, n=44):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 6, generator=g) * 3, torch.randint(0, 3, (n,), generator=g)
        self.loaded = 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.loaded += 1
        return self.x[i], self.y[i]


def build(config, by_epoch=False):
    gpc.destroy()
    colossal_lite.launch_from_torch(config=config, seed=5, verbose=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1 if by_epoch else 3, gamma=0.7)
    data = Counting()
    loader = get_dataloader(data, shuffle=True, seed=3, batch_size=4)
    engine, loader, _, sched = colossal_lite.initialize(model, opt, nn.CrossEntropyLoss(), loader, lr_scheduler=sched,
                                                        verbose=False)
    return model, engine, loader, sched, data


def train(config, ck=None, resume=None, by_epoch=False, test=False, extra=lambda: [], interval="1ba"):
    model, engine, loader, sched, data = build(config, by_epoch)
    hooks = [LossHook(), LRSchedulerHook(sched, by_epoch=by_epoch),
             EarlyStoppingHook("train/Loss", patience=100)] + extra()
    if ck is not None:
        hooks.append(SaveCheckpointHook(interval, ck))
    test_loader = None
    if test:  # a plain DataLoader: each evaluation draws from the global RNG when it starts
        g = torch.Generator().manual_seed(9)
        test_loader = DataLoader(TensorDataset(torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g)),
                                 batch_size=5, shuffle=True)
    trainer = Trainer(engine)
    trainer.fit(loader, epochs=3, hooks=hooks, resume_from=resume, test_dataloader=test_loader,
                test_interval="4ba" if test else 1)
    return [p.detach().clone() for p in model.parameters()], engine, trainer, data


def assert_same(got, want, what):
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{what}: parameter {i} differs from the uninterrupted run by {(a - b).abs().max()}"


def saved(ck):
    """Checkpoint folders in the order they were written."""
    from colossal_lite.checkpoint import CheckpointManager

    return CheckpointManager(ck).list_checkpoints()


CASES = {
    "fp32": dict(config={}, pick=lambda n: [0, 7, 10, 11, 12, 21, n - 2]),
    "accumulation-3+fp16": dict(config=dict(gradient_accumulation=3,
                                            fp16=dict(mode=AMP_TYPE.TORCH, init_scale=2.0**16, growth_interval=3)),
                                pick=lambda n: [0, 2, 3, 4, 6, n - 2]),
    "by-epoch-schedule+evaluation": dict(config={}, by_epoch=True, test=True, pick=lambda n: [2, 3, 4, 10, 11, 20]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow  # takes seconds without starting a process
def test_resume_from_any_step_or_epoch_boundary_equals_the_uninterrupted_run(tmp_path, case):
    spec = CASES[case]
    opts = dict(by_epoch=spec.get("by_epoch", False), test=spec.get("test", False))
    want, ref_engine, ref_trainer, _ = train(spec["config"], **opts)
    got, engine, trainer, _ = train(spec["config"], ck=tmp_path / "ck", **opts)
    assert_same(got, want, "a run saving a checkpoint at every step")
    if "fp16" in case:  # some steps overflowed and were skipped: the scaler state matters
        assert ref_engine.num_updates < ref_trainer.cur_step, (ref_engine.num_updates, ref_trainer.cur_step)
    folders = saved(tmp_path / "ck")
    assert len(folders) == trainer.cur_step  # one per step; epoch ends coincide with a step
    chosen = [folders[i] for i in spec["pick"](len(folders))]
    kinds = set()
    for folder in chosen:
        shared, _ = read_checkpoint(folder)
        progress = shared["trainer"]["progress"]
        kinds.add("between epochs" if progress["batch_idx"] == 0 else "mid-epoch")
        resumed, _, resumed_trainer, _ = train(spec["config"], ck=tmp_path / f"again-{folder.name}", resume=folder, **opts)
        assert_same(resumed, want, f"resumed from {folder.name} ({progress})")
        assert resumed_trainer.cur_step == ref_trainer.cur_step
        # the last epoch's loss covers the whole epoch, also when the run resumed inside it
        assert last_train_loss(resumed_trainer) == pytest.approx(last_train_loss(ref_trainer), rel=1e-12), folder.name
    assert kinds == {"between epochs", "mid-epoch"}


def last_train_loss(trainer):
    return trainer.states["metrics"]["train"]["Loss"].get_accumulated_value()


class SaveInsideWindow(BaseHook):
    """Saves with the SaveCheckpointHook at chosen micro-batches, inside an accumulation window."""

    def __init__(self, at):
        super().__init__(priority=20)
        self.at, self.paths = set(at), []

    def after_train_iter(self, trainer, *args):
        if trainer.state.iteration in self.at:
            assert not trainer.engine.window.at_start
            saver = next(h for h in trainer.hooks if isinstance(h, SaveCheckpointHook))
            self.paths.append(saver.save(trainer))


def test_resume_inside_an_accumulation_window_equals_the_uninterrupted_run(tmp_path):
    config = dict(gradient_accumulation=3, fp16=dict(mode=AMP_TYPE.TORCH, init_scale=2.0**16, growth_interval=3))
    want, *_ = train(config)
    inside = SaveInsideWindow(at={5, 13, 23})  # epoch 0 micro-batch 5 (2 of 3), epoch 1 micro-batches 2 and 1
    got, *_ = train(config, ck=tmp_path / "ck", extra=lambda: [inside], interval="1000ba")
    assert_same(got, want, "a run saving inside accumulation windows")
    assert len(inside.paths) == 3
    for path in inside.paths:
        shared, rank_state = read_checkpoint(path)
        assert shared["engine"]["accumulation"]["micro_step"] in (1, 2)
        assert len(rank_state["engine"]["window_grads"]) == 4  # the gradients gathered so far, this rank's own
        resumed, *_ = train(config, ck=tmp_path / f"again-{path.name}", resume=path, interval="1000ba")
        assert_same(resumed, want, f"resumed inside a window from {path.name}")


def test_resuming_mid_epoch_loads_only_the_samples_not_yet_seen(tmp_path):
    train({}, ck=tmp_path / "ck", interval="1000ba")  # a final checkpoint only
    first = saved(tmp_path / "ck")
    assert [p.name for p in first] == ["epoch2-step33"]
    _, _, trainer, data = train({}, ck=tmp_path / "ck2", interval="9ba")
    mid = [p for p in saved(tmp_path / "ck2") if p.name == "epoch2-step27"][0]  # 5 of the epoch's 11 batches done
    meta = json.loads((mid / "meta.json").read_text())
    assert (meta["epoch"], meta["step"]) == (2, 27)
    _, _, resumed, data = train({}, resume=mid)
    assert resumed.cur_step == 33
    assert data.loaded == 44 - 5 * 4  # the 24 samples of the 6 batches left; the 20 seen are never loaded


def test_a_run_stopped_by_max_steps_inside_an_epoch_resumes_exactly_with_a_per_epoch_schedule(tmp_path):
    want, *_ = train({}, by_epoch=True)
    train_until = 16  # epoch 1, micro-batch 5 of 11: the final checkpoint is taken before the cut epoch's end events
    model, engine, loader, sched, _ = build({}, by_epoch=True)
    Trainer(engine).fit(loader, epochs=3, max_steps=train_until, hooks=[
        LossHook(), LRSchedulerHook(sched, by_epoch=True), EarlyStoppingHook("train/Loss", patience=100),
        SaveCheckpointHook(1, tmp_path / "ck")])
    assert [p.name for p in saved(tmp_path / "ck")] == ["epoch0-step11", "epoch1-step16"]
    resumed, *_ = train({}, ck=tmp_path / "ck", by_epoch=True, resume="auto", interval=1)
    assert_same(resumed, want, "resumed after a max_steps stop inside epoch 1")


class Jittered(Counting):
    """An augmentation drawn from the global RNG in the main process (num_workers=0), as torchvision's do."""

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x + 0.1 * torch.randn(x.shape), y


@pytest.mark.parametrize("dataset", [Counting, Jittered], ids=["plain-dataset", "augmented-dataset"])
@pytest.mark.slow  # takes seconds without starting a process
def test_a_plain_dataloader_resumes_mid_epoch_exactly(tmp_path, dataset):
    """A plain DataLoader (no shuffle) draws its base seed from torch's generator when an iteration starts, and
    an augmented dataset draws per sample: resumed mid-epoch, the new iterator's draw and the skipped batches'
    draws came after the restored generator state, so dropout took other masks from there on (found by a probe;
    get_dataloader's loaders draw nothing from it)."""
    def run(ck=None, resume=None, max_steps=None):
        gpc.destroy()
        colossal_lite.launch_from_torch(config={}, seed=5, verbose=False)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 3))
        engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.AdamW(model.parameters(), lr=0.01),
                                                        nn.CrossEntropyLoss(), DataLoader(dataset(), batch_size=4),
                                                        verbose=False)
        hooks = [LossHook()] + ([SaveCheckpointHook(1, ck)] if ck else [])
        torch.manual_seed(123 if resume else 7)  # (what the resume must not depend on)
        Trainer(engine).fit(loader, epochs=2, max_steps=max_steps, hooks=hooks, resume_from=resume)
        return [t.detach().clone() for t in model.state_dict().values()]

    want = run()
    run(ck=tmp_path / "ck", max_steps=16)  # epoch 1, batch 5 of 11
    assert [p.name for p in saved(tmp_path / "ck")] == ["epoch0-step11", "epoch1-step16"]
    got = run(resume=tmp_path / "ck" / "epoch1-step16")
    assert_same(got, want, "resumed mid-epoch on a plain DataLoader")


@pytest.mark.slow  # takes seconds without starting a process
def test_a_mid_epoch_checkpoint_resumed_with_another_batch_size_goes_on_past_the_same_samples(tmp_path):
    """Resumed with batches of another size, a checkpoint inside an epoch went on after as many batches of the new
    size: it skipped the rest of the epoch (larger batches) or trained part of it twice (smaller ones), without a
    word (found by a probe). It goes on past the same samples where a whole number of the new batches covers them,
    and is refused before anything is loaded where none does; a checkpoint at an epoch's end resumes with any size."""
    def run(size, ck, resume=None, max_steps=None):
        gpc.destroy()
        colossal_lite.launch_from_torch(config={}, seed=5, verbose=False)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        data = Counting()
        engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                                        nn.CrossEntropyLoss(),
                                                        get_dataloader(data, shuffle=True, seed=3, batch_size=size),
                                                        verbose=False)
        trainer = Trainer(engine)
        trainer.fit(loader, epochs=2, max_steps=max_steps, hooks=[LossHook(), SaveCheckpointHook(1, ck)],
                    resume_from=resume)
        return trainer, data

    run(4, tmp_path / "ck", max_steps=16)  # 44 samples in batches of 4: epoch 1, after batch 5 of 11 (20 samples)
    mid, end = tmp_path / "ck" / "epoch1-step16", tmp_path / "ck" / "epoch0-step11"
    assert [p.name for p in saved(tmp_path / "ck")] == [end.name, mid.name]
    trainer, data = run(2, tmp_path / "halves", resume=mid)  # after batch 10 of 22: the same 20 samples
    assert data.loaded == 44 - 20 and trainer.cur_step == 16 + 12 and trainer.cur_epoch == 2
    # the run's length, which the ETA and a schedule's length check read, counts the steps epoch 0 took in batches
    # of 4 (it took 2 epochs of 22 batches of 2 instead: found by the outputs probe)
    assert trainer.state.total_steps == trainer.cur_step
    with pytest.raises(CheckpointError) as err:
        run(8, tmp_path / "other", resume=mid)  # 6 batches an epoch: none covers 20 samples
    assert str(err.value) == (
        f"checkpoint {mid} was taken inside an epoch, after 5 of its 11 batches per rank (1 rank(s)), but this run's "
        f"epoch has 6 batches per rank (1 rank(s)), and no whole number of them covers the samples already trained, "
        f"so the rest of the epoch would be skipped or repeated. Fix: resume with the batch size and number of ranks "
        f"the checkpoint was taken with, or from a checkpoint taken at an epoch's end")
    assert not (tmp_path / "other").exists() or not saved(tmp_path / "other")  # refused before any step
    trainer, _ = run(8, tmp_path / "other2", resume=end)  # the epoch's end: the next one starts afresh
    assert trainer.cur_step == 11 + 6 and trainer.cur_epoch == 2 and trainer.state.total_steps == 17
