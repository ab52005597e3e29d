"""docs/launch.md, "Lines from other ranks name their rank": the ranks.py snippet on 2 gloo ranks (``run_ranks``)
prints rank 0's lines as before and rank 1's with ``[rank 1]``."""
import re

from dist_helpers import REPO, run_ranks

PAGE = REPO / "docs" / "launch.md"


def test_the_ranks_snippet_tags_rank_1s_lines(tmp_path):
    block = re.search(r"^```python\n(# ranks\.py\n.*?)^```$", PAGE.read_text(), flags=re.MULTILINE | re.DOTALL)
    script = tmp_path / "ranks.py"
    script.write_text(block.group(1))
    lines = run_ranks(script, nproc=2, timeout=120, cwd=tmp_path).stdout.splitlines()
    expected = ["colossal_lite - INFO: shard ready", "colossal_lite [rank 1] - INFO: shard ready",
                "colossal_lite - ERROR: an error on rank 0", "colossal_lite [rank 1] - ERROR: an error on rank 1"]
    assert sorted(line for line in lines if line.startswith("colossal_lite")) == sorted(expected), lines
