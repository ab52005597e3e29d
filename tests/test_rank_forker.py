"""``run_ranks`` (tests/rank_forker.py) gives each rank what torchrun gives its workers and ends it as an
interpreter ends: the statuses, the tracebacks and the output a test reads are those of ``python script``."""
import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import dist_helpers
import pytest
from dist_helpers import run_python, run_ranks

SCRIPT = textwrap.dedent("""
    import atexit, json, os, sys
    import torch
    import torch.distributed as dist
    import colossal_lite

    colossal_lite.launch_from_torch(config={}, verbose=False)
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    seen = dict(env={n: os.environ.get(n) for n in names}, argv=sys.argv[1:], name=__name__, file=__file__,
                path0=sys.path[0], total=total.item(), main_is_this=sys.modules["__main__"].__dict__ is globals())
    print(json.dumps(seen) + "\\n", end="", flush=True)
    atexit.register(lambda: print(f"exit handler of rank {os.environ['RANK']}\\n", end="", flush=True))
    if sys.argv[1] == "fail" and dist.get_rank() == 1:
        raise ValueError("rank 1 gives up")
    if sys.argv[1] == "fail":
        dist.barrier()  # rank 0 waits for a rank that failed: it is stopped, as torchrun stops it
    sys.exit(int(sys.argv[2]))
""")


def test_ranks_get_torchruns_environment_and_end_as_interpreters_do(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    ok = run_ranks(script, ["ok", 0], nproc=2, timeout=120)
    seen = sorted((json.loads(line) for line in ok.stdout.splitlines() if line.startswith("{")),
                  key=lambda s: s["env"]["RANK"])
    port = seen[0]["env"]["MASTER_PORT"]
    for rank, s in enumerate(seen):
        assert s["env"] == dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                                MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        assert (s["argv"], s["name"], s["file"], s["path0"]) == (["ok", "0"], "__main__", str(script), str(tmp_path))
        assert s["total"] == 3.0 and s["main_is_this"]
    assert ok.stdout.count("exit handler of rank") == 2 and ok.stderr == ""

    status = run_ranks(script, ["ok", 3], nproc=2, timeout=120, check=False)
    assert status.returncode == 1  # as torchrun: 1 when a rank failed, whatever its status
    assert "rank_forker: rank 0 of" in status.stderr and "exited with status 3" in status.stderr, status.stderr

    failed = run_ranks(script, ["fail", 0], nproc=2, timeout=120, check=False)
    assert failed.returncode == 1
    assert "ValueError: rank 1 gives up" in failed.stderr and f'File "{script}", line' in failed.stderr
    assert "exec(code" not in failed.stderr  # the traceback holds the script's frames, not the launcher's
    assert "rank_forker: rank 1 of" in failed.stderr and "exited with status 1" in failed.stderr, failed.stderr
    assert failed.stdout.count("exit handler of rank 1") == 1  # exit handlers run after an uncaught exception


# Each launch prints what it is and who started it: the launch's parent is this pytest process's rank server when
# the server forked it, and this pytest process when a fresh interpreter ran it.
WHO = textwrap.dedent("""
    import json, os, sys, time
    import torch

    def parent_of(pid):
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    launcher = os.getppid() if "RANK" in os.environ else os.getpid()
    seen = dict(rank=os.environ.get("RANK"), started_by=parent_of(launcher), argv=sys.argv[1:], path0=sys.path[0],
                name=__name__, threads=torch.get_num_threads(), cwd=os.getcwd())
    print(json.dumps(seen) + "\\n", end="", flush=True)
    if sys.argv[1] == "sleep":
        time.sleep(600)
    if sys.argv[1] == "fail":
        raise KeyError("the script's own error")
""")


def _seen(proc):
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_launches_are_forks_of_one_server_unless_a_start_up_variable_differs(tmp_path):
    script = tmp_path / "who.py"
    script.write_text(WHO)
    server = dist_helpers._rank_server()
    with ThreadPoolExecutor(2) as pool:  # asked for at once from two threads: the server runs one, then the other
        first, second = pool.map(lambda tag: run_ranks(script, ["ok", tag], nproc=2, timeout=120, cwd=tmp_path),
                                 ["first", "second"])
    assert [s["started_by"] for s in _seen(first) + _seen(second)] == [server.proc.pid] * 4
    assert [s["argv"] for s in _seen(first) + _seen(second)] == [["ok", "first"]] * 2 + [["ok", "second"]] * 2
    assert all((s["cwd"], s["path0"], s["threads"]) == (str(tmp_path), str(tmp_path), 1) for s in _seen(first))

    fresh = run_ranks(script, ["ok"], nproc=2, timeout=120, env={"OMP_NUM_THREADS": "2"})
    assert [(s["started_by"], s["threads"]) for s in _seen(fresh)] == [(os.getpid(), 2)] * 2
    assert dist_helpers._rank_server() is server and server.alive()


def test_importing_scikit_learn_does_not_stop_the_forks(tmp_path):
    """scikit-learn sets OpenMP variables at import, which a fork of the server would not have had: the helpers set
    them first, so every launch after a test that loaded the digits data is still a fork (each such launch started
    torch again before)."""
    without = {k: v for k, v in os.environ.items() if k not in dist_helpers.SKLEARN_SETS}
    probe = "import json, os; before = dict(os.environ); import sklearn; print(json.dumps(dict(os.environ.items() - before.items())))"
    added = json.loads(subprocess.run([sys.executable, "-c", probe], env=without, capture_output=True, text=True,
                                      timeout=120, check=True).stdout)
    assert {k: v for k, v in added.items() if dist_helpers.STARTUP_VARS.match(k)} == dist_helpers.SKLEARN_SETS

    script = tmp_path / "who.py"
    script.write_text(WHO)
    server = dist_helpers._rank_server()
    import sklearn  # noqa: F401
    assert [s["started_by"] for s in _seen(run_ranks(script, ["ok"], nproc=2, timeout=120))] == [server.proc.pid] * 2


def test_the_inductor_cache_folder_torch_sets_at_its_first_compile_does_not_stop_the_forks(tmp_path, monkeypatch):
    # torch.compile in a test writes TORCHINDUCTOR_CACHE_DIR into pytest's environment; torch reads it only when it
    # compiles, so the launches after it are still forks, and each sees the folder its environment gives
    script = tmp_path / "cache_dir.py"
    script.write_text(WHO + 'print(json.dumps(dict(cache=os.environ.get("TORCHINDUCTOR_CACHE_DIR"))) + "\\n", end="")\n')
    server = dist_helpers._rank_server()  # started before the variable is set, as after an earlier test's compile
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    assert server.env.get("TORCHINDUCTOR_CACHE_DIR") != str(tmp_path / "inductor")
    seen = _seen(run_ranks(script, ["ok"], nproc=2, timeout=120))
    assert [s["started_by"] for s in seen if "started_by" in s] == [server.proc.pid] * 2
    assert [s["cache"] for s in seen if "cache" in s] == [str(tmp_path / "inductor")] * 2


def test_run_python_is_one_plain_process_that_ends_as_an_interpreter_does(tmp_path):
    script = tmp_path / "who.py"
    script.write_text(WHO)
    cpu_before = dist_helpers.CHILD_CPU_S[0]
    ok = run_python(script, ["ok", "--flag"], timeout=120)
    [seen] = _seen(ok)
    assert seen == dict(rank=None, started_by=dist_helpers._rank_server().proc.pid, argv=["ok", "--flag"],
                        path0=str(tmp_path), name="__main__", threads=1, cwd=str(dist_helpers.REPO))
    assert dist_helpers.CHILD_CPU_S[0] > cpu_before  # the server's children count in the tests' CPU log

    failed = run_python(script, ["fail"], timeout=120, check=False)
    assert failed.returncode == 1 and "KeyError: \"the script's own error\"" in failed.stderr
    assert failed.stderr.startswith("Traceback") and "rank_forker" not in failed.stderr  # the script's frames only


def test_a_launch_that_hangs_prints_its_stacks_is_killed_and_the_server_runs_the_next(tmp_path):
    script = tmp_path / "who.py"
    script.write_text(WHO)
    server = dist_helpers._rank_server()
    with pytest.raises(AssertionError, match="timed out after 5 s") as hung:
        run_ranks(script, ["sleep"], nproc=2, timeout=5)
    for rank in (0, 1):
        assert f"the Python stacks of rank {rank}" in str(hung.value)
    assert f'File "{script}", line' in str(hung.value)  # where each rank was: in the script's sleep
    then = run_ranks(script, ["ok"], nproc=2, timeout=120)
    assert [s["started_by"] for s in _seen(then)] == [server.proc.pid] * 2
