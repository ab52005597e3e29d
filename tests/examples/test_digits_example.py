"""The digits example trains to >= 95% test accuracy under torchrun with 2 processes."""
import re

import pytest
from dist_helpers import REPO, run_torchrun

SCRIPT = REPO / "examples" / "digits" / "train_engine.py"


def test_digits_example_reaches_95_percent_on_2_processes():
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn (the `examples` extra)")
    proc = run_torchrun(SCRIPT, ["--require-accuracy", "0.95"], nproc=2, timeout=180)
    found = re.findall(r"final test accuracy: ([0-9.]+)", proc.stdout)
    assert len(found) == 1, f"expected one final accuracy line (rank 0 only), got {found}\nstdout:\n{proc.stdout}"
    assert float(found[0]) >= 0.95, proc.stdout
    assert "trained on 2 process(es)" in proc.stdout
