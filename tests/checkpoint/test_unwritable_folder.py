"""A checkpoint folder that cannot be written: a read-only file system, or a folder without write permission.

Both are real: the read-only file system is a tmpfs mounted and then remounted read-only inside a
user and mount namespace of the test's own (``unshare``, which needs no privileges), and the
permission case runs in a user namespace without root's right to ignore permissions, so it is
tested when the suite runs as root too. Every rank must raise the same ``CheckpointWriteError``
naming the checkpoint and the untouched previous one; the previous checkpoint still loads.
"""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from dist_helpers import REPO, _env, _run, ranks_command


def _namespace_works(args) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", *args], capture_output=True, text=True, timeout=30)
    return probe.returncode == 0


def _read_only_mount(mnt):
    """A command prefix running in a mount namespace where ``mnt`` is a fresh tmpfs (remounted read-only later)."""
    mnt.mkdir()
    if not _namespace_works(["--user", "--map-root-user", "--mount", "sh", "-c",
                             f"mount -t tmpfs tmpfs {mnt} && mount -o remount,ro {mnt}"]):
        pytest.skip("unshare cannot mount a tmpfs in a user namespace here")
    return ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
            f'mount -t tmpfs -o size=16m tmpfs {mnt} && exec "$@"', "sh"]


def _without_root_rights():
    """A command prefix under which folder permissions apply (root ignores them)."""
    if os.geteuid() != 0:
        return []
    if not _namespace_works(["--user", "true"]):
        pytest.skip("running as root and unshare cannot start a user namespace: a read-only folder is writable")
    return ["unshare", "--user"]


def _output(cmd, timeout=60):
    proc = _run(cmd, timeout, _env(), REPO)  # a timeout fails the test with the output so far
    return proc, proc.stdout + proc.stderr


_ONE_PROCESS = textwrap.dedent("""
    import os, subprocess, sys
    import torch
    from colossal_lite.checkpoint import CheckpointManager
    d, how = sys.argv[1], sys.argv[2]
    m = CheckpointManager(d)
    m.save("epoch0-step1", {"w": torch.zeros(3)})
    if how == "remount":
        subprocess.run(["mount", "-o", "remount,ro", os.path.dirname(d)], check=True)
    else:
        os.chmod(d, 0o555)
    state = {"w": torch.ones(3)}
    try:
        m.save("epoch0-step2", state)
    except Exception as e:
        print(f"ERROR {type(e).__name__} isinstance-OSError={isinstance(e, OSError)}: {e}", flush=True)
    shared, _ = m.load("last")
    print("LAST", shared["w"].tolist(), "UNTOUCHED", state["w"].tolist(), sorted(os.listdir(d)), flush=True)
    os.chmod(d, 0o755) if how != "remount" else None
""")


@pytest.mark.parametrize("how", ["read-only file system", "folder without write permission"])
def test_an_unwritable_folder_raises_the_documented_error_and_keeps_the_previous(tmp_path, how):
    script = tmp_path / "unwritable.py"
    script.write_text(_ONE_PROCESS)
    if how == "read-only file system":
        mnt = tmp_path / "mnt"
        prefix, ck, arg, reason = _read_only_mount(mnt), mnt / "ck", "remount", "Read-only file system [EROFS]"
    else:
        prefix, ck, arg, reason = _without_root_rights(), tmp_path / "ck", "chmod", "Permission denied (no permission to write there) [EACCES]"
    proc, out = _output(prefix + [sys.executable, str(script), str(ck), arg])
    assert proc.returncode == 0, out
    assert (f"ERROR CheckpointWriteError isinstance-OSError=True: could not write checkpoint {ck / 'epoch0-step2'} "
            f"({ck / '.tmp-epoch0-step2-'}") in out, out
    assert f"): {reason}; the previous checkpoint ({ck / 'epoch0-step1'}) is untouched" in out, out
    assert "LAST [0.0, 0.0, 0.0] UNTOUCHED [1.0, 1.0, 1.0] ['epoch0-step1', 'last']" in out, out


_TWO_RANKS = textwrap.dedent("""
    import os, subprocess, sys
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    import colossal_lite
    from colossal_lite.checkpoint import CheckpointManager
    from colossal_lite.core import global_context as gpc
    from colossal_lite.trainer import Trainer
    from colossal_lite.trainer.hooks import SaveCheckpointHook
    from colossal_lite.utils import get_dataloader
    mnt, ck = sys.argv[1], sys.argv[2]
    colossal_lite.launch_from_torch(config={}, seed=0, verbose=False)
    rank = gpc.get_global_rank()
    model = nn.Linear(4, 2)
    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                    nn.CrossEntropyLoss(), get_dataloader(data, batch_size=4),
                                                    verbose=False)
    trainer = Trainer(engine)
    trainer.fit(loader, epochs=1, hooks=[SaveCheckpointHook(1, ck)])
    torch.distributed.barrier()
    if rank == 0:
        subprocess.run(["mount", "-o", "remount,ro", mnt], check=True)
    torch.distributed.barrier()
    try:  # (log_dir=False: no metrics file, so the first write is the checkpoint's)
        trainer.fit(loader, epochs=2, hooks=[SaveCheckpointHook(1, ck)], resume_from="auto", log_dir=False)
    except Exception as e:
        print(f"rank{rank} {type(e).__name__}: {e}\\n", end="", flush=True)  # one write: ranks' lines never mix
    try:  # the metrics file beside the checkpoints cannot be written either: every rank fails at the start
        trainer.fit(loader, epochs=2, hooks=[SaveCheckpointHook(1, ck)], resume_from="auto")
    except Exception as e:
        print(f"rank{rank} metrics {type(e).__name__}: {e}\\n", end="", flush=True)
    shared, _ = CheckpointManager(ck).load("last")
    print(f"rank{rank} last is step {shared['trainer']['progress']['step']}\\n", end="", flush=True)
    gpc.destroy()
""")


def test_two_ranks_both_raise_the_same_error_on_a_read_only_file_system(tmp_path):
    """Rank 0 meets the read-only file system; both ranks raise CheckpointWriteError (no gloo error)."""
    script = tmp_path / "two_ranks_read_only.py"
    script.write_text(_TWO_RANKS)
    mnt = tmp_path / "mnt"
    prefix = _read_only_mount(mnt)
    ck = mnt / "ck"
    proc, out = _output(prefix + ranks_command(script, [mnt, ck]))
    assert proc.returncode == 0, out
    message = (f"CheckpointWriteError: could not write checkpoint {ck / 'epoch1-step4'} ({ck / '.tmp-epoch1-step4-'}")
    untouched = f"): Read-only file system [EROFS]; the previous checkpoint ({ck / 'epoch0-step2'}) is untouched"
    lines = {r: next((line for line in out.splitlines() if line.startswith(f"rank{r} CheckpointWriteError")), "")
             for r in (0, 1)}
    for r in (0, 1):
        assert lines[r].startswith(f"rank{r} {message}") and untouched in lines[r], out
        assert f"rank{r} last is step 2" in out, out
    assert lines[1] == lines[0].replace("rank0", "rank1", 1) + " (reported by rank 0)", out
    metrics = [next((line for line in out.splitlines() if line.startswith(f"rank{r} metrics")), "") for r in (0, 1)]
    # the documented CheckpointWriteError on every rank, naming the file and the ways on (issue 29, item 7)
    assert metrics[0].startswith(f"rank0 metrics CheckpointWriteError: the run's metrics file {ck / 'metrics.jsonl'} "
                                 f"cannot be written (OSError: [Errno 30] Read-only file system"), out
    assert "fit(log_dir=False) for no metrics file" in metrics[0], out
    assert metrics[1] == (f"rank1 metrics CheckpointWriteError: a tracker could not start: "
                          f"{metrics[0][len('rank0 metrics '):]} (reported by rank 0)"), out
    assert "Connection closed" not in out and "Traceback" not in out, out
