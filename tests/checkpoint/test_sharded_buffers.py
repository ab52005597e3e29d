"""A ZeRO stage 2/3 checkpoint keeps rank 0's copy of every buffer the stages leave unsynced (BatchNorm's statistics
differ between ranks there). torch.distributed.checkpoint's default planner gave each such tensor to whichever
rank's plan was smallest, one by one: a layer's running mean came from rank 0 and its running variance from rank 1
(found by a probe), and that mix was what every resume, `ckpt merge` and `ckpt export` got."""
import json

import pytest
from dist_helpers import run_ranks

SCRIPT = r'''
import json, sys
import torch
import torch.distributed as dist
from torch import nn
import colossal_lite
from colossal_lite.checkpoint import load_weights
from colossal_lite.core import global_context as gpc
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import SaveCheckpointHook

stage, folder, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
colossal_lite.launch_from_torch(config=dict(zero=dict(stage=stage)), seed=0, verbose=False)
rank = gpc.get_global_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.BatchNorm1d(16, affine=False), nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 3))
g = torch.Generator().manual_seed(1 + rank)  # each rank its own data: its own statistics
batches = [(torch.randn(4, 16, generator=g) * (1 + rank), torch.randint(0, 3, (4,), generator=g)) for _ in range(3)]
engine = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                                  verbose=False)[0]
Trainer(engine).fit(batches, epochs=1, hooks=[SaveCheckpointHook(1, folder)], log_dir=False)
mine = {{name: b.detach().clone() for name, b in engine.unwrapped_model.named_buffers()}}
every = [None, None]
dist.all_gather_object(every, mine)
if rank == 0:
    saved = load_weights(folder)
    json.dump({{name: [torch.equal(saved[name], every[r][name]) for r in (0, 1)] for name in mine}}, open(out, "w"))
gpc.destroy()
'''


@pytest.mark.parametrize("stage", [2, 3])
def test_a_sharded_checkpoint_keeps_rank_0s_buffers(tmp_path, stage):
    script = tmp_path / "buffers.py"
    script.write_text(SCRIPT.format())
    run_ranks(script, [stage, tmp_path / "ck", tmp_path / "out.json"], nproc=2, timeout=180)
    same = json.loads((tmp_path / "out.json").read_text())
    statistics = [name for name in same if "running" in name]
    assert len(statistics) == 4
    for name in statistics:
        assert same[name] == [True, False], (name, same)  # rank 0's, and the ranks' copies differ
