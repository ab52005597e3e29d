"""Start real processes for distributed tests: torchrun with gloo on 127.0.0.1, a free port, a timeout; and read
the python blocks of a docs page that such tests run."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch.distributed as dist

from colossal_lite.core import global_context as gpc

REPO = Path(__file__).resolve().parents[1]
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def clean_launch_context(monkeypatch):
    """For a fixture (``yield from``): no torchrun variables and no launch before and after the test; its process
    group destroyed."""
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    gpc.destroy()
    yield
    gpc.destroy()
    assert not dist.is_initialized()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    for k in TORCHRUN_VARS:
        env.pop(k, None)
    if extra:
        env.update(extra)
    return env


def _run(cmd, timeout: float, env, cwd) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise AssertionError(f"timed out after {timeout} s: {' '.join(map(str, cmd))}\nstdout:\n{out}\nstderr:\n{err}") from None
    return proc


def run_torchrun(script, args: Sequence[str] = (), nproc: int = 2, timeout: float = 120, env=None, cwd=None,
                 check: bool = True) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --nproc_per_node nproc script args``; asserts exit 0 when ``check``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(script), *map(str, args)]
    proc = _run(cmd, timeout, _env(env), cwd or REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {' '.join(cmd)}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def run_python(script, args: Sequence[str] = (), timeout: float = 120, env=None, cwd=None,
               check: bool = True) -> subprocess.CompletedProcess:
    """``python script args`` in a fresh process (no torchrun variables)."""
    cmd = [sys.executable, str(script), *map(str, args)]
    proc = _run(cmd, timeout, _env(env), cwd or REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {' '.join(cmd)}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def doc_python_blocks(page, section: Optional[str] = None) -> List[str]:
    """The ```python blocks of a docs page (a path under the repository), or of its section whose heading is
    ``section`` (up to the next heading of the same or a higher level; '#' lines inside code blocks are code)."""
    blocks, block, fence, inside, level = [], None, False, section is None, 0
    for line in (REPO / page).read_text(encoding="utf-8").splitlines(keepends=True):
        if line.startswith("```"):
            fence = not fence
            if inside and fence and line.strip() == "```python":
                block = []
            elif inside and not fence and block is not None:
                blocks.append("".join(block))
                block = None
            continue
        if fence:
            if block is not None:
                block.append(line)
            continue
        heading = re.match(r"(#+) (.*)", line)
        if heading and section is not None:
            if heading.group(2).strip() == section:
                inside, level = True, len(heading.group(1))
            elif inside and len(heading.group(1)) <= level:
                break
    return blocks
