"""Every save's times reach the history, the metrics file and the log line (synchronous saves and the legacy file
too); every verified load reads each byte of a file once: single files, folders and ZeRO 2/3 shards.

"Read once" is checked by mechanism: the bytes this process asked the kernel for (``rchar`` of
``/proc/self/io``) during a load, against the file's size; memory-mapped pages are not counted there.
"""
import io
import json
import logging
import os
import random
import zlib

import pytest
import torch
from torch import nn

from colossal_lite.checkpoint import CheckpointDamagedError, CheckpointManager
from colossal_lite.checkpoint.crc import ChecksummingFile, ReadChecksum, crc32_combine
from colossal_lite.checkpoint.io import load_single_file
from colossal_lite.checkpoint.sharded import load_sharded
from colossal_lite.engine.engine import Engine
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.history import is_measured
from colossal_lite.trainer.hooks import LossHook, SaveCheckpointHook
from colossal_lite.utils import get_dataloader


def _fit(target, logger, epochs=2, resume_from=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(24, 6, generator=g), torch.randint(0, 3, (24,), generator=g))
    return Trainer(engine, logger=logger).fit(get_dataloader(data, batch_size=8), epochs=epochs,
                                              hooks=[LossHook(), SaveCheckpointHook(1, target)],
                                              resume_from=resume_from)


@pytest.mark.parametrize("legacy_file", [False, True])
def test_a_synchronous_save_reports_its_times_like_an_asynchronous_one(tmp_path, caplog, legacy_file):
    target = tmp_path / ("ck.pt" if legacy_file else "ck")
    logger = logging.getLogger("test_save_times")
    with caplog.at_level(logging.INFO, logger="test_save_times"):
        history = _fit(target, logger)
    blocking, total = history.series("checkpoint/blocking_s"), history.series("checkpoint/total_s")
    assert [s for s, _ in blocking] == [3, 6] and blocking == total  # a synchronous save blocks for all of it
    assert all(v > 0 for _, v in blocking)
    assert {n for n in history.names if is_measured(n)} == {"checkpoint/blocking_s", "checkpoint/total_s"}
    assert len(history.without_measured()) == len(history) - 4
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoint saved:")]
    where = [target, target] if legacy_file else [target / "epoch0-step3", target / "epoch1-step6"]
    assert logged == [f"checkpoint saved: {p} (training blocked {v:.3f} s; written in {v:.3f} s)"
                      for p, (_, v) in zip(where, blocking)]
    if not legacy_file:
        lines = [json.loads(line) for line in (target / "metrics.jsonl").read_text().splitlines()]
        assert [(r["step"], r["value"]) for r in lines if r["name"] == "checkpoint/total_s"] == total


def test_a_resumed_run_holds_the_times_of_the_save_it_resumed_from(tmp_path):
    """The times of a save are measured once its checkpoint is written, so the checkpoint's history cannot hold
    them: a run resumed from it lost them from its history and its rewritten metrics file. They are added to the
    checkpoint's folder once it is complete, and the resumed run takes them back."""
    target = tmp_path / "ck"
    first = _fit(target, None, epochs=1).series("checkpoint/total_s")
    resumed = _fit(target, None, epochs=2, resume_from="last")
    times = resumed.series("checkpoint/total_s")
    assert [s for s, _ in times] == [3, 6] and times[0] == first[0]
    assert resumed.series("checkpoint/blocking_s")[0] == first[0]  # (a synchronous save blocks for all of it)
    lines = [json.loads(line) for line in (target / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["value"]) for r in lines if r["name"] == "checkpoint/total_s"] == times
    assert CheckpointManager(target).load("last")  # the folder is still a complete, verified checkpoint


def test_the_checksum_of_pieces_read_in_any_order_is_the_files():
    a, b = os.urandom(1000), os.urandom(777)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    data = os.urandom(50_000)
    rnd = random.Random(0)
    for _ in range(100):
        read = ReadChecksum(len(data))
        f = ChecksummingFile(io.BytesIO(data), read)
        for _ in range(rnd.randint(0, 12)):  # overlapping, backwards, past the end
            f.seek(rnd.randint(0, len(data)))
            f.readinto(bytearray(rnd.randint(0, 20_000))) if rnd.random() < 0.5 else f.read(rnd.randint(0, 20_000))
        pieces = read.pieces
        assert all(s < e <= s2 for (s, e, _), (s2, _, _) in zip(pieces, pieces[1:]))
        assert read.finish(io.BytesIO(data)) == zlib.crc32(data)
    big = os.urandom(9 << 20)  # a read this large is checksummed by a worker thread beside the reading
    read = ReadChecksum(len(big))
    f = ChecksummingFile(io.BytesIO(big), read)
    f.seek(1000)
    assert f.readinto(bytearray(len(big))) == len(big) - 1000 and len(read.pieces) == 1
    f.seek(0)
    f.read(2000)  # overlaps the piece: only its first 1000 bytes are new
    assert [(s, e) for s, e, _ in read.pieces] == [(0, 1000), (1000, len(big))]
    assert read.finish(io.BytesIO(big)) == zlib.crc32(big)


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def _reads(fn):
    before = _rchar()
    out = fn()
    return out, _rchar() - before


def test_a_single_file_is_read_once_and_checked_record_by_record(tmp_path):
    path = tmp_path / "one.pt"
    state = {"w": torch.randn(512, 1024), "n": 3}
    torch.save(state, path)
    size = path.stat().st_size
    loaded, ours = _reads(lambda: load_single_file(path))
    _, plain = _reads(lambda: torch.load(path, weights_only=True))
    assert torch.equal(loaded["w"], state["w"]) and loaded["n"] == 3
    assert plain >= size and ours < size // 20  # the records are checked on the pages the tensors are built on
    data = bytearray(path.read_bytes())
    data[size // 2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointDamagedError, match=rf"checkpoint file {path} is damaged: its record one/data/0 "
                                                     r"differs from the CRC-32 recorded for it"):
        load_single_file(path)


def test_sharded_state_is_read_once_and_every_byte_checked(tmp_path):
    """One process: DCP writes and reads ``sharded/`` without a process group, through the same code."""
    w, v = torch.randn(512, 512), torch.randn(256, 512)
    manager = CheckpointManager(tmp_path)
    with pytest.warns(UserWarning):  # DCP's note that it runs without a process group
        folder = manager.save("epoch0-step1", {"n": 1}, sharded_state={"w": w, "v": v})
    (shard,) = (folder / "sharded").glob("*.distcp")
    size = shard.stat().st_size
    target = {"w": torch.zeros(512, 512), "v": torch.zeros(256, 512)}
    _, read = _reads(lambda: load_sharded(folder, target))
    assert torch.equal(target["w"], w) and torch.equal(target["v"], v)
    assert size <= read < size * 1.05  # each byte once (and the small .metadata, meta.json)
    part = {"v": torch.zeros(256, 512)}  # what was not loaded is read to complete the checksum, once
    _, read = _reads(lambda: load_sharded(folder, part))
    assert torch.equal(part["v"], v) and size <= read < size * 1.05
    data = bytearray(shard.read_bytes())
    data[size // 3] ^= 1  # inside w, which the next load does not need: still found
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointDamagedError, match=rf"checkpoint file {shard} is damaged: its checksum is"):
        load_sharded(folder, {"v": torch.zeros(256, 512)})
