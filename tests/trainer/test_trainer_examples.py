"""The digits trainer examples run end to end (one process)."""
import re
from collections import Counter

import pytest
from dist_helpers import REPO, run_python, run_ranks

from colossal_lite.utils.metrics_file import read_metrics

DIGITS = REPO / "examples" / "digits"


def test_trainer_example_test_mode_verdict():
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn (the `examples` extra)")
    proc = run_python(DIGITS / "train_trainer.py", ["--test-mode"], timeout=180)
    assert re.search(r"test mode: 1 train batch and 1 eval batch ran \(train loss [0-9.]+, eval loss [0-9.]+; "
                     r"optimizer step applied, checkpoint round trip OK \([^)]*\)\), loss finite: OK", proc.stdout), proc.stdout + proc.stderr


def test_mixup_custom_hook_example_trains_and_reports_grad_norms():
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn (the `examples` extra)")
    proc = run_python(DIGITS / "train_mixup_custom_hook.py", ["--epochs", "5"], timeout=180)
    assert re.search(r"step 200: gradient norm mean [0-9.]+, max [0-9.]+ \(last 200 steps, before clipping\)",
                     proc.stdout), proc.stdout + proc.stderr
    accuracy = float(re.search(r"final test accuracy with MixUp\(alpha=0.2\): ([0-9.]+)", proc.stdout).group(1))
    assert accuracy >= 0.9, proc.stdout


def test_trainer_example_on_two_processes_keeps_its_metrics_for_plotting(tmp_path):
    """The example's final accuracy is the history's last test value, and --log-dir keeps every step once."""
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn (the `examples` extra)")
    run = tmp_path / "runs" / "digits"
    proc = run_ranks(DIGITS / "train_trainer.py", ["--log-dir", run, "--require-accuracy", "0.95"], nproc=2,
                        timeout=240)
    printed = re.findall(r"final test accuracy: ([0-9.]+)", proc.stdout)
    assert len(printed) == 1, proc.stdout  # rank 0 only
    assert f"metrics written to {run / 'metrics.jsonl'} (draw them: colossal-lite plot {run} -o curves.png)" \
        in proc.stdout
    records = read_metrics(run)
    tests = [r["value"] for r in records if r["name"] == "test/Accuracy"]
    assert len(tests) == 4 and f"{tests[-1]:.4f}" == printed[0]  # evaluated every 5 of 20 epochs
    steps = [r["step"] for r in records if r["name"] == "train/Loss_step"]
    # 1437 samples, 32 per process on 2 processes: 23 optimizer steps an epoch
    assert steps == list(range(1, 20 * 23 + 1))
    assert max(Counter((r["step"], r["name"]) for r in records).values()) == 1
