"""docs/trainer.md snippets of issue 23 run as written in a fresh process (stdout a pipe, as in a batch job)."""
import re

from dist_helpers import doc_python_blocks, run_python


def test_the_runs_eta_snippet_prints_it_until_the_last_epoch(tmp_path):
    script = tmp_path / "run_eta.py"
    script.write_text(doc_python_blocks("docs/trainer.md", "The run's ETA")[0])
    out = run_python(script, timeout=180, cwd=tmp_path).stdout
    for epoch in range(3):
        run_eta = r" \(run \d+:\d\d:\d\d\)" if epoch < 2 else ""
        assert re.search(rf"^\[Epoch {epoch} / Train\] 8/8 batches \(100%\), [0-9.]+ batch/s, ETA 0:00:00{run_eta} "
                         r"\| loss=[0-9.]+$", out, re.M), out
