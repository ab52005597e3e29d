"""Trainer.fit on a loader without len (an IterableDataset, a generator function): an epoch ends when the
iterator does, and the run equals, bit for bit, the same batches given as a list (issue 29 item 11)."""
import re

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from colossal_lite.engine.accumulation import AccumulationDataLoader, AccumulationWindow
from colossal_lite.engine.engine import Engine
from colossal_lite.trainer import Event, Trainer
from colossal_lite.trainer.hooks import BaseHook, LogMetricByEpochHook, LossHook, SaveCheckpointHook

N = 11  # batches per epoch: windows of 3 are 3+3+3+2, of 4 are 4+4+3 (a partial last window)


def make_batches(n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


class Stream(IterableDataset):
    """Yields the same batches on each pass, and has no __len__."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        yield from self.batches


def unsized(batches, kind="dataloader", window=None):
    loader = DataLoader(Stream(batches), batch_size=None)
    return AccumulationDataLoader(loader, window) if kind == "initialize" else loader


def make_engine(accumulation):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return Engine(model, opt, nn.CrossEntropyLoss(), window=AccumulationWindow(accumulation)), model


def fit(loader_of, accumulation=1, **kwargs):
    """-> (model tensors after fit, trainer); ``loader_of(window)`` builds the train loader."""
    engine, model = make_engine(accumulation)
    trainer = Trainer(engine)
    trainer.fit(loader_of(engine.window), **kwargs)
    return [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())], trainer


def assert_equal(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"tensor {i} differs by {(a - b).abs().max()}"


@pytest.mark.parametrize("kind", ["dataloader", "initialize"])
@pytest.mark.parametrize("accumulation", [1, 3, 4])
def test_epochs_on_an_iterable_equal_the_same_batches_as_a_list(accumulation, kind):
    batches = make_batches()
    want, ref = fit(lambda w: batches, accumulation, epochs=2)
    got, trainer = fit(lambda w: unsized(batches, kind, w), accumulation, epochs=2)
    assert_equal(got, want)  # the partial last window divides by its own size, as with a length
    st = trainer.state
    assert (st.epoch, st.step, st.iteration) == (ref.state.epoch, ref.state.step, ref.state.iteration)
    assert st.steps_per_epoch is None and st.iters_per_epoch is None and st.total_steps is None


@pytest.mark.parametrize("length", [dict(max_steps=20), dict(max_duration="20ba"), dict(max_duration="2ep"),
                                    dict(epochs=3, max_steps=7)])
def test_a_length_in_steps_or_epochs_on_an_iterable(length):
    batches = make_batches()
    want, ref = fit(lambda w: batches, 3, **length)
    got, trainer = fit(lambda w: unsized(batches), 3, **length)
    assert_equal(got, want)
    assert (trainer.state.epoch, trainer.state.step, trainer.state.batch_idx) == \
        (ref.state.epoch, ref.state.step, ref.state.batch_idx)


def test_an_endless_iterable_trains_to_max_steps():
    def endless():
        g = torch.Generator().manual_seed(0)
        while True:
            yield torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)

    class Endless(IterableDataset):
        def __iter__(self):
            return endless()

    _, trainer = fit(lambda w: DataLoader(Endless(), batch_size=None), 2, max_steps=5)
    assert (trainer.state.step, trainer.state.epoch, trainer.state.batch_idx) == (5, 0, 10)


class Events(BaseHook):
    def __init__(self):
        super().__init__()
        self.calls = []


for _event in Event:
    setattr(Events, _event.value, lambda self, trainer, *a, _name=_event.value: self.calls.append(_name))


@pytest.mark.parametrize("test_interval", [1, "2ba", "0.5dur"])
def test_hooks_and_evaluation_are_those_of_the_sized_run(test_interval):
    batches, test = make_batches(5), make_batches(2, seed=1)
    runs = []
    for loader_of in (lambda w: batches, lambda w: unsized(batches)):
        events = Events()
        fit(loader_of, 2, max_steps=7, test_dataloader=test, test_interval=test_interval, hooks=[events, LossHook()])
        runs.append(events.calls)
    assert runs[0] == runs[1]
    assert runs[1].count("before_test") >= 2


def test_progress_counts_batches_without_a_total(capsys):
    fit(lambda w: unsized(make_batches()), 3, epochs=1, display_progress=True)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.search(r"\[Epoch 0 / Train\] 11 batches, [\d.]+ batch/s", line), line
    assert "/11" not in line and "ETA" not in line


def test_what_needs_a_length_is_refused_naming_what_to_give():
    loader = unsized(make_batches())
    with pytest.raises(ValueError) as err:
        fit(lambda w: loader, 1, epochs=2, test_dataloader=make_batches(1), test_interval="0.5dur")
    message = str(err.value)
    assert message.startswith("fit(test_interval='0.5dur'): '0.5dur' is a fraction of the run")
    assert "no len()" in message and "'500ba'" in message and "max_steps" in message and "__len__" in message
    with pytest.raises(ValueError, match=r"LogMetricByEpochHook\(interval='0.5dur'\): .*no len\(\)"):
        fit(lambda w: loader, 1, epochs=2, hooks=[LossHook(), LogMetricByEpochHook(interval="0.5dur")])
    with pytest.raises(ValueError, match=r"SaveCheckpointHook\(interval='\[1ep\]'\): .*steps per epoch.*'500ba'"):
        fit(lambda w: loader, 1, max_steps=3, hooks=[SaveCheckpointHook(["1ep"], "unused-folder")])


def test_a_used_up_generator_is_refused_at_the_empty_epoch():
    def generate():
        yield from make_batches(3)

    with pytest.raises(ValueError, match="yielded no batch in epoch 1.*generator object is used up"):
        fit(lambda w: generate(), 1, epochs=2)


class SaveAt(BaseHook):
    """Saves with the SaveCheckpointHook after chosen micro-batches (inside accumulation windows too)."""

    def __init__(self, at):
        super().__init__(priority=20)
        self.at, self.paths = set(at), []

    def after_train_iter(self, trainer, *args):
        if trainer.state.iteration in self.at:
            saver = next(h for h in trainer.hooks if isinstance(h, SaveCheckpointHook))
            self.paths.append(saver.save(trainer))


def test_resume_inside_an_epoch_skips_the_batches_seen_and_equals_the_uninterrupted_run(tmp_path):
    batches = make_batches()
    want, ref = fit(lambda w: unsized(batches), 3, epochs=2, hooks=[LossHook()])
    at = SaveAt({5, 9, 11, 14, 17})  # mid-window, at a window's end, at the epoch's end, inside epoch 1
    got, _ = fit(lambda w: unsized(batches), 3, epochs=2, hooks=[LossHook(), at,
                                                                 SaveCheckpointHook("1000ba", tmp_path / "ck")])
    assert_equal(got, want)
    assert len(at.paths) == 5
    for path in at.paths:
        resumed, trainer = fit(lambda w: unsized(batches), 3, epochs=2, resume_from=path,
                               hooks=[LossHook(), SaveCheckpointHook("1000ba", tmp_path / f"again-{path.name}")])
        assert_equal(resumed, want)
        assert trainer.cur_step == ref.cur_step
        loss = trainer.states["metrics"]["train"]["Loss"].get_accumulated_value()
        assert loss == pytest.approx(ref.states["metrics"]["train"]["Loss"].get_accumulated_value(), rel=1e-12)


def test_resume_on_a_loader_shorter_than_the_checkpoint_says_is_refused(tmp_path):
    at = SaveAt({9})
    fit(lambda w: unsized(make_batches()), 1, epochs=1, hooks=[at, SaveCheckpointHook("1000ba", tmp_path / "ck")])
    with pytest.raises(RuntimeError, match="resuming inside an epoch at batch 9, but the train_dataloader ended "
                                           "after 4 batches"):
        fit(lambda w: unsized(make_batches(4)), 1, epochs=1, resume_from=at.paths[0])
