"""The char_lm example (grad_reduction='per-token-mean' on padded lines) beats the unigram baseline."""
import re

from dist_helpers import REPO, run_python, run_ranks

SCRIPT = REPO / "examples" / "char_lm" / "train.py"


def one_value(name: str, stdout: str) -> float:
    found = re.findall(rf"^{name}: ([0-9.]+)$", stdout, flags=re.MULTILINE)
    assert len(found) == 1, f"expected one '{name}: X' line (rank 0 only), got {found}\nstdout:\n{stdout}"
    return float(found[0])


def test_char_lm_on_2_processes_ends_below_the_unigram_baseline():
    proc = run_ranks(SCRIPT, ["--epochs", "6"], nproc=2, timeout=120)
    baseline = one_value("unigram baseline", proc.stdout)
    final = one_value("final per-token loss", proc.stdout)
    assert proc.stdout.rstrip().splitlines()[-1] == f"final per-token loss: {final:.4f}", proc.stdout
    assert 2.5 < baseline < 3.5, f"the unigram entropy of English characters is about 3 nats, got {baseline}"
    assert final < baseline, proc.stdout
    assert "trained on 2 process(es)" in proc.stdout
    assert "greedy sample: 'The " in proc.stdout


def test_require_loss_below_fails_with_status_1_under_plain_python():
    proc = run_python(SCRIPT, ["--epochs", "1", "--require-loss-below", "0.01"], timeout=120, check=False)
    assert proc.returncode == 1, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "trained on 1 process(es)" in proc.stdout
    assert "is not below the required 0.01" in proc.stderr
