"""``colossal-lite check``, ``info`` and ``--version``; every file in configs/ passes ``check``; a reader that
stops early (``| head``) ends any command quietly."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import colossal_lite
from colossal_lite.cli import main

REPO = Path(__file__).resolve().parents[1]
BROKEN_PIPE_STATUS = 128 + signal.SIGPIPE  # what a shell reports for a tool stopped by a closed pipe: 141
CONFIGS = sorted((REPO / "configs").glob("*.py"))


def run_cli(*args, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "colossal_lite.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def test_check_good_config_in_a_subprocess(tmp_path):
    path = tmp_path / "good.py"
    path.write_text("from colossal_lite.amp import AMP_TYPE\nBATCH_SIZE = 8\nfp16 = dict(mode=AMP_TYPE.TORCH)\n"
                    "gradient_accumulation = 4\nclip_grad_norm = 1.0\ntorch_ddp = dict(find_unused_parameters=True)\n")
    proc = run_cli("check", path, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    out = proc.stdout
    assert f"{path}: OK" in out
    assert "precision: fp16 autocast with torch.amp.GradScaler" in out
    assert "gradient accumulation: 4 micro-batches per optimizer step" in out
    assert "gradient clipping: global L2 norm clipped to 1" in out
    assert "data parallel: torch DistributedDataParallel with find_unused_parameters=True" in out
    assert "your own values: BATCH_SIZE=8" in out


def test_check_bad_config_in_a_subprocess(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("BATCH_SIZE = 8\n\ngradient_clipping = 1.0\n")
    proc = run_cli("check", path, cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.startswith(f"error: {path}:3: config key 'gradient_clipping'")
    assert "rename it to 'clip_grad_norm'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_every_shipped_config_passes_check(capsys):
    names = {p.name for p in CONFIGS}
    assert {"fp32.py", "torch_amp.py", "bf16.py", "naive_amp.py", "accumulation_clipping.py", "ddp_options.py",
            "gradient_handler.py"} <= names
    for path in CONFIGS:
        first = path.read_text().splitlines()[0]
        assert first.startswith("#"), f"{path.name}: the first line should be a comment saying what it shows"
        assert main(["check", str(path)]) == 0, path
        captured = capsys.readouterr()
        assert captured.err == "", (path, captured.err)
        assert f"{path}: OK" in captured.out and "BATCH_SIZE=" in captured.out and "NUM_EPOCHS=" in captured.out


@pytest.mark.parametrize("name, expected", [
    ("fp32.py", "precision: fp32"),
    ("torch_amp.py", "precision: fp16 autocast with torch.amp.GradScaler"),
    ("bf16.py", "precision: bf16 autocast"),
    ("naive_amp.py", "precision: naive fp16"),
    ("accumulation_clipping.py", "gradient accumulation: 4 micro-batches"),
    ("accumulation_clipping.py", "gradient clipping: global L2 norm clipped to 1"),
    ("ddp_options.py", "torch DistributedDataParallel with find_unused_parameters=True"),
    ("gradient_handler.py", "DataParallelGradientHandler"),
])
def test_shipped_configs_show_their_feature(capsys, name, expected):
    assert main(["check", str(REPO / "configs" / name)]) == 0
    assert expected in capsys.readouterr().out


@pytest.mark.parametrize("body, words", [
    ("from colossal_lite.amp import AMP_TYPE\nfp16 = dict(mode=AMP_TYPE.APEX)\n", [":2: config key 'fp16.mode'", "apex"]),
    ("parallel = dict(tensor=dict(size=2))\n", [":1: config key 'parallel.tensor'", "not supported"]),
    ("fp_16 = dict(mode=None)\n", [":1: config key 'fp_16'", "rename it to 'fp16'"]),
    ("x = (\n", [":1: syntax error"]),
    ("A = undefined_name\n", [":1: error while executing config: NameError"]),
])
def test_check_bad_configs_exit_1_with_the_message_on_stderr(tmp_path, capsys, body, words):
    path = tmp_path / "cfg.py"
    path.write_text(body)
    assert main(["check", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"error: {path}")
    for w in words:
        assert w in captured.err


def test_check_of_a_file_that_is_not_text_and_a_world_size_below_1(tmp_path, capsys):
    """A config that is not UTF-8 gave a traceback; --world-size 0 or -1 was taken and printed OK (a probe)."""
    path = tmp_path / "binary.py"
    path.write_bytes(b"\xff\xfe\x00zero = 3\n")
    assert main(["check", str(path)]) == 1
    assert capsys.readouterr().err == (f"error: {path}:1: not a Python config: it is not UTF-8 text (byte 0 cannot be "
                                       f"decoded)\n")
    good = tmp_path / "good.py"
    good.write_text("clip_grad_norm = 1.0\n")
    for size in ("0", "-1"):
        with pytest.raises(SystemExit) as stop:
            main(["check", str(good), "--world-size", size])
        assert stop.value.code == 2 and f"a run has 1 process or more, got '{size}'" in capsys.readouterr().err


def test_check_missing_and_non_py_files(tmp_path, capsys):
    missing = tmp_path / "nope.py"
    assert main(["check", str(missing)]) == 1
    assert str(missing) in capsys.readouterr().err
    yaml = tmp_path / "c.yaml"
    yaml.write_text("a: 1\n")
    assert main(["check", str(yaml)]) == 1
    assert ".py" in capsys.readouterr().err


def test_check_warns_about_nested_feature_dicts_but_passes(tmp_path, capsys):
    path = tmp_path / "nested.py"
    path.write_text("CONFIG = dict(\n    clip_grad_norm=1.0,\n)\n")
    assert main(["check", str(path)]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith(f"warning: {path}:2: config key 'CONFIG.clip_grad_norm'")
    assert "move 'clip_grad_norm' to the top level" in captured.err
    assert "gradient clipping: off" in captured.out


def test_info_prints_versions(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"torch: {torch.__version__}" in out
    assert f"Python: {sys.version.split()[0]}" in out
    for words in ("CUDA available:", "NCCL available:", "CPU count:", "GPUs:", "tensorboard extra:"):
        assert words in out


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["check"])
    assert e.value.code == 2
    capsys.readouterr()


def cli_env(buffered: bool) -> dict:
    """This checkout first on the path; stdout block-buffered (the default into a pipe) or unbuffered."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("PYTHONUNBUFFERED", None)
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
    """A checkpoint whose ``ckpt info`` text is larger than a pipe holds (64 KiB), so the command is still
    writing when the reader goes away."""
    from colossal_lite.checkpoint import CheckpointManager

    folder = tmp_path_factory.mktemp("ckpt")
    config = {f"KEY_{i:05d}": "x" * 20 for i in range(4000)}
    CheckpointManager(folder).save("epoch1-step10", {"engine": {"model": torch.nn.Linear(4, 4).state_dict()}},
                                   {}, {"loss": 0.5}, config=config)
    return folder


def start(args, buffered: bool = True) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=cli_env(buffered), cwd=REPO)


def test_ckpt_info_into_a_reader_that_stops_after_one_line(big_checkpoint):
    """A reader that closes the pipe after one line: exit 141 as for any tool stopped by a closed pipe, nothing
    on stderr. Here stdout is unbuffered, and the command is ``python -m colossal_lite.checkpoint.cli info
    PATH``, as docs/checkpoints.md shows it (the shell test below has the buffered ``colossal-lite ckpt``)."""
    proc = start(["colossal_lite.checkpoint.cli", "info", str(big_checkpoint)], buffered=False)
    first = proc.stdout.readline().decode()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == BROKEN_PIPE_STATUS, err
    assert first.startswith(f"checkpoint: {big_checkpoint / 'epoch1-step10'}"), first
    assert err == ""


def test_every_command_into_a_closed_pipe_exits_quietly():
    """The reader is gone before the command writes anything (the pipe is closed at once): a command's own
    output, and argparse's (``--version`` ends in SystemExit). The processes run side by side: each spends
    seconds importing torch."""
    procs = [start(["colossal_lite.cli", *args]) for args in (["info"], ["--version"])]
    for proc in procs:
        proc.stdout.close()
    for proc in procs:
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == BROKEN_PIPE_STATUS, (proc.args, err)
        assert err == "", proc.args


def test_ckpt_info_piped_to_head_in_a_shell(big_checkpoint):
    """``colossal-lite ckpt info DIR | head -1`` (stdout block-buffered, as by default into a pipe)."""
    script = f'{sys.executable} -m colossal_lite.cli ckpt info "{big_checkpoint}" | head -1; echo "status ${{PIPESTATUS[0]}}"'
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120, env=cli_env(True))
    assert proc.stdout.splitlines()[0].startswith("checkpoint: "), proc.stdout
    assert proc.stdout.splitlines()[1:] == [f"status {BROKEN_PIPE_STATUS}"], proc.stdout
    assert proc.stderr == ""


def test_version_prints_the_package_torch_and_python_versions(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"colossal_lite {colossal_lite.__version__} (torch {torch.__version__}, " \
                                      f"Python {sys.version.split()[0]})\n"


def test_readme_install_takes_the_cpu_torch_before_the_package():
    """On a CPU-only machine ``pip install -e ".[dev]"`` alone pulls torch's CUDA build: the README's install
    section installs torch and torchvision from the CPU index first, then the package."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Install, run the example, run the tests", 1)[1].split("\n## ", 1)[0]
    commands = [line.split("#")[0].strip() for line in section.splitlines() if line.startswith("pip install")]
    cpu = "pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu"
    assert cpu in commands, commands
    assert 'pip install -e ".[dev]"' in commands[commands.index(cpu) + 1:], commands
