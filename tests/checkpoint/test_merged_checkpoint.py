"""`colossal-lite ckpt merge`: a ZeRO stage 3 checkpoint of a 2-rank run, merged into one file, resumes with
fit(resume_from=...), LoadCheckpointHook and load_checkpoint under DDP, stage 1, 2 and 3 on 2 ranks and in one
process, to the model and optimizer state that resuming from the sharded checkpoint itself gives; `ckpt export`
reads a sharded checkpoint; a damaged merged file is refused naming it.

One 2-rank launch (the ``stage3_run`` fixture) trains 2 steps with stage 3 and saves mid-epoch, resumes from
that sharded checkpoint to the end (the reference), merges it with the CLI, then resumes the merged file
every way; the one-process resume runs in this test process with the same code.
"""
import json
import re
import textwrap
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from dist_helpers import run_ranks

from colossal_lite.checkpoint import CheckpointDamagedError, CheckpointError, CheckpointManager
from colossal_lite.checkpoint.cli import main as ckpt_main
from colossal_lite.checkpoint.io import format_bytes
from colossal_lite.utils import load_checkpoint, save_checkpoint

COMMON = textwrap.dedent("""
    import json, sys
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    import colossal_lite
    from colossal_lite.core import global_context as gpc
    from colossal_lite.trainer import Trainer
    from colossal_lite.trainer.hooks import BaseHook, LoadCheckpointHook, LossHook, LRSchedulerHook, SaveCheckpointHook
    from colossal_lite.utils import barrier, get_dataloader, load_checkpoint, save_checkpoint

    def build(zero):
        gpc.load_config(dict(zero=zero) if zero else {})
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 3))
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g))
        engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.Adam(model.parameters(), lr=0.01),
                                                        nn.CrossEntropyLoss(),
                                                        get_dataloader(data, shuffle=True, batch_size=4),
                                                        verbose=False)
        # built on the engine's optimizer, which zero rebuilds over its shards
        sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, 2, 0.8)
        return engine, loader, sched

    def snapshot(engine, trainer):
        state = engine.state_dict()  # a collective under zero: full tensors on every rank
        optim = state["optimizer"]  # keyed by parameter name under zero 2/3, by position otherwise
        order = [p for g in optim["param_groups"] for p in g["params"]]
        return dict(model={k: v.tolist() for k, v in state["model"].items()},
                    optim={str(i): {k: v.tolist() for k, v in optim["state"].get(p, {}).items()} for i, p in enumerate(order)},
                    lr=[g["lr"] for g in optim["param_groups"]], step=trainer.state.step, epoch=trainer.state.epoch)

    class Snapshot(BaseHook):
        \"\"\"The state right after the checkpoint was loaded (before_train comes after the restore).\"\"\"
        def __init__(self, into):
            super().__init__(priority=100)
            self.into = into
        def before_train(self, trainer):
            self.into["loaded"] = snapshot(trainer.engine, trainer)

    def fit(zero, resume=None, save_to=None, load_hook=None, max_steps=None):
        # 2 epochs of 32 samples in batches of 4 a rank: 4 optimizer steps an epoch on 2 ranks, 8 in one process
        engine, loader, sched = build(zero)
        result = {}
        hooks = [LossHook(), LRSchedulerHook(sched, by_epoch=False), Snapshot(result)]
        if save_to:
            hooks.append(SaveCheckpointHook(1, save_to))  # every epoch, and at the end (max_steps)
        if load_hook:
            hooks.append(LoadCheckpointHook(load_hook))
        trainer = Trainer(engine)
        trainer.fit(loader, epochs=2, max_steps=max_steps, hooks=hooks, resume_from=resume)
        result["final"] = snapshot(engine, trainer)
        return result
""")

SCRIPT = COMMON + textwrap.dedent("""
    from colossal_lite.checkpoint.cli import main as ckpt_main

    ck, out = sys.argv[1], sys.argv[2]
    colossal_lite.launch_from_torch(config={}, seed=5, verbose=False)
    stage3, merged = dict(stage=3), ck + "/merged.pt"
    fit(stage3, save_to=ck, max_steps=2)
    results = dict(sharded=fit(stage3, resume=ck + "/epoch0-step2"))  # the reference
    if gpc.get_global_rank() == 0:  # one process, no collectives: as a user runs it
        assert ckpt_main(["ckpt", "merge", ck + "/epoch0-step2", merged]) == 0
    barrier()
    # the merged file, every way a checkpoint is accepted
    results.update(ddp=fit(None, resume=merged, save_to=ck + "/ddp"), zero1=fit(dict(stage=1), resume=merged),
                   zero2=fit(dict(stage=2), resume=merged), zero3=fit(stage3, resume=merged),
                   hook_ddp=fit(None, load_hook=merged))
    # and back: the unsharded run's checkpoint (optimizer state by position) resumes under stage 3
    results["ddp_checkpoint_zero3"] = fit(stage3, resume=ck + "/ddp/epoch0-step4")
    engine, _, sched = build(stage3)
    epoch = load_checkpoint(merged, engine.model, engine.optimizer, sched)
    results["load_checkpoint_zero3"] = dict(epoch=epoch, lr=sched.get_last_lr(),
                                            loaded=snapshot(engine, Trainer(engine)))
    # a save_checkpoint file of an unsharded run (optimizer state by position) into a stage 3 model
    engine, _, sched = build(None)
    load_checkpoint(merged, engine.model, engine.optimizer, sched)
    save_checkpoint(ck + "/legacy.pt", 0, engine.model, engine.optimizer, sched)
    barrier()
    engine, _, sched = build(stage3)
    load_checkpoint(ck + "/legacy.pt", engine.model, engine.optimizer, sched)
    results["legacy_file_zero3"] = dict(lr=sched.get_last_lr(), loaded=snapshot(engine, Trainer(engine)))
    if gpc.get_global_rank() == 0:
        json.dump(results, open(out, "w"))
    gpc.destroy()
""")


def _close(got, want, where):
    """Same structure, numbers equal within float32 reduction-order noise."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            _close(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                                   rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {m}")
    else:
        assert got == pytest.approx(want, rel=1e-6), where


@pytest.fixture(scope="module")
def stage3_run(tmp_path_factory):
    """One 2-rank launch: train with stage 3, resume from its sharded checkpoint (the reference), merge it,
    resume the merged file every way; returns the checkpoint folder and the results."""
    tmp = tmp_path_factory.mktemp("merged")
    script = tmp / "train.py"
    script.write_text(SCRIPT)
    run_ranks(script, [tmp / "ck", tmp / "results.json"], nproc=2, timeout=150)
    return tmp / "ck", json.loads((tmp / "results.json").read_text())


def test_merged_file_resumes_under_ddp_and_every_zero_stage_on_two_ranks(stage3_run):
    _, got = stage3_run
    reference = got["sharded"]
    assert reference["loaded"]["step"] == 2 and reference["loaded"]["epoch"] == 0
    assert reference["final"]["step"] == 8
    for name in ("ddp", "zero1", "zero2", "zero3", "hook_ddp"):
        _close(got[name]["loaded"], reference["loaded"], f"{name} after loading")
        _close(got[name]["final"], reference["final"], f"{name} at the end")
    assert got["ddp_checkpoint_zero3"]["loaded"]["step"] == 4
    _close(got["ddp_checkpoint_zero3"]["final"], reference["final"], "a DDP checkpoint resumed under stage 3")
    assert got["load_checkpoint_zero3"]["epoch"] == 0
    for name in ("load_checkpoint_zero3", "legacy_file_zero3"):
        assert got[name]["lr"] == reference["loaded"]["lr"], name
        _close(got[name]["loaded"]["model"], reference["loaded"]["model"], f"{name} model")
        _close(got[name]["loaded"]["optim"], reference["loaded"]["optim"], f"{name} optimizer")


def test_merged_file_resumes_in_one_process(stage3_run):
    ck, got = stage3_run
    reference = got["sharded"]["loaded"]
    namespace = {}
    exec(compile(COMMON, "common", "exec"), namespace)  # the build/fit/snapshot code the ranks ran
    colossal_lite, gpc = namespace["colossal_lite"], namespace["gpc"]
    try:
        colossal_lite.launch_from_torch(config={}, seed=5, verbose=False)
        with pytest.warns(UserWarning, match="written by 2 rank"):
            resumed = namespace["fit"](None, resume=str(ck / "merged.pt"))
        _close(resumed["loaded"], reference, "one process after loading")
        # taken after 2 of the 4 batches per rank of epoch 0 on 2 ranks, half its samples: one process goes on
        # after 4 of its 8 batches (it went on after 2, training a quarter of the epoch twice): 4 + 8 more steps
        assert resumed["final"]["step"] == 14 and resumed["final"]["model"] != reference["model"]

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the world-size warning, tested above
            hooked = namespace["fit"](None, load_hook=str(ck / "merged.pt"))
        _close(hooked, resumed, "LoadCheckpointHook vs fit(resume_from=...)")

        engine, _, sched = namespace["build"](None)
        epoch = namespace["load_checkpoint"](str(ck / "merged.pt"), engine.model, engine.optimizer, sched)
        loaded = namespace["snapshot"](engine, namespace["Trainer"](engine))
        assert epoch == 0 and sched.get_last_lr() == reference["lr"]
        _close(loaded["model"], reference["model"], "load_checkpoint model")
        _close(loaded["optim"], reference["optim"], "load_checkpoint optimizer")
    finally:
        gpc.destroy()


def test_ckpt_export_reads_the_shards_and_info_describes_the_merged_file(stage3_run, tmp_path, capsys):
    ck, _ = stage3_run
    folder = ck / "epoch0-step2"
    assert ckpt_main(["ckpt", "export", str(folder), str(tmp_path / "from_shards.pt")]) == 0
    assert ckpt_main(["ckpt", "export", str(ck / "merged.pt"), str(tmp_path / "from_merged.pt")]) == 0
    a = torch.load(tmp_path / "from_shards.pt", weights_only=True)
    b = torch.load(tmp_path / "from_merged.pt", weights_only=True)
    assert list(a) == ["0.weight", "0.bias", "3.weight", "3.bias"] and all(torch.equal(a[k], b[k]) for k in a)

    capsys.readouterr()
    assert ckpt_main(["ckpt", "info", str(ck / "merged.pt")]) == 0
    out = capsys.readouterr().out
    assert f"merged from: {folder} (resumes with any number of ranks and any zero stage)" in out
    assert "epoch: 0   step: 2" in out and "2 rank(s)" in out and "zero = {'stage': 3}" in out
    assert "checksums: every record matches the CRC-32 recorded in the file" in out

    # the folder itself: its shards listed with their sizes, and said to hold what the entries do not
    # (the listing stopped at the folder's top, and showed the engine entry as 0 B; found by a probe)
    assert ckpt_main(["ckpt", "info", str(folder)]) == 0
    out = capsys.readouterr().out
    shards = sorted(p for p in (folder / "sharded").iterdir() if p.is_file())
    assert len(shards) >= 3  # .metadata and a file per rank
    for shard in shards:
        assert re.search(rf"^    sharded/{re.escape(shard.name)} +{re.escape(format_bytes(shard.stat().st_size))}$",
                         out, re.M), out
    total = format_bytes(sum(p.stat().st_size for p in shards))
    assert f"tensor data by entry (the model and optimizer state are in sharded/, {total}, not below):" in out, out

    assert ckpt_main(["ckpt", "merge", str(ck / "merged.pt"), str(tmp_path / "again.pt")]) == 1
    assert f"error: {ck / 'merged.pt'} is already a single file: ckpt merge reads a checkpoint folder" in \
        capsys.readouterr().err


def _flip_a_tensor_bit(source, damaged):
    """Copy ``source`` (a torch.save file) to ``damaged`` with one bit flipped in the middle of a tensor's data;
    returns the message that names the damaged record."""
    data = bytearray(Path(source).read_bytes())
    with zipfile.ZipFile(source) as archive:
        record = next(r for r in archive.infolist() if "/data/" in r.filename and r.file_size >= 64)
    start = record.header_offset  # the local header: 30 bytes, then the name and the extra field
    name_len, extra_len = (int.from_bytes(data[start + at:start + at + 2], "little") for at in (26, 28))
    data[start + 30 + name_len + extra_len + record.file_size // 2] ^= 0x01
    Path(damaged).write_bytes(bytes(data))
    return re.escape(f"checkpoint file {damaged} is damaged: its record {record.filename} differs from the "
                     f"CRC-32 recorded for it when it was written")


def test_a_damaged_merged_file_is_refused_naming_it(stage3_run, tmp_path):
    ck, _ = stage3_run
    damaged = tmp_path / "merged.pt"
    message = _flip_a_tensor_bit(ck / "merged.pt", damaged)
    with pytest.raises(CheckpointDamagedError, match=message):
        CheckpointManager(tmp_path, cleanup=False).load(damaged)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 3))
    with pytest.raises(CheckpointDamagedError, match=message):
        load_checkpoint(damaged, model)


def test_a_save_checkpoint_file_is_refused_as_a_trainer_checkpoint_saying_what_reads_it(tmp_path):
    model = torch.nn.Linear(3, 2)
    save_checkpoint(tmp_path / "ck.pt", 4, model)
    with pytest.raises(CheckpointError, match=re.escape(
            f"{tmp_path / 'ck.pt'} is a single file but not a merged checkpoint (written by save_checkpoint or "
            f"torch.save): load it with colossal_lite.utils.load_checkpoint, or LoadCheckpointHook")):
        CheckpointManager(tmp_path, cleanup=False).load(tmp_path / "ck.pt")  # what fit(resume_from=...) reads with


def test_a_save_checkpoint_file_is_checked_against_its_record_crcs(tmp_path):
    model = torch.nn.Linear(32, 4)
    save_checkpoint(tmp_path / "ck.pt", 3, model)
    assert load_checkpoint(tmp_path / "ck.pt", torch.nn.Linear(32, 4)) == 3
    message = _flip_a_tensor_bit(tmp_path / "ck.pt", tmp_path / "damaged.pt")
    with pytest.raises(CheckpointDamagedError, match=message):  # torch.load alone reads it without a word
        load_checkpoint(tmp_path / "damaged.pt", torch.nn.Linear(32, 4))
    # a file without CRCs (torch's pre-zip format) has nothing to compare: it loads as before
    torch.save(torch.load(tmp_path / "ck.pt", weights_only=True), tmp_path / "old.pt",
               _use_new_zipfile_serialization=False)
    assert load_checkpoint(tmp_path / "old.pt", torch.nn.Linear(32, 4)) == 3
