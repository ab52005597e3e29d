"""docs/trainer.md "Your own step": its snippets run as written in fresh processes and print what the page says."""
import re

from dist_helpers import doc_python_blocks, run_python


def test_the_your_own_step_snippets_run_as_the_page_says(tmp_path):
    gan, language_model = doc_python_blocks("docs/trainer.md", "Your own step")
    (tmp_path / "gan.py").write_text(gan)
    (tmp_path / "lm.py").write_text(language_model)
    for run in ("first", "again"):  # the second run resumes from the checkpoint that holds both engines
        result = run_python(tmp_path / "gan.py", timeout=180, cwd=tmp_path)
        assert result.stdout.strip().endswith("generator steps: 12, discriminator updates: 6"), (run, result.stdout)
    assert "nothing to do" in result.stdout + result.stderr
    out = run_python(tmp_path / "lm.py", timeout=180, cwd=tmp_path).stdout
    losses = [float(x) for x in re.search(r"^loss per epoch: ([0-9. ]+)$", out, re.M).group(1).split()]
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2], out
