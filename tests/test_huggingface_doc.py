"""docs/huggingface.md: its python blocks, run in order as one script (later blocks use earlier ones' names), do
what the page says."""
import re

from dist_helpers import doc_python_blocks, run_python
from optional_packages import require_transformers

require_transformers("docs/huggingface.md trains transformers models", module_level=True)


def test_the_pages_snippets_run_as_one_script(tmp_path):
    blocks = doc_python_blocks("docs/huggingface.md")
    assert len(blocks) == 7, [b.splitlines()[0] for b in blocks]
    script = tmp_path / "huggingface_doc.py"
    script.write_text("\n".join(blocks) + '\nprint("doc snippets done")\n')
    proc = run_python(script, timeout=300, cwd=tmp_path)
    assert proc.stdout.rstrip().endswith("doc snippets done"), proc.stdout
    numbers = [line for line in proc.stdout.splitlines() if re.fullmatch(r"[0-9.]+", line)]
    assert len(numbers) == 1 and 0.0 <= float(numbers[0]) <= 1.0, proc.stdout  # the first block's test accuracy
