"""docs/launch.md, "Seeds": on 2 gloo ranks (``run_ranks``) the snippet builds the same model on both ranks
and draws different numbers on each after the per-rank seed."""
import re

from dist_helpers import doc_python_blocks, run_ranks


def test_the_seed_snippet_gives_one_model_and_each_rank_its_own_noise(tmp_path):
    (snippet,) = doc_python_blocks("docs/launch.md", "Seeds: the same model, each rank's own randomness")
    script = tmp_path / "seeds.py"
    script.write_text(snippet)
    out = run_ranks(script, nproc=2, timeout=120, cwd=tmp_path).stdout
    lines = dict(re.findall(r"^rank (\d) (weight .*)$", out, flags=re.MULTILINE))
    assert set(lines) == {"0", "1"}, out
    weights = {line.split(" noise ")[0] for line in lines.values()}
    noises = {line.split(" noise ")[1] for line in lines.values()}
    assert len(weights) == 1 and len(noises) == 2, out
