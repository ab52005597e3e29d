"""The evaluation's last progress line on two ranks shows the values over the whole test set, the ones the epoch's
log line and the history give, not rank 0's half of it (each rank evaluates its own shard)."""
import re

from dist_helpers import run_ranks

SCRIPT = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset
import colossal_lite
from colossal_lite.core import global_context as gpc
from colossal_lite.logging import get_dist_logger
from colossal_lite.nn.metric import Accuracy
from colossal_lite.trainer import Trainer, hooks
from colossal_lite.utils import get_dataloader

colossal_lite.launch_from_torch(config={}, verbose=False, seed=0)
g = torch.Generator().manual_seed(0)
x = torch.randn(64, 4, generator=g)
y = (x[:, 0] > 0).long()
y[1::2] = 1 - y[1::2]  # the samples rank 1 evaluates are labelled the other way: its half scores apart
torch.manual_seed(0)
model = nn.Linear(4, 2)
engine, train_loader, test_loader, _ = colossal_lite.initialize(
    model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
    get_dataloader(TensorDataset(x, y), batch_size=8), get_dataloader(TensorDataset(x, y), batch_size=8),
    verbose=False)
Trainer(engine).fit(train_loader, epochs=1, test_dataloader=test_loader, display_progress=True,
                    hooks=[hooks.LossHook(), hooks.AccuracyHook(Accuracy()), hooks.LogMetricByStepHook(),
                           hooks.LogMetricByEpochHook(get_dist_logger())])
gpc.destroy()
'''


def test_the_last_test_line_shows_the_values_over_all_ranks(tmp_path):
    script = tmp_path / "progress_ranks.py"
    script.write_text(SCRIPT)
    out = run_ranks(script, nproc=2, timeout=120).stdout
    line = re.search(r"\[Epoch 0 / Test\] 4/4 .*\| loss=(\S+) accuracy=(\S+)", out)
    logged = re.search(r"\[Epoch 0 / Test\]: Loss = (\S+) \| Accuracy = (\S+)", out)
    assert line and logged, out
    assert [float(v) for v in line.groups()] == [float(v) for v in logged.groups()], out
