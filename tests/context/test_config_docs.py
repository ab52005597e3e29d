"""docs/config.md's examples run as written."""
import re

from dist_helpers import REPO, run_python


def _python_blocks(section_title: str):
    text = (REPO / "docs" / "config.md").read_text()
    section = text[text.index(section_title):]
    end = section.find("\n## ")  # the next top-level heading ends the section
    section = section if end < 0 else section[:end]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_data_process_func_example_trains_on_dict_batches(tmp_path):
    blocks = _python_blocks("### `data_process_func`")
    assert blocks, "docs/config.md has no python example under data_process_func"
    script = tmp_path / "dict_batches.py"
    script.write_text(blocks[-1])
    proc = run_python(script, timeout=60)
    assert re.search(r"last loss \d+\.\d{3}", proc.stdout), proc.stdout
