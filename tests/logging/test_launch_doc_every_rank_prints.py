"""docs/launch.md, "Printing on every rank": the every_rank.py snippet on 2 gloo ranks (``run_ranks``); each of
its prints is one write of a whole line, and every line of both ranks comes out whole."""
import ast

from dist_helpers import doc_python_blocks, run_ranks
from one_write import two_write_prints


def test_the_every_rank_snippet_prints_whole_lines_in_one_write_each(tmp_path):
    (snippet,) = doc_python_blocks("docs/launch.md", "Printing on every rank")
    assert snippet.startswith("# every_rank.py\n")
    assert two_write_prints(ast.parse(snippet)) == []
    script = tmp_path / "every_rank.py"
    script.write_text(snippet)
    out = run_ranks(script, nproc=2, timeout=120, cwd=tmp_path).stdout
    expected = [f"rank {rank} step {step}" for rank in (0, 1) for step in range(100)]
    assert sorted(out.splitlines()) == sorted(expected), out
