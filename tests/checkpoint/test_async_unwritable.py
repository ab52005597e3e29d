"""Asynchronous saves on a disk that fills up during the background write, and on a read-only file system.

Both are real (a 16 MiB tmpfs in a user and mount namespace of the test's own, as in
``test_unwritable_folder.py``), with two ranks in one launch. The background write of rank 0's
``shared.pt`` meets the full disk while training goes on; at the next step boundary every rank
raises ``CheckpointWriteError`` naming the checkpoint, and the previous checkpoint stays complete
and loads. On the read-only file system the folder cannot even be made: every rank raises at the step
the save was due.
"""
import importlib.util
import textwrap
from pathlib import Path

import pytest
from dist_helpers import ranks_command


def _unwritable_helpers():
    path = Path(__file__).with_name("test_unwritable_folder.py")
    spec = importlib.util.spec_from_file_location("unwritable_helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_SCRIPT = textwrap.dedent("""
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
    model = nn.Linear(1024, 1024)  # with Adam's two moments a checkpoint of 12.6 MB: one fits in 16 MiB, two do not
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(128, 1024, generator=g), torch.randint(0, 1024, (128,), generator=g))
    engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.Adam(model.parameters(), lr=0.1),
                                                    nn.CrossEntropyLoss(), get_dataloader(data, batch_size=4),
                                                    verbose=False)
    trainer = Trainer(engine)

    def say(text):
        print(f"rank{rank} {text}\\n", end="", flush=True)  # one write: ranks' lines never mix

    try:  # saves every 2 of 16 steps: step 2 fits, at step 4 the disk fills up in the background
        trainer.fit(loader, epochs=1, hooks=[SaveCheckpointHook("2ba", ck, async_save=True)], log_dir=False)
        say("no error")
    except Exception as e:
        say(f"full at step {trainer.state.step} {type(e).__name__}: {e}")
    shared, _ = CheckpointManager(ck).load("last")
    say(f"last is step {shared['trainer']['progress']['step']} {sorted(os.listdir(ck))}")
    torch.distributed.barrier()
    if rank == 0:
        subprocess.run(["mount", "-o", "remount,ro", mnt], check=True)
    torch.distributed.barrier()
    try:
        trainer.fit(loader, epochs=2, hooks=[SaveCheckpointHook("1ba", ck, async_save=True)], resume_from="auto",
                    log_dir=False)
    except Exception as e:
        say(f"read-only at step {trainer.state.step} {type(e).__name__}: {e}")
    gpc.destroy()
""")


@pytest.mark.slow  # starts processes through helpers the conftest rule does not know
def test_async_saves_on_a_full_disk_and_a_read_only_file_system_raise_on_every_rank(tmp_path):
    helpers = _unwritable_helpers()
    script = tmp_path / "async_unwritable.py"
    script.write_text(_SCRIPT)
    mnt = tmp_path / "mnt"
    prefix = helpers._read_only_mount(mnt)
    ck = mnt / "ck"
    proc, out = helpers._output(prefix + ranks_command(script, [mnt, ck]), timeout=180)
    assert proc.returncode == 0, out
    lines = {r: {line.split(" ", 2)[1]: line for line in out.splitlines() if line.startswith(f"rank{r} ")}
             for r in (0, 1)}
    full = [lines[r].get("full", "") for r in (0, 1)]
    # raised at the step boundary after the failure: the next one (5), or at the latest the next save (6), which
    # waits for it
    step = full[0].split(" ")[4]
    assert step in ("5", "6") and full[1].startswith(f"rank1 full at step {step} "), out
    message = f"CheckpointWriteError: could not write checkpoint {ck / 'epoch0-step4'}"
    assert full[0].startswith(f"rank0 full at step {step} {message}"), out
    assert full[1].startswith(f"rank1 full at step {step} {message}"), out
    untouched = f"No space left on device (the disk is full) [ENOSPC]; the previous checkpoint ({ck / 'epoch0-step2'}) " \
                f"is untouched"
    # rank 1 raises rank 0's error, or its own when the full disk refused its file too
    assert full[0].endswith(untouched) and full[1].endswith((untouched, f"{untouched} (reported by rank 0)")), out
    for r in (0, 1):  # the previous checkpoint is complete and loads; nothing half-written is left
        assert lines[r]["last"] == f"rank{r} last is step 2 ['epoch0-step2', 'last']", out
    read_only = [lines[r].get("read-only", "") for r in (0, 1)]
    message = f"CheckpointWriteError: could not write checkpoint {ck / 'epoch0-step3'} ({ck / '.tmp-epoch0-step3-'}"
    assert read_only[0].startswith(f"rank0 read-only at step 3 {message}"), out
    assert read_only[1].startswith(f"rank1 read-only at step 3 {message}") and "(reported by rank 0)" in read_only[1]
    assert "): Read-only file system [EROFS]; the previous checkpoint" in read_only[0], out
    assert "Traceback" not in out, out
