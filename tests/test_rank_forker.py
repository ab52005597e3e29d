"""``run_ranks`` (tests/rank_forker.py) gives each rank what torchrun gives its workers and ends it as an
interpreter ends: the statuses, the tracebacks and the output a test reads are those of ``python script``."""
import json
import textwrap

from dist_helpers import run_ranks

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
