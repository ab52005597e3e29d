"""Data drawn at random (augmentation in the main process or in DataLoader workers, a shuffle from torch's generator),
resumed from a checkpoint inside an epoch: the resumed run trains on the inputs of the uninterrupted run and ends
with its parameters, bit for bit (found by the data and resume probe). One process; the workers are real."""
import warnings
from collections import namedtuple

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

import colossal_lite
from colossal_lite.checkpoint import read_checkpoint
from colossal_lite.core import global_context as gpc
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import LossHook, SaveCheckpointHook

N, BATCH = 20, 4  # 5 batches an epoch


pytestmark = pytest.mark.usefixtures("deterministic_algorithms")


class Augmented(Dataset):
    """Each sample gets noise from torch's generator: the main process's, or a worker's."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g)

    def __len__(self):
        return N

    def __getitem__(self, i):
        return self.x[i] + torch.randn(6), self.y[i]


class Stream(IterableDataset):
    """The same samples with fresh noise, and no len."""

    def __iter__(self):
        data = Augmented()
        return (data[i] for i in range(N))


Pair = namedtuple("Pair", "x y")


class Recording(nn.Module):
    """Dropout draws from torch's generator between the batches; every training input is kept."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 3))
        self.inputs = []

    def forward(self, x):
        self.inputs.append(x.detach().clone())
        return self.net(x)


def run(make_loader, ck=None, resume=None, max_steps=None, config=None, trainer=None):
    """-> (inputs trained on, parameters, trainer); ``trainer``: go on with that one (no new process state)."""
    if trainer is None:
        gpc.destroy()
        colossal_lite.launch_from_torch(config=config or {}, seed=5, verbose=False)
        torch.manual_seed(0)
        model = Recording()
        engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.05,
                                                                               momentum=0.9),
                                                        nn.CrossEntropyLoss(), make_loader(), verbose=False)
        trainer = Trainer(engine)
        trainer.loader = loader
        torch.manual_seed(123 if resume else 7)  # (what a resume must not depend on)
    model = trainer.engine.unwrapped_model
    hooks = [LossHook()] + ([SaveCheckpointHook(1, ck)] if ck else [])
    trainer.fit(trainer.loader, epochs=2, max_steps=max_steps, hooks=hooks, resume_from=resume, log_dir=False)
    return list(model.inputs), [p.detach().clone() for p in model.parameters()], trainer


def assert_resumed_exactly(want, got, done, what):
    (want_inputs, want_params), (got_inputs, got_params) = want, got
    rest = want_inputs[done:]
    assert len(got_inputs) == len(rest), what
    differ = [i for i, (a, b) in enumerate(zip(rest, got_inputs)) if not torch.equal(a, b)]
    assert not differ, f"{what}: the inputs of batches {differ} after the resume differ from the uninterrupted run's"
    assert all(torch.equal(a, b) for a, b in zip(want_params, got_params)), f"{what}: the parameters differ"


LOADERS = {
    # a plain DataLoader's workers are seeded from torch's generator when its iterator is made
    "workers": lambda: DataLoader(Augmented(), batch_size=BATCH, num_workers=2),
    # a RandomSampler draws the epoch's order from torch's generator
    "shuffle": lambda: DataLoader(Augmented(), batch_size=BATCH, shuffle=True),
}


@pytest.mark.parametrize("kind", [pytest.param("workers", marks=pytest.mark.slow),  # (workers start each epoch)
                                  "shuffle"])
def test_a_plain_dataloader_with_random_workers_or_shuffle_resumes_mid_epoch_exactly(tmp_path, kind):
    """Resumed inside an epoch, the iterator was made (workers' base seed, the sampler's order) and the batches
    already trained were read from the checkpoint's random state; the uninterrupted run did both at the epoch's
    start from another one, so the rest of the epoch differed (the workers' noise, or the order)."""
    make = LOADERS[kind]
    inputs, params, _ = run(make)
    run(make, ck=tmp_path / "ck", max_steps=7)  # epoch 1, after batch 2 of 5
    got_inputs, got_params, _ = run(make, resume=tmp_path / "ck" / "epoch1-step7")
    assert_resumed_exactly((inputs, params), (got_inputs, got_params), 7, f"a plain DataLoader ({kind})")


@pytest.mark.parametrize("accumulation", [1, 3])
def test_a_loader_without_len_with_augmentation_resumes_mid_epoch_exactly(tmp_path, accumulation):
    """An epoch without len reads ahead of training, so the checkpoint's random state already held the draws of the
    batch read ahead; read again on resume from that state, every later batch took the draws of the one after it.
    The checkpoint keeps the batches read ahead and the resume trains them first."""
    def make():
        return DataLoader(Stream(), batch_size=BATCH)

    config = dict(gradient_accumulation=accumulation) if accumulation > 1 else {}
    steps = 2 if accumulation == 1 else 1  # a step's end inside epoch 0: after 2 batches, or a window of 3
    done = steps * accumulation
    inputs, params, _ = run(make, config=config)
    _, _, cut = run(make, ck=tmp_path / "ck", max_steps=steps, config=config)
    cut.engine.unwrapped_model.inputs.clear()  # a second fit on the trainer cut short continues as a resume does
    got_inputs, got_params, _ = run(make, trainer=cut)
    assert_resumed_exactly((inputs, params), (got_inputs, got_params), done, "continued by a second fit")
    folder = tmp_path / "ck" / f"epoch0-step{steps}"
    _, rank_state = read_checkpoint(folder)
    assert len(rank_state["epoch"]["read_ahead"]) == 1  # one batch read ahead of the step's end
    got_inputs, got_params, _ = run(make, resume=folder, config=config)
    assert_resumed_exactly((inputs, params), (got_inputs, got_params), done, "resumed from a checkpoint")


def test_batches_read_ahead_that_a_checkpoint_cannot_hold_are_read_again_with_a_warning(tmp_path):
    """A batch that is not tensors and plain values (a named tuple) is not kept: the checkpoint is still written,
    and the resume reads the batch again and says that random draws made reading it differ from there on."""
    def make():
        return DataLoader(Stream(), batch_size=BATCH, collate_fn=lambda rows: Pair(*torch.utils.data.default_collate(
            rows)))

    run(make, ck=tmp_path / "ck", max_steps=2)
    folder = tmp_path / "ck" / "epoch0-step2"
    assert read_checkpoint(folder)[1]["epoch"]["read_ahead"] is None
    with pytest.warns(UserWarning, match="the batches read ahead of training at this point of epoch 0 were not kept"):
        got_inputs, _, trainer = run(make, resume=folder)
    assert len(got_inputs) == 2 * N // BATCH - 2 and trainer.cur_step == 2 * N // BATCH


def test_a_resume_with_persistent_workers_warns_that_their_random_streams_differ(tmp_path):
    """Persistent workers are seeded once and carry their streams across epochs: even a resume from an epoch's end
    cannot make them stand where they stood, so the resume says so (rank 0). (A finished run resumed trains
    nothing, so no worker starts here.)"""
    def persistent():
        return DataLoader(Augmented(), batch_size=BATCH, num_workers=1, persistent_workers=True)

    run(LOADERS["shuffle"], ck=tmp_path / "ck")
    with pytest.warns(UserWarning, match="persistent_workers=True: its workers start new random streams"):
        run(persistent, resume=tmp_path / "ck" / "epoch1-step10")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(LOADERS["shuffle"], resume=tmp_path / "ck" / "epoch1-step10")


class SizedStream(Stream):
    """The stream, now with the len it always had."""

    def __len__(self):
        return N


def test_a_checkpoint_of_a_loader_without_len_resumed_on_the_same_data_with_a_len_skips_nothing(tmp_path):
    """The resume read past the batches kept ahead (as a loader without len does) but trained them only in an epoch
    without len: a loader that has a len now lost a batch without a word and then failed, blaming its len (found
    by the checkpoint probe). Its epoch is read from the start again: every batch after the cut is trained."""
    def unsized():
        return DataLoader(Stream(), batch_size=BATCH)

    run(unsized, ck=tmp_path / "ck", max_steps=2)  # epoch 0, after batch 2 of 5, one batch kept ahead
    inputs, _, trainer = run(lambda: DataLoader(SizedStream(), batch_size=BATCH), resume=tmp_path / "ck" / "last")
    assert trainer.cur_step == 10 and len(inputs) == 8  # the 3 batches left of epoch 0 and the 5 of epoch 1
