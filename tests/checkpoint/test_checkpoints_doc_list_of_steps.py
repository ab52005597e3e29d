"""docs/checkpoints.md, "Saving at chosen steps": the snippet runs as written in a fresh process and prints the
folder list the page shows (the listed steps and the final checkpoint, nothing else)."""
import re

from dist_helpers import REPO, run_python

PAGE = REPO / "docs" / "checkpoints.md"


def section_block(title: str) -> str:
    section = PAGE.read_text().split(f"### {title}\n", 1)[1].split("\n### ", 1)[0]
    return re.search(r"^```python\n(.*?)^```$", section, flags=re.MULTILINE | re.DOTALL).group(1)


def test_saving_at_chosen_steps_snippet_prints_what_the_page_says(tmp_path):
    script = tmp_path / "chosen_steps.py"
    script.write_text(section_block("Saving at chosen steps"))
    proc = run_python(script, timeout=180, cwd=tmp_path)
    printed = [line for line in proc.stdout.splitlines() if line.startswith("saved:")]
    assert printed == ["saved: ['epoch0-step3', 'epoch1-step8', 'epoch2-step13', 'epoch2-step15', 'epoch3-step20', "
                       "'last']"], proc.stdout + proc.stderr
    assert f"It prints `{printed[0]}`" in PAGE.read_text()
