"""docs/checkpoints.md, "Saving at chosen steps": the snippet runs as written in a fresh process and prints the
folder list the page shows (the listed steps and the final checkpoint, nothing else)."""

from dist_helpers import REPO, doc_python_blocks, run_python

PAGE = REPO / "docs" / "checkpoints.md"


def test_saving_at_chosen_steps_snippet_prints_what_the_page_says(tmp_path):
    script = tmp_path / "chosen_steps.py"
    script.write_text(doc_python_blocks("docs/checkpoints.md", "Saving at chosen steps")[0])
    proc = run_python(script, timeout=180, cwd=tmp_path)
    printed = [line for line in proc.stdout.splitlines() if line.startswith("saved:")]
    assert printed == ["saved: ['epoch0-step3', 'epoch1-step8', 'epoch2-step13', 'epoch2-step15', 'epoch3-step20', "
                       "'last', 'metrics.jsonl']"], proc.stdout + proc.stderr
    assert f"It prints `{printed[0]}`" in PAGE.read_text()
