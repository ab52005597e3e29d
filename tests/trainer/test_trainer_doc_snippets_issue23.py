"""docs/trainer.md snippets of issue 23 run as written in a fresh process (stdout a pipe, as in a batch job)."""
import re

from dist_helpers import REPO, run_python

PAGE = REPO / "docs" / "trainer.md"


def section_block(title: str) -> str:
    section = PAGE.read_text().split(f"### {title}\n", 1)[1].split("\n#", 1)[0]
    return re.search(r"^```python\n(.*?)^```$", section, flags=re.MULTILINE | re.DOTALL).group(1)


def test_the_runs_eta_snippet_prints_it_until_the_last_epoch(tmp_path):
    script = tmp_path / "run_eta.py"
    script.write_text(section_block("The run's ETA"))
    out = run_python(script, timeout=180, cwd=tmp_path).stdout
    for epoch in range(3):
        run_eta = r" \(run \d+:\d\d:\d\d\)" if epoch < 2 else ""
        assert re.search(rf"^\[Epoch {epoch} / Train\] 8/8 batches \(100%\), [0-9.]+ batch/s, ETA 0:00:00{run_eta} "
                         r"\| loss=[0-9.]+$", out, re.M), out
