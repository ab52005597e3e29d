"""``SaveCheckpointHook(interval, 'xxx.pt', model)`` -- the legacy single file of the model-checkpoint docs page and
the SimCLR example -- and ``load_checkpoint`` on a checkpoint folder.

The file is ``save_checkpoint``'s format, rewritten atomically at each interval; a write that fails or a process
killed while writing leaves the previous file whole and loadable. ``load_checkpoint(folder)`` loads the folder's
``last``; the "truncated or damaged" message stays for truncated files and is not used for folders.
"""
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from dist_helpers import REPO, _env, run_python, run_ranks
from torch import nn

import colossal_lite
from colossal_lite.checkpoint.io import CheckpointDamagedError, CheckpointNotFoundError
from colossal_lite.trainer import Trainer, hooks
from colossal_lite.utils import load_checkpoint


def _legacy_run(tmp_path, epochs, checkpoint_path, probe=None, resume_from=None):
    """A legacy-style trainer program: LR scheduler by epoch, SaveCheckpointHook(interval, path, model)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 4, generator=g), torch.randint(0, 2, (4,), generator=g)) for _ in range(3)]
    engine, loader, _, scheduler = colossal_lite.initialize(model, optimizer, nn.CrossEntropyLoss(), data,
                                                            lr_scheduler=scheduler, verbose=False)
    trainer = Trainer(engine)
    extra = [probe] if probe is not None else []
    trainer.fit(loader, epochs=epochs, display_progress=False,
                hooks=[hooks.LRSchedulerHook(scheduler, by_epoch=True),
                       hooks.SaveCheckpointHook(1, str(checkpoint_path), model), *extra], resume_from=resume_from)
    return model, optimizer, scheduler


def _fresh():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)


def _same_weights(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("suffix", [".pt", ".pth"])
def test_file_path_hook_rewrites_the_legacy_file_at_each_interval(tmp_path, suffix):
    path = tmp_path / "out" / f"ck{suffix}"
    seen = []

    class Probe(hooks.BaseHook):
        """At each epoch's start the file holds the epoch before it and the weights the model has now."""

        def __init__(self):
            super().__init__(priority=1000)

        def before_train_epoch(self, trainer):
            if trainer.state.epoch > 0:
                state = torch.load(path, weights_only=True)
                model = trainer.engine.model
                seen.append((state["epoch"], all(torch.equal(state["model"][k], v)
                                                 for k, v in model.state_dict().items())))

    model, optimizer, scheduler = _legacy_run(tmp_path, 3, path, probe=Probe())
    assert seen == [(0, True), (1, True)]
    assert sorted(os.listdir(path.parent)) == [path.name]  # one file, overwritten; no folders, no leftovers
    state = torch.load(path, weights_only=True)
    assert sorted(state) == ["colossal_lite", "engine", "epoch", "lr_scheduler", "model", "optimizer"]
    assert state["engine"]["num_updates"] == 3 * 3  # the engine's own state: its update count, its loss scaler
    # load_checkpoint reads it: weights, optimizer (momentum) and scheduler of the end of epoch 2
    m, o, s = _fresh()
    assert load_checkpoint(path, m, o, s) == 2
    assert _same_weights(m, model)
    assert s.get_last_lr() == scheduler.get_last_lr() == [0.1 * 0.5 ** 3]
    for p, q in zip(m.parameters(), model.parameters()):
        torch.testing.assert_close(o.state[p]["momentum_buffer"], optimizer.state[q]["momentum_buffer"])


def test_file_path_hook_refuses_folder_options_and_resume(tmp_path):
    with pytest.raises(ValueError, match="save_best and keep_last_n choose among checkpoint folders"):
        hooks.SaveCheckpointHook(1, str(tmp_path / "ck.pt"), keep_last_n=2)
    with pytest.raises(ValueError, match=r"cannot continue from it exactly: load it with LoadCheckpointHook\("):
        _legacy_run(tmp_path, 1, tmp_path / "ck.pt", resume_from="auto")


def test_load_checkpoint_on_a_folder_loads_its_last(tmp_path):
    root = tmp_path / "ck"
    model, optimizer, scheduler = _legacy_run(tmp_path, 2, root)
    for where in (root, root / "last", root / "epoch1-step6"):
        m, o, s = _fresh()
        assert not _same_weights(m, model)
        assert load_checkpoint(where, m, o, s) == 1  # named after the epoch it finished, as the file is
        assert _same_weights(m, model)
        assert s.get_last_lr() == scheduler.get_last_lr()
        for p, q in zip(m.parameters(), model.parameters()):
            torch.testing.assert_close(o.state[p]["momentum_buffer"], optimizer.state[q]["momentum_buffer"])
    m, _, _ = _fresh()
    assert load_checkpoint(root / "epoch0-step3", m) == 0
    assert not _same_weights(m, model)  # an earlier checkpoint: the weights after epoch 0
    # a folder of checkpoints without a 'last' pointer: its newest one
    (root / "last").unlink()
    m, _, _ = _fresh()
    assert load_checkpoint(root, m) == 1 and _same_weights(m, model)


def test_a_folder_is_not_called_damaged_and_a_truncated_file_is(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    m, _, _ = _fresh()
    with pytest.raises(CheckpointNotFoundError) as e:
        load_checkpoint(empty, m)
    assert "is a folder, not a checkpoint file" in str(e.value)
    assert "truncated or damaged" not in str(e.value)

    path = tmp_path / "ck.pt"
    _legacy_run(tmp_path, 1, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointDamagedError, match="it is truncated or damaged"):
        load_checkpoint(path, m)


# A legacy program whose second save cannot be written: the file-size limit of the process (RLIMIT_FSIZE, a real
# write error, EFBIG) is lowered below the file's size after the first save.
WRITE_ERROR = textwrap.dedent("""
    import resource, signal, sys
    import torch
    from torch import nn
    import colossal_lite
    from colossal_lite.checkpoint.io import CheckpointWriteError
    from colossal_lite.trainer import Trainer, hooks
    from colossal_lite.utils import load_checkpoint

    path = sys.argv[1]
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(4, 64), torch.randn(4, 64)) for _ in range(2)]
    engine, loader, *_ = colossal_lite.initialize(model, optimizer, nn.MSELoss(), data, verbose=False)
    after_epoch_0 = {}

    class LimitWrites(hooks.BaseHook):
        def before_train_epoch(self, trainer):
            if trainer.state.epoch == 1:  # epoch 0's file is written: no file may grow past 1 KiB from now on
                after_epoch_0.update({k: v.clone() for k, v in model.state_dict().items()})
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of a signal
                resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))

    try:
        Trainer(engine).fit(loader, epochs=2, display_progress=False,
                            hooks=[hooks.SaveCheckpointHook(1, path, model), LimitWrites()])
    except CheckpointWriteError as e:
        print("WRITE ERROR:", e)
    fresh = nn.Linear(64, 64)
    epoch = load_checkpoint(path, fresh)
    same = all(torch.equal(fresh.state_dict()[k], v) for k, v in after_epoch_0.items())
    moved = not torch.equal(model.weight, after_epoch_0["weight"])
    print(f"LOADED epoch={epoch} same_as_epoch_0={same} model_moved_on={moved}")
""")


def test_a_failed_write_leaves_the_previous_file_intact_and_loadable(tmp_path):
    script, path = tmp_path / "write_error.py", tmp_path / "ck.pt"
    script.write_text(WRITE_ERROR)
    out = run_python(script, [path], timeout=120).stdout
    assert f"WRITE ERROR: could not write checkpoint {path}" in out and "an earlier file at that path is untouched" \
        in out, out
    assert "LOADED epoch=0 same_as_epoch_0=True model_moved_on=True" in out, out
    assert sorted(os.listdir(tmp_path)) == ["ck.pt", "write_error.py"]  # the temp file was removed


# A writer saving by iteration a model big enough that a kill often lands inside a write. It logs a fingerprint of
# the weights before each save ("writing") and after it ("saved").
KILLED = textwrap.dedent("""
    import os, sys
    import torch
    from torch import nn
    import colossal_lite
    from colossal_lite.trainer import Trainer, hooks

    path, log = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = nn.Linear(1024, 1024)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.randn(2, 1024), torch.randn(2, 1024)) for _ in range(4)]
    engine, loader, *_ = colossal_lite.initialize(model, optimizer, nn.MSELoss(), data, verbose=False)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)

    class Logged(hooks.SaveCheckpointHook):
        def save(self, trainer):
            fingerprint = f"{model.weight.double().sum().item():.12e}"
            os.write(fd, f"writing {fingerprint}\\n".encode())
            out = super().save(trainer)
            os.write(fd, f"saved {fingerprint}\\n".encode())
            return out

    Trainer(engine).fit(loader, epochs=1000, display_progress=False,
                        hooks=[Logged(1, path, model, save_by_iter=True)])
""")


def test_a_process_killed_while_writing_leaves_a_whole_file(tmp_path):
    script, path, log = tmp_path / "killed.py", tmp_path / "ck.pt", tmp_path / "log.txt"
    script.write_text(KILLED)
    rng = random.Random(22)
    killed = []
    for _ in range(3):
        log.write_text("")
        proc = subprocess.Popen([sys.executable, str(script), str(path), str(log)], env=_env(), cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while log.read_text().count("saved") < 2:  # a first file exists: the kill can only replace it
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "the writer saved nothing in 120 s"
            time.sleep(0.02)
        # what earlier killed writers left mid-write was removed when this run started
        assert not [p.name for p in tmp_path.glob(".tmp-*") if int(p.name.rsplit("-", 1)[1]) in killed]
        time.sleep(rng.uniform(0.0, 0.3))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stderr.close()
        killed.append(proc.pid)
        lines = log.read_text().splitlines()
        last_saved = max(i for i, line in enumerate(lines) if line.startswith("saved"))
        allowed = {lines[last_saved].split()[1]}  # the newest finished save, or the one being written at the kill
        allowed |= {line.split()[1] for line in lines[last_saved + 1:] if line.startswith("writing")}
        fresh = nn.Linear(1024, 1024)
        load_checkpoint(path, fresh)  # verifies the zip records' CRC-32 first
        assert f"{fresh.weight.double().sum().item():.12e}" in allowed
        assert {p.name for p in tmp_path.glob(".tmp-*")} <= {f".tmp-ck.pt-{proc.pid}"}


TWO_RANKS = textwrap.dedent("""
    import sys
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from torch import nn
    import colossal_lite
    from colossal_lite.core import global_context as gpc
    from colossal_lite.trainer import Trainer, hooks
    from colossal_lite.utils import load_checkpoint

    out = Path(sys.argv[1])
    colossal_lite.launch_from_torch(config={}, verbose=False)
    rank = gpc.get_global_rank()
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1 + rank)
    data = [(torch.randn(4, 4, generator=g), torch.randint(0, 2, (4,), generator=g)) for _ in range(3)]
    engine, loader, *_ = colossal_lite.initialize(model, optimizer, nn.CrossEntropyLoss(), data, verbose=False)
    Trainer(engine).fit(loader, epochs=2, display_progress=False,
                        hooks=[hooks.SaveCheckpointHook(1, str(out / "ck.pt"), model),
                               hooks.SaveCheckpointHook(1, str(out / "ckdir"))])
    dist.barrier()
    for where in ("ck.pt", "ckdir"):
        fresh = nn.Linear(4, 2)
        epoch = load_checkpoint(out / where, fresh)
        same = torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
        print(f"rank {rank} {where} epoch={epoch} same={same}\\n", end="", flush=True)  # one write: lines never mix
    gpc.destroy()
""")


def test_two_ranks_rank_0_writes_the_file_and_both_load_file_and_folder(tmp_path):
    script = tmp_path / "two.py"
    script.write_text(TWO_RANKS)
    out = run_ranks(script, [tmp_path], nproc=2, timeout=180).stdout
    for rank in (0, 1):
        for where in ("ck.pt", "ckdir"):
            assert f"rank {rank} {where} epoch=1 same=True" in out, out
    assert not list(tmp_path.glob(".tmp-*"))
