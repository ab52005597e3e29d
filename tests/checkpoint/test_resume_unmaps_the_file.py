"""A resumed run keeps no tensor on the memory map of the checkpoint file it resumed from.

Checkpoint files are loaded on a memory map of the file (read once, checked and unpickled from the same pages).
torch's ``Optimizer.load_state_dict`` keeps a loaded tensor that already has its parameter's device and dtype, so
on the CPU the optimizer's state stayed a view of the file: Adam updated it in place in the map, and after the
checkpoint retention deleted the folder the file stayed on the disk (and its pages in the process) until the run
ended (found by the memory probe). Checked in the process's own memory maps (/proc/self/maps, Linux).
"""
from pathlib import Path

import pytest
import torch
from torch import nn

from colossal_lite.engine.accumulation import AccumulationWindow
from colossal_lite.engine.engine import Engine
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import SaveCheckpointHook

MAPS = Path("/proc/self/maps")


def fit(folder, epochs, resume=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 8))
    engine = Engine(model, torch.optim.Adam(model.parameters(), lr=1e-3), nn.MSELoss(), window=AccumulationWindow(1))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 64, generator=g), torch.randn(4, 8, generator=g)) for _ in range(3)]
    trainer = Trainer(engine)
    trainer.fit(batches, epochs=epochs, resume_from=resume, log_dir=False,
                hooks=[SaveCheckpointHook(1, checkpoint_dir=folder, keep_last_n=1)])
    return trainer, engine


@pytest.mark.skipif(not MAPS.exists(), reason="reads the process's memory maps (Linux)")
def test_after_a_resume_and_retention_no_checkpoint_file_stays_mapped(tmp_path):
    fit(tmp_path, epochs=1)
    trainer, engine = fit(tmp_path, epochs=3, resume="last")
    assert trainer.restored_from.name.startswith("epoch0")
    assert not trainer.restored_from.exists()  # retention deleted the folder the run resumed from
    mapped = [line.split(None, 5)[-1].strip() for line in MAPS.read_text().splitlines() if str(tmp_path) in line]
    assert mapped == [], mapped
    assert len(engine.optimizer.state) == 4  # (the state was loaded and trained on)
