"""Legacy v0.1's per-epoch checkpoint files (issue 29, item 13): ColossalAI-Examples' SimCLR linear evaluation
reads ``torch.load(f'{dir}/epoch{N}-tp0-pp0.pt')['model']``. ``SaveCheckpointHook(1, get_checkpoint_path(dir,
'{epoch}'))`` writes those files, and the legacy path helpers find them."""
import os

import pytest
import torch
from torch import nn

import colossal_lite
from colossal_lite.core import global_context as gpc
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import BaseHook, LoadCheckpointHook, LossHook, SaveCheckpointHook
from colossal_lite.utils import get_checkpoint_path, get_latest_checkpoint_path


@pytest.fixture(autouse=True)
def launched():
    colossal_lite.launch_from_torch(config={}, seed=1, verbose=False)
    yield
    gpc.destroy()


class Snapshot(BaseHook):  # the weights at the end of each epoch
    def __init__(self):
        super().__init__(priority=100)
        self.weights = []

    def after_train_epoch(self, trainer):
        self.weights.append({k: v.clone() for k, v in trainer.engine.unwrapped_model.state_dict().items()})


def test_one_file_per_epoch_that_a_legacy_reader_loads(tmp_path):
    folder = tmp_path / "ckpt"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(3)]
    engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                    nn.CrossEntropyLoss(), batches, verbose=False)
    snapshot = Snapshot()
    Trainer(engine).fit(loader, epochs=3, hooks=[LossHook(), snapshot,
                                                 SaveCheckpointHook(1, get_checkpoint_path(folder, "{epoch}"))])
    assert sorted(os.listdir(folder)) == ["epoch0-tp0-pp0.pt", "epoch1-tp0-pp0.pt", "epoch2-tp0-pp0.pt"]
    for epoch in range(3):
        saved = torch.load(get_checkpoint_path(folder, epoch))  # the legacy reader: torch.load(...)['model']
        assert saved["epoch"] == epoch
        assert saved["model"].keys() == snapshot.weights[epoch].keys()
        assert all(torch.equal(saved["model"][k], v) for k, v in snapshot.weights[epoch].items())
    assert get_latest_checkpoint_path(folder) == str(folder / "epoch2-tp0-pp0.pt")


def test_latest_path_names_the_folder_when_there_is_no_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no checkpoint file epoch<N>-tp0-pp0.pt in {tmp_path}"):
        get_latest_checkpoint_path(tmp_path)


def _run(epochs, hooks, seed=0):
    """A small legacy trainer program; the model after ``fit(epochs)`` with ``hooks``."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(3)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine, loader, _, _ = colossal_lite.initialize(model, optimizer, nn.CrossEntropyLoss(), batches, verbose=False)
    trainer = Trainer(engine)
    trainer.fit(loader, epochs=epochs, hooks=hooks, display_progress=False)
    return model, trainer


def _same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


def test_load_checkpoint_hook_finds_the_legacy_files_in_their_folder(tmp_path):
    folder = tmp_path / "ck"
    _run(3, [SaveCheckpointHook(1, get_checkpoint_path(folder, "{epoch}"))])
    straight, _ = _run(5, [])
    latest, trainer = _run(5, [LoadCheckpointHook(str(folder))], seed=1)  # epoch=-1: epoch2-tp0-pp0.pt
    assert trainer.cur_step == 15 and _same(latest, straight)
    from_1, trainer = _run(5, [LoadCheckpointHook(str(folder), epoch=1)], seed=1)
    assert trainer.cur_step == 15 and _same(from_1, straight)
    with pytest.raises(FileNotFoundError, match=r"LoadCheckpointHook\(epoch=4\): no file epoch4-tp0-pp0\.pt in "
                                                r".*ck; it has the files of epochs \[0, 1, 2\]"):
        _run(5, [LoadCheckpointHook(str(folder), epoch=4)])


def test_load_checkpoint_hook_suffix_is_legacys_fifth_argument(tmp_path):
    folder = tmp_path / "ck"
    _run(2, [SaveCheckpointHook(1, get_checkpoint_path(folder, "{epoch}", "-run1"))])
    straight, _ = _run(4, [])
    # legacy's positional order: (checkpoint_dir, epoch, finetune, strict, suffix, priority)
    resumed, trainer = _run(4, [LoadCheckpointHook(str(folder), -1, False, False, "-run1")], seed=1)
    assert trainer.cur_step == 12 and _same(resumed, straight)
    assert LoadCheckpointHook(str(folder), -1, False, False, "-run1", 3).priority == 3
    with pytest.raises(FileNotFoundError, match=r"no checkpoint in .*ck \(neither checkpoint folders nor legacy "
                                                r"files epoch<N>-tp0-pp0\.pt\)"):
        _run(4, [LoadCheckpointHook(str(folder))])  # the files have another suffix
