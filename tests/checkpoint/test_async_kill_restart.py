"""A run with asynchronous saves killed with SIGKILL 10 times, at random moments and inside the background write,
then resumed with resume_from='auto' each time, ends bit for bit like a run never killed.

It reuses the driver of ``test_kill_restart.py`` (one process that imports torch once and forks each
training process), with ``SaveCheckpointHook(..., async_save=True)``: a checkpoint is started at every
optimizer step while training goes on. The "write" rounds stop the background thread between its
files (it prints a marker and waits there) and kill the process then; the others kill it a random
number of steps after it started, at a random instant. After each kill no folder is half-written: an
unfinished one only exists under its temporary name, and the next start removes it.
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_helpers import REPO, _env


def _driver() -> str:
    """``test_kill_restart.py``'s driver script (its module, loaded by path: the test folders are no packages)."""
    path = Path(__file__).with_name("test_kill_restart.py")
    spec = importlib.util.spec_from_file_location("kill_restart_driver", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.DRIVER


DRIVER = _driver()

SEED = 20261127
ROUNDS = ["steps", "write", "steps", "write", "steps", "steps", "write", "steps", "write", "steps"]
ASYNC_DRIVER = DRIVER.replace('SaveCheckpointHook("1ba", folder)', 'SaveCheckpointHook("1ba", folder, async_save=True)')


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork and SIGKILL")
def test_ten_sigkills_of_a_run_with_async_saves_then_resume_auto_end_like_an_unkilled_run(tmp_path):
    assert ASYNC_DRIVER != DRIVER
    script, ck = tmp_path / "driver.py", tmp_path / "ck"
    script.write_text(ASYNC_DRIVER)
    proc = subprocess.run([sys.executable, str(script), str(ck), str(tmp_path), str(SEED), ",".join(ROUNDS)],
                          capture_output=True, text=True, timeout=240, env=_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rounds = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["kind"] for r in rounds] == ROUNDS
    assert all(r["killed"] for r in rounds), rounds  # every round was really killed, none ran to its end
    for r in rounds:
        if r["kind"] == "write":  # killed inside the background write: only the temporary folder is there
            assert r["last"].startswith("writing") and any(n.startswith(".tmp-") for n in r["leftovers"]), r
        assert all(n.startswith((".tmp-", ".del-")) for n in r["leftovers"]), r
    for name in os.listdir(ck):  # every folder that has a checkpoint's name is complete
        if name.startswith("epoch"):
            assert (ck / name / "meta.json").is_file(), name
    assert not [n for n in os.listdir(ck) if n.startswith(".")]  # the next start cleaned them
    steps = sorted(int(n.split("step")[1].split("-")[0]) for n in os.listdir(ck) if n.startswith("epoch"))
    assert steps[-1] == 48 and (ck / "last").read_text().strip() == "epoch2-step48"
    final = json.loads((tmp_path / "ck.json").read_text())
    reference = json.loads((tmp_path / "ck-never-killed.json").read_text())
    assert final.keys() == reference.keys()
    for name in reference:
        assert torch.equal(torch.tensor(final[name]), torch.tensor(reference[name])), name
