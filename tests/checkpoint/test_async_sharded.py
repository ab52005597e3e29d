"""Asynchronous ZeRO stage 3 saves on two ranks: the sharded files are written in the background on a process
group of their own while training goes on, and the checkpoint equals, tensor for tensor, the synchronous
save taken at the same step (the comparison reads both folders in this process, ``merge``); a step boundary
runs one small all-reduce while a save is in flight and none otherwise (counted). In the same
launch, ``fit`` with ``SaveCheckpointHook(async_save=True)`` ends with the parameters of the synchronous
run, and so does a run resumed from one of its checkpoints."""
from pathlib import Path

import torch
from dist_helpers import run_ranks

from colossal_lite.checkpoint.manager import merge_checkpoint

SCRIPT = r'''
import sys
import torch
sys.path.insert(0, {tests!r})
import colossal_lite
from colossal_lite.checkpoint.manager import CheckpointManager
from colossal_lite.core import global_context as gpc
from engine_helpers import make_batches, make_model

root = sys.argv[1]
colossal_lite.launch_from_torch(config=dict(zero=dict(stage=3)), verbose=False)
rank = gpc.get_global_rank()
model = make_model()
engine, *_ = colossal_lite.initialize(model, torch.optim.Adam(model.parameters(), lr=0.01),
                                      torch.nn.CrossEntropyLoss(), verbose=False)

def train(part):
    for x, y in part:
        x, y = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        engine.step()

batches = make_batches(9, b=8)
sync, background = CheckpointManager(root + "/sync"), CheckpointManager(root + "/async", async_save=True)
all_reduces, real_all_reduce = [], torch.distributed.all_reduce

def counted_all_reduce(*args, **kwargs):  # the real collective, counted
    all_reduces.append(1)
    return real_all_reduce(*args, **kwargs)

def poll():
    """A step boundary; the all-reduces it ran."""
    before = len(all_reduces)
    background.poll()
    return len(all_reduces) - before

torch.distributed.all_reduce = counted_all_reduce
per_poll = []
for k in range(3):
    train(batches[3 * k:3 * k + 3])
    name = f"epoch0-step{{3 * k + 3}}"
    sync.save(name, {{"engine": engine.state_dict_without_shards()}}, {{}}, sharded_state=engine.sharded_state_dict())
    background.save(name, {{"engine": engine.state_dict_without_shards()}}, {{}},
                    sharded_state=engine.sharded_state_dict())
    per_poll.append(poll())  # completes it when every rank is done, else a later save waits for it
background.wait()
idle = poll()  # nothing in flight: no collective
torch.distributed.all_reduce = real_all_reduce
print(f"rank{{rank}} saves {{[t.step for t in background.finished_saves]}}\n", end="", flush=True)
print(f"rank{{rank}} all-reduces per poll in flight {{sorted(set(per_poll))}}, idle {{idle}}\n", end="", flush=True)

# the Trainer: asynchronous saves under zero 3 against synchronous ones, and a resume from one of them
from torch.utils.data import TensorDataset
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import SaveCheckpointHook
from colossal_lite.utils import get_dataloader
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(32, 6, generator=g), torch.randint(0, 4, (32,), generator=g))

def fit(folder, async_save, resume=None):
    model = make_model()
    engine, loader, *_ = colossal_lite.initialize(model, torch.optim.Adam(model.parameters(), lr=0.01),
                                                  torch.nn.CrossEntropyLoss(),
                                                  get_dataloader(data, shuffle=True, batch_size=4), verbose=False)
    Trainer(engine).fit(loader, epochs=2, hooks=[SaveCheckpointHook("2ba", folder, async_save=async_save)],
                        resume_from=resume, log_dir=False)
    return engine.state_dict()["model"]  # full tensors on every rank (a collective)

reference = fit(root + "/t-sync", False)
background = fit(root + "/t-async", True)
resumed = fit(root + "/t-resumed", True, resume=root + "/t-async/epoch0-step2")
same = [all(torch.equal(reference[k], other[k]) for k in reference) for other in (background, resumed)]
print(f"rank{{rank}} trainer equal {{same}}\n", end="", flush=True)
gpc.destroy()
'''


def _tensors(tree, prefix=""):
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_tensors(v, f"{prefix}/{k}"))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(_tensors(v, f"{prefix}/{i}"))
    return out


def test_async_zero3_saves_equal_the_synchronous_ones(tmp_path):
    script = tmp_path / "async_sharded.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parents[1])))
    proc = run_ranks(script, [tmp_path], nproc=2, timeout=180)
    for r in (0, 1):
        assert f"rank{r} saves [3, 6, 9]" in proc.stdout, proc.stdout + proc.stderr
        assert f"rank{r} trainer equal [True, True]" in proc.stdout, proc.stdout + proc.stderr
        # one all-reduce of one number per step boundary while a save is in flight (two when that boundary finds
        # every file written and hands the folder to rank 0), none without one
        line = next(x for x in proc.stdout.splitlines() if x.startswith(f"rank{r} all-reduces"))
        assert line.endswith("idle 0") and line.split("in flight ")[1].split("]")[0] + "]" in ("[1]", "[2]", "[1, 2]")
    assert sorted(p.name for p in (tmp_path / "t-async").iterdir()) == \
        sorted(p.name for p in (tmp_path / "t-sync").iterdir())
    for step in (3, 6, 9):
        name = f"epoch0-step{step}"
        assert sorted(p.name for p in (tmp_path / "async" / name / "sharded").iterdir()) == \
            sorted(p.name for p in (tmp_path / "sync" / name / "sharded").iterdir())
        sync, background = _tensors(merge_checkpoint(tmp_path / "sync" / name)), \
            _tensors(merge_checkpoint(tmp_path / "async" / name))
        assert sync.keys() == background.keys() and len(sync) > 4
        for key in sync:
            assert torch.equal(sync[key], background[key]), (name, key)
