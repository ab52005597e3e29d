"""``benchmarks/gpu_check.py --dry-run``: the GPU check's whole path on the CPU, so it never rots without a GPU.

Every section must be in the JSON with a status; those that can run on the CPU must pass, and those that need CUDA
must say so (skipped with a reason). The speed figures of a CPU dry run mean nothing and are not checked.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NEEDS_CUDA = {"nccl_one_rank"}  # skipped on the CPU
NEEDS_PACKAGE = {"speed_gpt2", "speed_gpt2_compile"}  # skipped where transformers is not installed


def test_dry_run_runs_every_section_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import gpu_check

    expected = [name for name, _, _ in gpu_check.sections()]
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--out", str(tmp_path), "--rounds", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""})
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = doc["sections"]
    assert doc["dry_run"] is True and doc["device"] == "cpu"
    assert list(sections) == expected, proc.stdout[-3000:]
    for name, record in sections.items():
        assert record["status"] in ("passed", "skipped"), f"{name}: {record}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        assert "seconds" in record and record.get("summary")
        if record["status"] == "skipped":
            assert name in NEEDS_CUDA | NEEDS_PACKAGE, f"{name} was skipped on the CPU: {record['summary']}"
            assert record.get("reason")
    assert proc.returncode == 0
    assert sections["nccl_one_rank"]["status"] == "skipped"
    assert sections["equivalence"]["cases"] and all(c["bitwise"] for c in sections["equivalence"]["cases"].values())
    assert sections["speed_resnet18"]["contestants"].keys() >= {"hand", "engine", "trainer"}
    assert sections["speed_resnet18"]["rounds"] == 1  # --rounds (the dry run's own is 2)
    # the host's share of each block's time (on the CPU the host does all the work: all of it)
    assert all(0 < row["host_share"] <= 1 for row in sections["speed_resnet18"]["contestants"].values())
    assert proc.stdout.rstrip().splitlines()[-1].startswith("total "), "the table is printed last"


def test_a_missing_dependency_is_said_once_with_the_package_to_install(tmp_path, monkeypatch):
    """A library that cannot be imported (one of its dependencies missing) stops the command before any section,
    naming what to install (on the first GPU lent, zlib-ng was missing and every section failed alone)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import gpu_check

    (tmp_path / "needs_a_missing_dep").mkdir()
    (tmp_path / "needs_a_missing_dep" / "__init__.py").write_text("import zlib_ng_nowhere.zlib_ng\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    message = gpu_check.import_problem("needs_a_missing_dep")
    assert "pip install zlib-ng-nowhere" in message and "needs_a_missing_dep cannot be imported" in message
    assert gpu_check.import_problem() is None  # the library itself imports here


def test_the_one_rank_section_record_takes_the_workers_result(monkeypatch):
    """``nccl_one_rank`` (CUDA only, so never run by the dry run) made its record with ``ok`` twice (a TypeError
    on the first GPU lent)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import gpu_check

    rank = {"rank": 0, "all_reduce_ok": True, "cases": {}}
    record = gpu_check.one_rank_verdict(dict(ok=True, backend="nccl", nproc=1, bitwise_cases="12/12", ranks=[rank]))
    assert record["status"] == "passed" and record["summary"] == "all-reduce ok; FSDP2 cases bitwise 12/12"
    assert record["ranks"] == [rank] and "ok" not in record
    failed = gpu_check.one_rank_verdict(dict(ok=False, bitwise_cases="0/0", ranks=[None]))
    assert failed["status"] == "failed" and failed["summary"].startswith("all-reduce FAILED")
