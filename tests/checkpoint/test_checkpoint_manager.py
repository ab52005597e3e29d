"""CheckpointManager: layout, pointers, retention, best across restarts, failures, leftovers, two ranks."""
import json
import os
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch
from dist_helpers import run_python, run_ranks

from colossal_lite.amp.amp_type import AMP_TYPE
from colossal_lite.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CheckpointNotFoundError,
    CheckpointWriteError,
    UnsafeCheckpointError,
    UnsupportedValueError,
    checkpoint_info,
    checkpoint_name,
)
from colossal_lite.context.config import Config


def _state(step):
    return {"model": {"w": torch.full((4,), float(step))}, "trainer": {"step": step}}


def _names(d):
    return sorted(n for n in os.listdir(d))


def test_save_writes_one_complete_folder_then_moves_last(tmp_path):
    m = CheckpointManager(tmp_path / "ck")
    p = m.save(checkpoint_name(2, 30), _state(30), {"rng": torch.arange(3)}, {"loss": 0.5})
    assert p == tmp_path / "ck" / "epoch2-step30"
    assert _names(p) == ["meta.json", "rank0.pt", "shared.pt"]
    assert (tmp_path / "ck" / "last").read_text() == "epoch2-step30\n"
    assert _names(tmp_path / "ck") == ["epoch2-step30", "last"]
    meta = json.loads((p / "meta.json").read_text())
    assert (meta["epoch"], meta["step"], meta["metrics"]) == (2, 30, {"loss": 0.5})
    assert meta["files"]["shared.pt"] == (p / "shared.pt").stat().st_size
    shared, rank = m.load("last")
    assert shared["trainer"] == {"step": 30} and torch.equal(shared["model"]["w"], torch.full((4,), 30.0))
    assert torch.equal(rank["rng"], torch.arange(3))


def test_resolve_forms_and_messages(tmp_path):
    d = tmp_path / "ck"
    m = CheckpointManager(d, save_best=("loss", "min"))
    assert m.resolve("auto") is None
    with pytest.raises(CheckpointNotFoundError, match=r"no 'last' checkpoint in .*ck.*no checkpoint was completed"):
        m.load("last")
    m.save("epoch0-step1", _state(1), metrics={"loss": 2.0})
    m.save("epoch0-step2", _state(2), metrics={"loss": 3.0})
    assert m.resolve("auto") == m.resolve("last") == d / "epoch0-step2"
    assert m.resolve("best") == d / "epoch0-step1"
    assert m.resolve("epoch0-step1") == d / "epoch0-step1"  # a name inside checkpoint_dir
    assert m.resolve(d / "best") == d / "epoch0-step1"  # a pointer file
    assert m.resolve(str(d)) == d / "epoch0-step2"  # a checkpoint directory: its last
    with pytest.raises(CheckpointNotFoundError, match="checkpoint epoch9-step9 does not exist"):
        m.resolve("epoch9-step9")
    (d / "last").write_text("../../etc\n")  # a tampered pointer is never followed outside the folder
    assert m.resolve("auto") == d / "epoch0-step2"  # falls back to the newest complete checkpoint
    with pytest.raises(CheckpointNotFoundError, match="no 'last' checkpoint") as refused:
        m.resolve("last")
    # the pointer exists: the message says why it is not followed and what to write, not that it is missing
    assert str(refused.value) == (
        f"no 'last' checkpoint in {d}: {d / 'last'} names '../../etc', not the bare name of a folder in {d} (it "
        f"holds a '/' or a '\\', or starts with '.'), and such a pointer is never followed: it could lead outside "
        f"the folder. Write the checkpoint folder's bare name into it (here 'etc'), or give the folder's path instead")
    (d / "last").write_text("../ck/epoch0-step2\n")  # even one that leads back to a checkpoint of the folder
    with pytest.raises(CheckpointNotFoundError, match=r"last names '\.\./ck/epoch0-step2', not the bare name .* "
                                                      r"\(here 'epoch0-step2'\)"):
        m.resolve("last")
    (d / "last").write_text("")
    with pytest.raises(CheckpointNotFoundError, match=r"no 'last' checkpoint in .*ck: .*last is empty$"):
        m.resolve("last")


def test_retention_keeps_exactly_the_last_n_plus_best_and_last(tmp_path):
    d = tmp_path / "ck"
    m = CheckpointManager(d, save_best=("acc", "max"), keep_last_n=2)
    accs = [0.1, 0.9, 0.5, 0.6, 0.7, 0.95, 0.2]
    expected = [
        ["epoch0-step0"],
        ["epoch0-step0", "epoch1-step1"],
        ["epoch1-step1", "epoch2-step2"],
        ["epoch1-step1", "epoch2-step2", "epoch3-step3"],
        ["epoch1-step1", "epoch3-step3", "epoch4-step4"],
        ["epoch4-step4", "epoch5-step5"],
        ["epoch5-step5", "epoch6-step6"],
    ]
    for i, acc in enumerate(accs):
        m.save(checkpoint_name(i, i), _state(i), metrics={"acc": acc})
        assert [p.name for p in m.list_checkpoints()] == expected[i], i
    assert (d / "best").read_text().strip() == "epoch5-step5"
    assert (d / "last").read_text().strip() == "epoch6-step6"
    assert _names(d) == ["best", "epoch5-step5", "epoch6-step6", "last"]


def test_best_survives_a_restart(tmp_path):
    d = tmp_path / "ck"
    m = CheckpointManager(d, save_best=("loss", "min"), keep_last_n=1)
    m.save("epoch0-step10", _state(10), metrics={"loss": torch.tensor(0.30)})
    m.save("epoch1-step20", _state(20), metrics={"loss": 0.50})
    restarted = CheckpointManager(d, save_best=("loss", "min"), keep_last_n=1)
    assert restarted.best_value == pytest.approx(0.30)
    restarted.save("epoch2-step30", _state(30), metrics={"loss": 0.40})  # worse than 0.30: best stays
    assert restarted.resolve("best").name == "epoch0-step10"
    assert _names(d) == ["best", "epoch0-step10", "epoch2-step30", "last"]  # best is never deleted
    restarted.save("epoch3-step40", _state(40), metrics={"loss": 0.10})
    assert restarted.resolve("best").name == "epoch3-step40"
    assert _names(d) == ["best", "epoch3-step40", "last"]
    with pytest.warns(UserWarning, match="save_best watches metric 'loss'.*only \\['acc'\\]"):
        restarted.save("epoch4-step50", _state(50), metrics={"acc": 1.0})


def test_a_nan_metric_is_null_in_meta_json_and_never_best(tmp_path):
    """JSON has no NaN: ``meta.json`` writes it ``null``, as the run's metrics file does, so strict readers (jq,
    JavaScript) read it (found by a probe); a NaN still never becomes best, also after a restart."""
    d = tmp_path / "ck"
    m = CheckpointManager(d, save_best=("loss", "min"))
    m.save("epoch0-step10", _state(10), metrics={"loss": 0.5, "acc": float("nan")})
    m.save("epoch1-step20", _state(20), metrics={"loss": torch.tensor(float("nan"))})
    text = (d / "epoch1-step20" / "meta.json").read_text()
    meta = json.loads(text, parse_constant=lambda name: pytest.fail(f"meta.json holds {name}, which is not JSON"))
    assert meta["metrics"] == {"loss": None}
    assert json.loads((d / "epoch0-step10" / "meta.json").read_text())["metrics"] == {"loss": 0.5, "acc": None}
    assert m.resolve("best").name == "epoch0-step10"
    assert CheckpointManager(d, save_best=("loss", "min")).best_value == 0.5


def test_a_misspelt_pointer_is_answered_with_the_pointer_meant(tmp_path):
    m = CheckpointManager(tmp_path / "ck")
    with pytest.raises(CheckpointNotFoundError, match=r"checkpoint atuo does not exist .*; did you mean 'auto'\?"):
        m.resolve("atuo")
    with pytest.raises(CheckpointNotFoundError, match=r"did you mean 'best'\?"):
        m.resolve("bets")
    with pytest.raises(CheckpointNotFoundError) as error:
        m.resolve(str(tmp_path / "ck" / "epoch0-step1"))  # a path: no pointer is meant
    assert "did you mean" not in str(error.value)


def test_bad_arguments_are_explained(tmp_path):
    with pytest.raises(ValueError, match=r"save_best must be None or \(metric_name, 'min' \| 'max'\)"):
        CheckpointManager(tmp_path, save_best="loss")
    with pytest.raises(ValueError, match="keep_last_n must be None .* or an int >= 1, got 0"):
        CheckpointManager(tmp_path, keep_last_n=0)
    with pytest.raises(ValueError, match="checkpoint name 'last' cannot be used"):
        CheckpointManager(tmp_path).save("last", _state(0))


def test_saving_twice_at_the_same_point_keeps_both(tmp_path):
    m = CheckpointManager(tmp_path)
    m.save("epoch1-step5", _state(5))
    p = m.save("epoch1-step5", _state(6))  # e.g. a resumed run, or a preemption save right after a save
    assert p.name == "epoch1-step5-v1"
    assert m.resolve("last") == p and m.load("epoch1-step5")[0]["trainer"]["step"] == 5


def test_leftovers_of_dead_writers_are_removed_at_start_and_live_ones_ignored(tmp_path):
    m = CheckpointManager(tmp_path)
    m.save("epoch0-step1", _state(1))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    (tmp_path / f".tmp-epoch0-step2-{dead_pid}").mkdir()
    (tmp_path / f".tmp-epoch0-step2-{dead_pid}" / "shared.pt").write_bytes(b"half")
    (tmp_path / f".del-epoch0-step0-{dead_pid}").mkdir()
    (tmp_path / f".tmp-last-{dead_pid}").write_text("epoch0-step2")
    live = tmp_path / f".tmp-epoch0-step3-{os.getppid()}"  # another live process is writing it
    live.mkdir()
    m2 = CheckpointManager(tmp_path)
    assert sorted(p.name for p in m2.removed_leftovers) == sorted(
        [f".tmp-epoch0-step2-{dead_pid}", f".del-epoch0-step0-{dead_pid}", f".tmp-last-{dead_pid}"])
    assert _names(tmp_path) == [live.name, "epoch0-step1", "last"]
    assert [p.name for p in m2.list_checkpoints()] == ["epoch0-step1"]
    assert m2.load("last")[0]["trainer"]["step"] == 1


def test_unstorable_state_fails_before_anything_is_written(tmp_path):
    m = CheckpointManager(tmp_path)
    m.save("epoch0-step1", _state(1))
    with pytest.raises(UnsupportedValueError, match=r"shared_state\['trainer'\]\['hook'\]"):
        m.save("epoch0-step2", {"trainer": {"hook": object()}})
    with pytest.raises(UnsupportedValueError, match=r"rank_state\['sampler'\]"):
        m.save("epoch0-step2", _state(2), {"sampler": iter([1])})
    assert _names(tmp_path) == ["epoch0-step1", "last"]


def test_unwritable_target_raises_naming_the_path_and_keeps_the_previous(tmp_path):
    m = CheckpointManager(tmp_path / "ck")
    m.save("epoch0-step1", _state(1))
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a folder should be")
    with pytest.raises(CheckpointWriteError) as e:
        CheckpointManager(blocker / "ck").save("epoch0-step2", _state(2))
    assert str(blocker / "ck" / "epoch0-step2") in str(e.value) and "Not a directory" in str(e.value)
    # a read-only folder or file system: test_unwritable_folder.py


_FULL_DISK = textwrap.dedent("""
    import os, resource, signal, sys
    import torch
    from colossal_lite.checkpoint import CheckpointManager, CheckpointWriteError
    d = sys.argv[1]
    m = CheckpointManager(d)
    m.save("epoch0-step1", {"w": torch.zeros(10)})
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, like a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    state = {"w": torch.arange(1_000_000, dtype=torch.float32)}
    try:
        m.save("epoch1-step2", state)
    except CheckpointWriteError as e:
        print("ERROR", e)
    print("UNTOUCHED", torch.equal(state["w"], torch.arange(1_000_000, dtype=torch.float32)))
""")


@pytest.mark.skipif(sys.platform == "win32", reason="uses RLIMIT_FSIZE")
def test_a_write_that_runs_out_of_space_keeps_the_previous_checkpoint(tmp_path):
    script = tmp_path / "full_disk.py"
    script.write_text(_FULL_DISK)
    d = tmp_path / "ck"
    out = run_python(script, [d], timeout=60).stdout
    assert f"ERROR could not write checkpoint {d / 'epoch1-step2'}" in out, out
    assert "File too large" in out and f"the previous checkpoint ({d / 'epoch0-step1'}) is untouched" in out
    assert "UNTOUCHED True" in out
    assert _names(d) == ["epoch0-step1", "last"]  # the partial write was removed
    shared, _ = CheckpointManager(d).load("last")
    assert torch.equal(shared["w"], torch.zeros(10))


def test_a_tampered_or_damaged_checkpoint_is_refused(tmp_path):
    m = CheckpointManager(tmp_path)
    p = m.save("epoch0-step1", _state(1))
    marker = tmp_path / "marker"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"model": {}, "x": Evil()}, p / "shared.pt")
    with pytest.raises(CheckpointError, match="damaged: shared.pt has .* bytes, meta.json records"):
        m.load("last")
    # size forged too: the checksum tells
    data = (p / "shared.pt").read_bytes()
    meta = json.loads((p / "meta.json").read_text())
    meta["files"]["shared.pt"] = len(data)
    (p / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="shared.pt is damaged: its checksum is"):
        m.load("last")
    # checksum forged too: the file is refused, nothing in it runs
    meta["checksums"]["shared.pt"] = f"crc32:{zlib.crc32(data):08x}"
    (p / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UnsafeCheckpointError) as e:
        m.load("last")
    assert str(p / "shared.pt") in str(e.value)
    assert not marker.exists()


def test_checkpoint_info_reports_what_it_holds(tmp_path):
    m = CheckpointManager(tmp_path, save_best=("loss", "min"))
    config = Config({"fp16": {"mode": AMP_TYPE.NAIVE}, "BATCH_SIZE": 8, "model": torch.nn.Linear})
    p = m.save("epoch4-step100", {"model": {"w": torch.zeros(256)}, "optimizer": {"state": {}}},
               {"rng": torch.zeros(8, dtype=torch.uint8)}, {"loss": 0.25, "acc": 0.5}, config=config)
    info = checkpoint_info(p)
    assert (info["epoch"], info["step"], info["metrics"]) == (4, 100, {"loss": 0.25, "acc": 0.5})
    assert info["config"] == {"fp16": {"mode": "naive"}, "BATCH_SIZE": 8, "model": "torch.nn.modules.linear.Linear"}
    assert info["version"] == __import__("colossal_lite").__version__
    assert info["entries"]["model"] == 256 * 4 and info["entries"]["optimizer"] == 0
    assert info["files"] == {n: (p / n).stat().st_size for n in ["meta.json", "rank0.pt", "shared.pt"]}
    assert sorted(info["pointers"]) == ["best", "last"]
    assert checkpoint_info(tmp_path / "last")["name"] == "epoch4-step100"


_TWO_RANKS = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from colossal_lite.checkpoint import CheckpointManager
    dist.init_process_group("gloo")
    r = dist.get_rank()
    d = Path(sys.argv[1])
    m = CheckpointManager(d, keep_last_n=1)
    shared = {"model": {"w": torch.arange(6.0)}, "trainer": {"step": 5}}
    p = m.save("epoch0-step5", shared if r == 0 else None, {"rank": r, "noise": torch.full((2,), float(r))})
    print(f"rank{r} saved {p.name} files={sorted(os.listdir(p))}\\n", end="", flush=True)  # one write: lines never mix
    sh, rs = m.load("last")
    print(f"rank{r} loaded step={sh['trainer']['step']} w={sh['model']['w'].tolist()} "
          f"rank={rs['rank']} noise={rs['noise'].tolist()}\\n", end="", flush=True)
    bad = {"rank": r, "fn": (lambda: 0) if r == 1 else 0}  # only rank 1 fails
    try:
        m.save("epoch0-step6", shared if r == 0 else None, bad)
    except Exception as e:
        print(f"rank{r} error {type(e).__name__}: {e}\\n", end="", flush=True)
    print(f"rank{r} after {sorted(os.listdir(d))} last={(d / 'last').read_text().strip()}\\n", end="", flush=True)
    # the legacy single-file API: rank 0 writes, every rank reads, DDP-wrapped or not
    from colossal_lite.utils.checkpointing import load_checkpoint, save_checkpoint
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    ddp(torch.randn(4, 3)).sum().backward()
    opt.step()
    written = save_checkpoint(d / "legacy.pt", 7, ddp, opt)
    dist.barrier()
    plain = torch.nn.Linear(3, 2)
    opt2 = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    epoch = load_checkpoint(d / "legacy.pt", plain, opt2)
    same = all(torch.equal(a, b) for a, b in zip(plain.parameters(), ddp.module.parameters()))
    bufs = [opt2.state[p]["momentum_buffer"] for p in plain.parameters()]
    same_opt = all(torch.equal(a, opt.state[p]["momentum_buffer"]) for a, p in zip(bufs, ddp.parameters()))
    print(f"rank{r} legacy wrote={written is not None} epoch={epoch} same_weights={same} same_optimizer={same_opt}\\n",
          end="", flush=True)
    # a legacy script saves and then loads with no barrier of its own, rank 0 writing the file a while after rank 1
    # returned from save_checkpoint: every rank still reads the new file (rank 1 read the old one and trained on)
    import time
    with torch.no_grad():
        ddp.module.weight.fill_(8.0)
    if r == 0:
        time.sleep(1.0)
    save_checkpoint(d / "legacy.pt", 8, ddp)
    epoch = load_checkpoint(d / "legacy.pt", plain)
    print(f"rank{r} saved then loaded epoch={epoch} weight={plain.weight[0, 0].item()}\\n", end="", flush=True)
    from colossal_lite.utils import report_memory_usage
    report_memory_usage("legacy memory report")  # on rank 0 only, as the library's other output
    dist.destroy_process_group()
""")


def test_two_ranks_write_shared_state_once_and_their_own_state_each(tmp_path):
    """Also the legacy save_checkpoint/load_checkpoint on two ranks (one torchrun for both: it costs seconds)."""
    script = tmp_path / "two_ranks.py"
    script.write_text(_TWO_RANKS)
    d = tmp_path / "ck"
    out = run_ranks(script, [d], nproc=2, timeout=120).stdout
    for r in (0, 1):
        assert f"rank{r} saved epoch0-step5 files=['meta.json', 'rank0.pt', 'rank1.pt', 'shared.pt']" in out, out
        assert (f"rank{r} loaded step=5 w=[0.0, 1.0, 2.0, 3.0, 4.0, 5.0] rank={r} noise=[{float(r)}, {float(r)}]"
                in out), out
        assert f"rank{r} after ['epoch0-step5', 'last'] last=epoch0-step5" in out, out
        assert f"rank{r} legacy wrote={r == 0} epoch=7 same_weights=True same_optimizer=True" in out, out
        assert f"rank{r} saved then loaded epoch=8 weight=8.0" in out, out
    assert out.count("legacy memory report: CPU") == 1, out
    assert "rank1 error UnsupportedValueError: cannot store rank_state['fn']" in out, out
    assert (f"rank0 error CheckpointWriteError: checkpoint {d / 'epoch0-step6'} was not written: rank 1 failed: "
            f"UnsupportedValueError: cannot store rank_state['fn']") in out, out
    # one process resuming a two-rank checkpoint gets rank 0's state and a warning
    with pytest.warns(UserWarning, match="written by 2 rank\\(s\\) and this run has 1"):
        shared, rank = CheckpointManager(d).load("last")
    assert rank["rank"] == 0 and shared["trainer"]["step"] == 5
