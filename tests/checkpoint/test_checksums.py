"""Checksums: every file's CRC-32 is recorded in meta.json as it is written and compared before the file is read.

A damaged file of the right size is refused naming the file ('last', 'best', a path); a flipped
byte in the pickle is damage, not an unsafe file; ``'auto'`` falls back to the newest checkpoint
that verifies, with a warning naming the damaged one; checkpoints written before checksums load
by size. Files are damaged by flipping one real byte on disk.
"""
import json
import re
import textwrap
import zlib

import pytest
import torch
from dist_helpers import run_ranks
from torch import nn
from torch.utils.data import TensorDataset

import colossal_lite
from colossal_lite.checkpoint import (
    CheckpointDamagedError,
    CheckpointManager,
    UnsafeCheckpointError,
    checkpoint_info,
)
from colossal_lite.checkpoint.cli import main
from colossal_lite.core import global_context as gpc
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import LossHook, SaveCheckpointHook
from colossal_lite.utils import get_dataloader

WEIGHTS = torch.arange(64, dtype=torch.float32) * 1.5 + 0.25  # bytes easy to find in the file


def _state(step):
    return {"model": {"w": WEIGHTS + step}, "trainer": {"step": step}}


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _flip_in_tensor(path, tensor):
    """Flip one bit in the middle of ``tensor``'s bytes inside the file ``path`` (its size stays)."""
    at = path.read_bytes().find(tensor.numpy().tobytes())
    assert at > 0
    _flip(path, at + tensor.numel() * tensor.element_size() // 2)


def _crc(path):
    return f"crc32:{zlib.crc32(path.read_bytes()):08x}"


def test_meta_records_the_checksum_of_every_file_written(tmp_path):
    p = CheckpointManager(tmp_path).save("epoch0-step1", _state(1), {"rng": torch.arange(5)})
    meta = json.loads((p / "meta.json").read_text())
    assert meta["checksums"] == {name: _crc(p / name) for name in ("shared.pt", "rank0.pt")}
    assert set(meta["checksums"]) == set(meta["files"])


def test_a_flipped_byte_in_a_tensor_is_refused_by_last_best_and_a_path(tmp_path):
    m = CheckpointManager(tmp_path, save_best=("loss", "min"))
    m.save("epoch0-step1", _state(1), metrics={"loss": 2.0})
    p = m.save("epoch0-step2", _state(2), metrics={"loss": 1.0})
    _flip_in_tensor(p / "shared.pt", WEIGHTS + 2)
    message = re.escape(f"checkpoint file {p / 'shared.pt'} is damaged: its checksum is crc32:")
    for which in ("last", "best", p, "epoch0-step2"):
        with pytest.raises(CheckpointDamagedError, match=message + r"[0-9a-f]{8}, and crc32:[0-9a-f]{8} was recorded"):
            m.load(which)
    # the damage is found by the checksum alone: the size is right and torch.load reads the file without an error
    assert json.loads((p / "meta.json").read_text())["files"]["shared.pt"] == (p / "shared.pt").stat().st_size
    assert not torch.equal(torch.load(p / "shared.pt", weights_only=True)["model"]["w"], WEIGHTS + 2)


def test_a_flipped_byte_in_the_pickle_is_damage_not_an_unsafe_file(tmp_path):
    m = CheckpointManager(tmp_path)
    p = m.save("epoch0-step1", _state(1))
    data = (p / "shared.pt").read_bytes()
    _flip(p / "shared.pt", data.find(b"\x80\x02}") + 2)  # the pickle's first opcode after its protocol
    with pytest.raises(CheckpointDamagedError, match=re.escape(f"checkpoint file {p / 'shared.pt'} is damaged")):
        m.load("last")
    # without a checksum (written before checksums were recorded) the same file is refused as not plain data
    meta = json.loads((p / "meta.json").read_text())
    del meta["checksums"]
    (p / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UnsafeCheckpointError, match="pickle opcode"):
        m.load("last")


def test_auto_falls_back_to_the_newest_checkpoint_that_verifies(tmp_path):
    m = CheckpointManager(tmp_path)
    paths = [m.save(f"epoch0-step{i}", _state(i), {"rng": torch.full((3,), float(i))}) for i in (1, 2, 3)]
    _flip_in_tensor(paths[2] / "shared.pt", WEIGHTS + 3)
    _flip_in_tensor(paths[1] / "rank0.pt", torch.full((3,), 2.0))
    with pytest.warns(UserWarning) as caught:
        path, shared, rank_state = m.read("auto")
    assert path == paths[0] and shared["trainer"]["step"] == 1 and torch.equal(rank_state["rng"], torch.ones(3))
    texts = [str(w.message) for w in caught]
    assert len(texts) == 2, texts
    assert texts[0].startswith(f"checkpoint file {paths[2] / 'shared.pt'} is damaged") and \
        texts[0].endswith(f"resume_from='auto' goes on to the next newest checkpoint in {tmp_path}")
    assert texts[1].startswith(f"checkpoint file {paths[1] / 'rank0.pt'} is damaged")
    _flip_in_tensor(paths[0] / "shared.pt", WEIGHTS + 1)
    with pytest.warns(UserWarning), pytest.raises(CheckpointDamagedError) as e:
        m.read("auto")
    assert str(e.value).startswith(f"no checkpoint in {tmp_path} can be resumed: checkpoint file {paths[2]}")
    assert str(paths[0] / "shared.pt") in str(e.value)


def test_checkpoints_written_before_checksums_load_by_size(tmp_path):
    m = CheckpointManager(tmp_path)
    p = m.save("epoch0-step1", _state(1))
    meta = json.loads((p / "meta.json").read_text())
    del meta["checksums"]
    (p / "meta.json").write_text(json.dumps(meta))
    assert torch.equal(m.load("last")[0]["model"]["w"], WEIGHTS + 1)
    assert checkpoint_info(p)["checksums"] == "none recorded (an older checkpoint); the sizes of all 2 files match"
    with open(p / "shared.pt", "ab") as f:
        f.write(b"x")
    with pytest.raises(CheckpointDamagedError, match="damaged: shared.pt has .* bytes, meta.json records"):
        m.load("last")


def test_ckpt_info_and_export_check_the_checksums(tmp_path, capsys):
    m = CheckpointManager(tmp_path)
    p = m.save("epoch0-step1", _state(1))
    assert main(["ckpt", "info", str(p)]) == 0
    assert "  checksums: all 2 files match\n" in capsys.readouterr().out
    _flip_in_tensor(p / "shared.pt", WEIGHTS + 1)
    assert main(["ckpt", "info", str(p)]) == 1  # it prints the info, and fails as a check
    assert re.search(r"  checksums: DAMAGED: shared.pt \(checksum crc32:\w{8}, crc32:\w{8} recorded\)\n",
                     capsys.readouterr().out)
    assert main(["ckpt", "export", str(p), str(tmp_path / "model.pt")]) == 1
    assert f"error: checkpoint file {p / 'shared.pt'} is damaged" in capsys.readouterr().err
    assert not (tmp_path / "model.pt").exists()


# -- in the Trainer ------------------------------------------------------------------------------
@pytest.fixture
def clean():
    yield
    gpc.destroy()


def _fit(ck, epochs, resume_from=None, config=None):
    gpc.destroy()
    colossal_lite.launch_from_torch(config=config or {}, seed=0, verbose=False)
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(20, 6, generator=g), torch.randint(0, 3, (20,), generator=g))
    engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                    nn.CrossEntropyLoss(), get_dataloader(data, batch_size=4),
                                                    verbose=False)
    trainer = Trainer(engine)
    trainer.fit(loader, epochs=epochs, hooks=[LossHook(), SaveCheckpointHook(1, ck)], resume_from=resume_from)
    return trainer, model


def test_fit_auto_resumes_from_the_newest_checkpoint_that_verifies_and_last_refuses(tmp_path, clean, capfd):
    ck = tmp_path / "ck"
    _, model = _fit(ck, 2)
    newest = ck / "epoch1-step10"
    _flip_in_tensor(newest / "shared.pt", model.weight.detach().flatten()[:4])
    with pytest.raises(CheckpointDamagedError, match=re.escape(f"checkpoint file {newest / 'shared.pt'} is damaged")):
        _fit(ck, 3, resume_from="last")
    capfd.readouterr()
    with pytest.warns(UserWarning, match=re.escape(f"checkpoint file {newest / 'shared.pt'} is damaged")):
        trainer, _ = _fit(ck, 3, resume_from="auto")
    assert f"resumed from {ck / 'epoch0-step5'}: epoch 1, step 5" in capfd.readouterr().out
    assert trainer.cur_step == 15


def test_auto_falls_back_past_a_zero_shard_found_damaged_as_it_loads(tmp_path, clean, capfd):
    """ZeRO 3 shards are checked as DCP reads them (each byte read once), after the folder was chosen: a damaged
    one still sends ``'auto'`` on to the next newest checkpoint, and that resume is the one a clean run gives."""
    ck = tmp_path / "ck"
    zero = dict(zero=dict(stage=3))
    _fit(ck, 2, config=zero)
    shard = next((ck / "epoch1-step10" / "sharded").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointDamagedError, match=re.escape(f"checkpoint file {shard} is damaged")):
        _fit(ck, 3, resume_from="last", config=zero)
    capfd.readouterr()
    with pytest.warns(UserWarning, match=re.escape(f"checkpoint file {shard} is damaged")):
        _, resumed = _fit(ck, 3, resume_from="auto", config=zero)
    assert f"resumed from {ck / 'epoch0-step5'}: epoch 1, step 5" in capfd.readouterr().out
    resumed_weights = [p.detach().clone() for p in resumed.state_dict().values()]
    for folder in [ck / "epoch1-step10", *ck.glob("epoch2-*")]:  # the same resume with the damaged folder gone
        folder.rename(tmp_path / folder.name)
    (ck / "last").unlink(missing_ok=True)
    _, clean_run = _fit(ck, 3, resume_from="auto", config=zero)
    assert all(torch.equal(a, b) for a, b in zip(resumed_weights, clean_run.state_dict().values()))


_TWO_RANKS = textwrap.dedent("""
    import sys, warnings
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from colossal_lite.checkpoint import CheckpointManager
    dist.init_process_group("gloo")
    r = dist.get_rank()
    d = Path(sys.argv[1])
    m = CheckpointManager(d)

    def say(line):  # one write per line: the two ranks' lines do not interleave
        sys.stdout.write(line + "\\n")

    for step in (1, 2):
        p = m.save(f"epoch0-step{step}", {"step": step} if r == 0 else None, {"mine": torch.full((8,), 10.0 * step + r)})
    if r == 1:  # one flipped bit in rank 1's own file of the newest checkpoint: only rank 1 reads it
        data = bytearray((p / "rank1.pt").read_bytes())
        data[data.find(torch.full((8,), 21.0).numpy().tobytes()) + 5] ^= 1
        (p / "rank1.pt").write_bytes(bytes(data))
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path, shared, mine = m.read("auto")
    say(f"rank{r} auto {path.name} step={shared['step']} mine={mine['mine'][0].item()} "
        f"warned={[str(w.message)[:60] for w in caught]}")
    try:
        m.load("last")
    except Exception as e:
        say(f"rank{r} last {type(e).__name__}: {e}")
    dist.destroy_process_group()
""")


def test_two_ranks_agree_on_a_damaged_rank_file(tmp_path):
    script = tmp_path / "two_ranks_damage.py"
    script.write_text(_TWO_RANKS)
    d = tmp_path / "ck"
    out = run_ranks(script, [d], nproc=2, timeout=90).stdout
    damaged = f"checkpoint file {d / 'epoch0-step2' / 'rank1.pt'} is damaged"
    assert f"rank0 auto epoch0-step1 step=1 mine=10.0 warned=['{damaged[:60]}']" in out, out
    assert "rank1 auto epoch0-step1 step=1 mine=11.0 warned=[]" in out, out  # the warning is rank 0's
    lines = {line[:5]: line for line in out.splitlines() if " last " in line}
    assert lines["rank1"].startswith(f"rank1 last CheckpointDamagedError: {damaged}: its checksum is crc32:"), out
    assert lines["rank0"] == lines["rank1"].replace("rank1", "rank0", 1) + " (reported by rank 1)", out
