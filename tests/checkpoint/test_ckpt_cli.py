"""``ckpt info`` and ``ckpt export``."""
import argparse
import re
import shutil

import pytest
import torch
from torch import nn

from colossal_lite.amp.amp_type import AMP_TYPE
from colossal_lite.checkpoint import CheckpointManager
from colossal_lite.checkpoint.cli import main, register, run
from colossal_lite.context.config import Config
from colossal_lite.utils.checkpointing import save_checkpoint


@pytest.fixture
def run_dir(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(64, 32)
    m = CheckpointManager(tmp_path / "ck", save_best=("loss", "min"))
    config = Config({"fp16": {"mode": AMP_TYPE.TORCH}, "BATCH_SIZE": 32, "NUM_EPOCHS": 10})
    m.save("epoch3-step120", {"engine": {"model": model.state_dict(), "num_updates": 120}, "trainer": {"epoch": 3}},
           {"rng": torch.zeros(4, dtype=torch.uint8)}, {"loss": 0.125, "accuracy": 0.75}, config=config)
    return tmp_path / "ck", model


def test_info_prints_epoch_step_metrics_config_and_sizes(run_dir, capsys):
    d, _ = run_dir
    assert main(["ckpt", "info", str(d)]) == 0
    out = capsys.readouterr().out
    folder = d / "epoch3-step120"
    assert f"checkpoint: {folder}  (last, best)" in out
    assert "epoch: 3   step: 120" in out
    assert "metrics: loss=0.125, accuracy=0.75" in out
    assert "fp16 = {'mode': 'torch'}" in out and "BATCH_SIZE = 32" in out
    assert f"colossal_lite {__import__('colossal_lite').__version__}" in out and "1 rank(s)" in out
    sizes = dict(re.findall(r"^    (\S+)\s+(\d+(?:\.\d)? (?:B|KiB))$", out, re.M))
    assert sizes["shared.pt"] == f"{(folder / 'shared.pt').stat().st_size / 1024:.1f} KiB"
    assert sizes["meta.json"] == f"{(folder / 'meta.json').stat().st_size} B"
    assert sizes["engine"] == "8.1 KiB"  # tensor data: (64*32 + 32) * 4 bytes of weights
    assert sizes["trainer"] == "0 B"


def test_info_of_one_file_of_a_folder_names_the_folder(run_dir, capsys):
    """A rank's file of a folder was shown as a single-file checkpoint, its parts (the random state, the batches
    read ahead) dumped as its "epoch" (found by the checkpoint probe): it names the folder to give instead."""
    d, _ = run_dir
    folder = d / "epoch3-step120"
    for name in ("rank0.pt", "shared.pt"):
        assert main(["ckpt", "info", str(folder / name)]) == 1
        assert (f"{folder / name} is one file of the checkpoint folder {folder}, which is read whole: give the "
                f"folder instead ('{folder}')") in capsys.readouterr().err


def test_export_writes_bare_weights_loadable_with_weights_only(run_dir, tmp_path, capsys):
    d, model = run_dir
    out_file = tmp_path / "weights.pt"
    assert main(["ckpt", "export", str(d / "best"), str(out_file)]) == 0
    assert f"wrote 2 tensors (8.1 KiB) of {d / 'epoch3-step120'} to {out_file}" in capsys.readouterr().out
    weights = torch.load(out_file, weights_only=True)
    fresh = nn.Linear(64, 32)
    fresh.load_state_dict(weights)
    assert torch.equal(fresh.weight, model.weight)


def test_export_from_a_single_file_checkpoint_strips_ddp_prefixes(tmp_path):
    model = nn.Linear(3, 2)
    torch.save({"epoch": 1, "model": {f"module.{k}": v for k, v in model.state_dict().items()}}, tmp_path / "a.pt")
    assert main(["ckpt", "export", str(tmp_path / "a.pt"), str(tmp_path / "w.pt")]) == 0
    assert sorted(torch.load(tmp_path / "w.pt", weights_only=True)) == ["bias", "weight"]
    save_checkpoint(tmp_path / "b.pt", 4, model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert main(["ckpt", "info", str(tmp_path / "b.pt")]) == 0


def test_errors_are_one_line_and_exit_1(tmp_path, capsys):
    assert main(["ckpt", "info", str(tmp_path / "nothing")]) == 1
    assert f"error: checkpoint {tmp_path / 'nothing'} does not exist" in capsys.readouterr().err
    m = CheckpointManager(tmp_path / "ck")
    m.save("epoch0-step1", {"trainer": {"step": 1}})
    assert main(["ckpt", "export", str(tmp_path / "ck"), str(tmp_path / "w.pt")]) == 1
    assert "no model weights found in this checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "w.pt").exists()


def test_export_and_merge_refuse_an_output_that_would_replace_a_checkpoint(run_dir, tmp_path, capsys):
    """OUT the input file, a pointer, or a file inside a checkpoint folder: exit 1 and nothing written (they
    replaced a save_checkpoint file with bare weights, and a pointer or a checksummed shared.pt with a merged file)."""
    d, model = run_dir
    single = tmp_path / "ck.pt"
    save_checkpoint(single, 3, model, torch.optim.SGD(model.parameters(), lr=0.1))
    folder = d / "epoch3-step120"
    refused = [(["export", str(single), str(single)], "is the checkpoint being read"),
               (["export", str(d), str(d / "last")], f"is a 'last' pointer of the run in {d}"),
               (["export", str(d / "best"), str(d / "best")], "is the checkpoint being read"),
               (["export", str(d), str(folder / "shared.pt")], f"is inside the checkpoint folder {folder}"),
               (["export", str(d), str(folder / "new" / "w.pt")], f"is inside the checkpoint folder {folder}"),
               (["merge", str(d), str(folder / "shared.pt")], f"is inside the checkpoint folder {folder}")]
    before = {p: p.read_bytes() for p in (single, d / "last", d / "best", folder / "shared.pt")}
    for argv, why in refused:
        assert main(["ckpt", *argv]) == 1, argv
        err = capsys.readouterr().err
        assert f"error: the output {argv[2]} {why}" in err and "nothing was written" in err, err
    assert {p: p.read_bytes() for p in before} == before
    assert not (folder / "new").exists()
    assert main(["ckpt", "info", str(d)]) == 0
    assert re.search(r"checksums: all \d+ files match", capsys.readouterr().out)


def test_export_and_merge_refuse_a_pipe_and_a_path_written_as_a_folder(run_dir, tmp_path, capsys):
    """The output is replaced by a rename: a named pipe became a regular file (and as root, a device node such as
    /dev/full did), and ``out/`` became a file named ``out`` (found by a probe of the command line)."""
    import os

    d, _ = run_dir
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    cases = [(["export", str(d), str(fifo)], "is not a regular file (a pipe, a device or a socket)"),
             (["merge", str(d), str(fifo)], "is not a regular file (a pipe, a device or a socket)"),
             (["export", str(d), str(tmp_path / "weights") + "/"], "ends in '/', but one file is written: give its "
                                                                     f"name (e.g. {tmp_path / 'weights'}/model.pt)")]
    for argv, why in cases:
        assert main(["ckpt", *argv]) == 1, argv
        err = capsys.readouterr().err
        assert f"error: the output {argv[2]} {why}" in err, err
    assert fifo.is_fifo() and not (tmp_path / "weights").exists()


def test_info_of_a_damaged_checkpoint_prints_it_and_exits_1(run_dir, capsys):
    d, _ = run_dir
    shared = d / "epoch3-step120" / "shared.pt"
    shared.write_bytes(shared.read_bytes()[:1000])
    assert main(["ckpt", "info", str(d)]) == 1  # a script can use it as a check
    out = capsys.readouterr().out
    assert "epoch: 3   step: 120" in out and "checksums: DAMAGED: shared.pt (1000 bytes," in out


def test_a_run_folder_without_a_last_pointer_stands_for_its_newest_checkpoint(run_dir, tmp_path, capsys):
    """A run saved with save_last=False (it said the folder was no complete checkpoint, while load_checkpoint and
    resume_from='auto' take its newest)."""
    d, model = run_dir
    CheckpointManager(d).save("epoch4-step150", {"engine": {"model": model.state_dict(), "num_updates": 150}})
    (d / "last").unlink()
    assert main(["ckpt", "info", str(d)]) == 0
    assert f"checkpoint: {d / 'epoch4-step150'}" in capsys.readouterr().out
    assert main(["ckpt", "export", str(d), str(tmp_path / "w.pt")]) == 0
    assert f"of {d / 'epoch4-step150'} to" in capsys.readouterr().out


def test_a_best_pointer_the_run_never_kept_says_why(tmp_path, capsys):
    m = CheckpointManager(tmp_path / "ck")
    m.save("epoch0-step1", {"engine": {"model": nn.Linear(2, 2).state_dict()}, "trainer": {"step": 1}})
    assert main(["ckpt", "export", str(tmp_path / "ck" / "best"), str(tmp_path / "w.pt")]) == 1
    assert capsys.readouterr().err == (
        f"error: checkpoint {tmp_path / 'ck' / 'best'} does not exist: the run in {tmp_path / 'ck'} kept no 'best' "
        f"pointer (it was saved without SaveCheckpointHook(..., save_best=...)); give {tmp_path / 'ck' / 'last'} or "
        f"one of its checkpoint folders\n")


@pytest.mark.parametrize("name,text", [("metrics.csv", "step,epoch,name,value,time\n1,0,train/Loss,1.0,1.5\n"),
                                       ("metrics.jsonl", '{"step": 1, "epoch": 0, "name": "x", "value": 1.0}\n'),
                                       ("notes.txt", "some notes\n")])
@pytest.mark.parametrize("command", ["info", "export"])
def test_a_file_that_is_not_a_checkpoint_is_named_so(tmp_path, capsys, name, text, command):
    """A run folder's other files given by mistake: a raw IndexError from torch's unpickler (csv), a refusal as
    if the file could run code (jsonl), a missing file (a short note, taken for a 'last' pointer; found by a probe,
    in export after info was mended)."""
    path = tmp_path / name
    path.write_text(text)
    assert main(["ckpt", command, str(path)] + ([str(tmp_path / "w.pt")] if command == "export" else [])) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path} is not a checkpoint file: it is not in torch's save format"), err
    assert "Give a checkpoint folder" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "w.pt").exists()


@pytest.mark.parametrize("command", ["info", "export"])
def test_a_pointer_to_a_removed_folder_names_both(run_dir, capsys, command):
    ck = run_dir[0]
    target = (ck / "last").read_text().strip()
    shutil.rmtree(ck / target)
    out = ck.parent / "w.pt"
    assert main(["ckpt", command, str(ck / "last")] + ([str(out)] if command == "export" else [])) == 1
    err = capsys.readouterr().err
    assert err == f"error: {ck / 'last'} points to {target}, which is not in {ck} (removed by hand?): give one of " \
                  f"the checkpoint folders there instead\n", err
    assert not out.exists()


def test_register_adds_the_command_to_another_parser(run_dir, capsys):
    parser = argparse.ArgumentParser(prog="colossal-lite")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info")
    register(sub)
    args = parser.parse_args(["ckpt", "info", str(run_dir[0] / "last")])
    assert args.command == "ckpt" and run(args) == 0
    assert "epoch: 3" in capsys.readouterr().out
