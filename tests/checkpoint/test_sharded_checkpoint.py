"""ZeRO stage 3 checkpoints: each rank writes its shard (torch.distributed.checkpoint); resume on 2 ranks,
and on 1 rank after `colossal-lite ckpt merge`."""
import json
import zlib
from pathlib import Path

import torch
from dist_helpers import run_python, run_ranks

from colossal_lite.cli import main as cli_main

SCRIPT = r'''
import json, sys
import torch
sys.path.insert(0, {tests!r})
import colossal_lite
from colossal_lite.checkpoint.manager import CheckpointManager, load_sharded
from colossal_lite.core import global_context as gpc
from engine_helpers import make_batches, make_model

mode, ckpt, out = sys.argv[1], sys.argv[2], sys.argv[3]
config = dict(zero=dict(stage=3)) if mode != "merged" else {{}}
colossal_lite.launch_from_torch(config=config, verbose=False)
rank, world = gpc.get_global_rank(), gpc.get_world_size()
model = make_model()
engine, *_ = colossal_lite.initialize(model, torch.optim.Adam(model.parameters(), lr=0.01),
                                      torch.nn.CrossEntropyLoss(), verbose=False)
batches = make_batches(6, b=8)

def train(part):
    for x, y in part:
        if world > 1:
            x, y = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        engine.step()

manager = CheckpointManager(ckpt)
if mode == "save":
    train(batches[:3])
    manager.save("epoch0-step3", {{"engine": engine.state_dict_without_shards()}}, {{}},
                 sharded_state=engine.sharded_state_dict())
elif mode == "resume":
    shared, _ = manager.load("last")
    state = engine.sharded_state_dict()
    load_sharded(manager.resolve("last"), state)
    engine.load_sharded_state_dict(state)
    engine.load_state_dict(shared["engine"])
elif mode == "merged":
    from colossal_lite.checkpoint.io import load_file
    engine.load_state_dict(load_file(ckpt + "/merged.pt")["engine"])
train(batches[3:])
full = engine.state_dict()["model"]  # collective under zero: full tensors on every rank
if rank == 0:
    json.dump({{k: v.tolist() for k, v in full.items()}}, open(out, "w"))
gpc.destroy()
'''


def test_sharded_checkpoint_resumes_on_two_ranks_and_on_one_after_merge(tmp_path, capsys):
    script = tmp_path / "sharded.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parents[1])))
    ckpt = tmp_path / "ckpt"
    run_ranks(script, ["save", ckpt, tmp_path / "full.json"], nproc=2, timeout=180)
    folder = ckpt / "epoch0-step3"
    shards = sorted(p.name for p in (folder / "sharded").iterdir())
    assert ".metadata" in shards and len([s for s in shards if s.endswith(".distcp")]) == 2  # one file per rank
    meta = json.loads((folder / "meta.json").read_text())
    assert any(k.startswith("sharded/") for k in meta["files"])
    # every file has its checksum, the shards' too (each rank checksums its share of them)
    assert meta["checksums"] == {name: f"crc32:{zlib.crc32((folder / name).read_bytes()):08x}" for name in meta["files"]}

    run_ranks(script, ["resume", ckpt, tmp_path / "resumed.json"], nproc=2, timeout=180)
    assert cli_main(["ckpt", "merge", str(folder), str(ckpt / "merged.pt")]) == 0
    assert "model tensors" in capsys.readouterr().out
    run_python(script, ["merged", ckpt, tmp_path / "merged.json"], timeout=120)

    full = json.loads((tmp_path / "full.json").read_text())
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert resumed == full  # the same two ranks, the same steps: bit for bit (json keeps every float's value)
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert merged.keys() == full.keys()
    for k in full:
        # one process takes the mean over the whole batch where the two ranks each took their half's and averaged
        # them: the same terms added in another order, so the last bits may differ
        torch.testing.assert_close(torch.tensor(merged[k]), torch.tensor(full[k]), rtol=1e-5, atol=1e-6)

    # one flipped bit in a shard: merging (which reads every shard) refuses, naming the file
    shard = folder / "sharded" / next(s for s in shards if s.endswith(".distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    assert cli_main(["ckpt", "merge", str(folder), str(ckpt / "merged2.pt")]) == 1
    err = capsys.readouterr().err
    assert f"error: checkpoint file {shard} is damaged" in err, err
