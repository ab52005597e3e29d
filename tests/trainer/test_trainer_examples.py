"""The digits trainer examples run end to end (one process)."""
import re

import pytest
from dist_helpers import REPO, run_python

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
