import ast
import re
from pathlib import Path

import pytest
import torch

import colossal_lite.utils.memory as memory
from colossal_lite.utils.memory import report_memory_usage


class _ListLogger:
    def __init__(self):
        self.messages = []

    def info(self, msg):
        self.messages.append(msg)


def _cpu_figures(msg):
    match = re.search(r"CPU: RSS ([0-9.]+) MB, VMS ([0-9.]+) MB, system used ([0-9.]+)%", msg)
    assert match is not None, msg
    return tuple(float(g) for g in match.groups())


def test_report_cpu_has_positive_rss():
    logger = _ListLogger()
    msg = report_memory_usage("after step", logger=logger, report_cpu=True)
    assert logger.messages == [msg]
    assert msg.startswith("after step: ")
    rss, vms, used = _cpu_figures(msg)
    assert rss > 0 and vms >= rss
    assert 0 < used <= 100


@pytest.mark.gpu
def test_gpu_part_only_with_cuda(capsys):
    msg = report_memory_usage("probe")
    assert capsys.readouterr().out.strip() == f"colossal_lite - INFO: {msg}"  # the library's logger, on rank 0
    if torch.cuda.is_available():
        assert re.search(r"GPU: allocated [0-9.]+ MB, max allocated [0-9.]+ MB, cached: [0-9.]+ MB, max cached: [0-9.]+ MB", msg)
    else:
        assert "GPU" not in msg
        _cpu_figures(msg)  # without CUDA the CPU figures are reported even when report_cpu=False


def test_psutil_not_imported_at_module_level():
    tree = ast.parse(Path(memory.__file__).read_text())
    top_level = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    names = {alias.name for node in top_level for alias in node.names}
    names |= {node.module for node in top_level if isinstance(node, ast.ImportFrom) and node.module}
    assert "psutil" not in names
