"""``colossal-lite check`` and ``colossal-lite info``; every file in configs/ passes ``check``."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from colossal_lite.cli import main

REPO = Path(__file__).resolve().parents[1]
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
