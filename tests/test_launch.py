"""launch*, gpc and the process group: one process, two processes under torchrun, hosts, timeouts."""
import json
import random
import socket
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_helpers import clean_launch_context, free_port, run_python, run_torchrun

import colossal_lite
from colossal_lite.context import Config, ConfigException, ParallelMode
from colossal_lite.core import global_context as gpc
from colossal_lite.launch import launch, launch_from_openmpi, launch_from_slurm, launch_from_torch


@pytest.fixture(autouse=True)
def clean_context(monkeypatch):
    yield from clean_launch_context(monkeypatch)


def write_config(folder: Path, name: str = "launch_config.py") -> Path:
    path = folder / name
    path.write_text("BATCH_SIZE = 8\ngradient_accumulation = 2\n")
    return path


# -- gpc before launch ------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpc_answers_before_launch():
    assert gpc.config is None
    assert not gpc.is_initialized() and not gpc.is_initialized(ParallelMode.DATA)
    assert gpc.get_global_rank() == 0
    assert gpc.get_local_rank() == 0
    for mode in (None, ParallelMode.GLOBAL, ParallelMode.DATA, ParallelMode.TENSOR):
        assert gpc.get_world_size(mode) == 1
        assert gpc.get_local_rank(mode) == 0
    assert gpc.get_group() is None and gpc.get_group(ParallelMode.DATA) is None
    assert gpc.world_size == gpc.data_parallel_size == 1
    assert gpc.tensor_parallel_size == gpc.pipeline_parallel_size == 1
    assert gpc.get_ranks_in_group(ParallelMode.DATA) == [0]
    assert gpc.is_first_rank(ParallelMode.DATA) and gpc.is_last_rank(ParallelMode.DATA)
    assert gpc.device == (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                          else torch.device("cpu"))
    gpc.destroy()  # harmless before launch
    with pytest.raises(TypeError, match="ParallelMode"):
        gpc.get_world_size("data")


def test_gpc_is_the_legacy_import_path():
    from colossal_lite.core import global_context

    assert global_context is gpc
    assert colossal_lite.launch is launch and colossal_lite.launch_from_torch is launch_from_torch


# -- launch in this process ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["str", "Path", "dict", "Config"])
def test_launch_accepts_str_path_dict_and_config(tmp_path, kind):
    path = write_config(tmp_path)
    config = {"str": str(path), "Path": path, "dict": dict(BATCH_SIZE=8, gradient_accumulation=2),
              "Config": Config(dict(BATCH_SIZE=8, gradient_accumulation=2))}[kind]
    returned = launch(config, rank=0, world_size=1, host=None, port=None, verbose=False)
    assert returned is gpc
    assert isinstance(gpc.config, Config)
    assert gpc.config.BATCH_SIZE == 8 and gpc.config.gradient_accumulation == 2
    assert gpc.is_initialized() and dist.is_initialized()
    assert gpc.get_world_size() == 1 and gpc.get_global_rank() == 0
    assert gpc.get_group(ParallelMode.DATA) is dist.group.WORLD
    gpc.destroy()
    assert gpc.config is None and not dist.is_initialized()


def test_launch_rejects_other_config_types():
    with pytest.raises(TypeError, match="path to a .py file, a dict or a Config"):
        launch(["fp16"], rank=0, world_size=1, host=None, port=None, verbose=False)
    assert not dist.is_initialized()


def test_bad_config_fails_before_any_process_group_starts(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("BATCH_SIZE = 8\nclip_grad = 1.0\n")
    start = time.monotonic()
    # world_size=2 with no peer would wait for the timeout if the group started first
    with pytest.raises(ConfigException, match=r"bad.py:2: config key 'clip_grad'.*rename it to 'clip_grad_norm'"):
        launch(path, rank=0, world_size=2, host="127.0.0.1", port=free_port(), timeout=30, verbose=False)
    assert time.monotonic() - start < 5
    assert not dist.is_initialized() and gpc.config is None


def test_launch_checks_rank_and_world_size():
    with pytest.raises(ValueError, match="rank must be in"):
        launch({}, rank=2, world_size=2, host="127.0.0.1", port=free_port(), verbose=False)
    with pytest.raises(ValueError, match="rank must be in"):
        launch({}, rank=0, world_size=0, host="127.0.0.1", port=free_port(), verbose=False)


def test_seed_seeds_python_numpy_and_torch():
    np = pytest.importorskip("numpy")
    launch({}, rank=0, world_size=1, host=None, port=None, seed=77, verbose=False)
    draws = (random.random(), float(np.random.rand()), torch.rand(3))
    random.seed(77)
    np.random.seed(77)
    torch.manual_seed(77)
    assert draws[0] == random.random() and draws[1] == float(np.random.rand())
    assert torch.equal(draws[2], torch.rand(3))
    assert gpc.seed == 77


def test_launch_logs_one_line_when_verbose(capsys):
    launch({}, rank=0, world_size=1, host=None, port=None, verbose=True)
    out = capsys.readouterr().out
    assert out.count("Distributed environment is initialized") == 1
    assert "world size 1" in out and "seed 1024" in out


def _has_ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("host", [
    "127.0.0.1",
    "localhost",
    pytest.param("::1", marks=pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback")),
])
def test_launch_over_tcp_with_ipv4_hostname_and_ipv6(host):
    launch({}, rank=0, world_size=1, host=host, port=free_port(), verbose=False)
    assert dist.is_initialized() and dist.get_world_size() == 1
    t = torch.ones(2)
    dist.all_reduce(t, group=gpc.get_group(ParallelMode.DATA))
    assert t.tolist() == [1.0, 1.0]


@pytest.mark.slow  # takes seconds without starting a process
def test_missing_peer_ends_in_a_clear_error_within_the_timeout():
    port = free_port()
    start = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        launch({}, rank=0, world_size=2, host="127.0.0.1", port=port, timeout=3, verbose=False)
    elapsed = time.monotonic() - start
    assert elapsed < 30, f"took {elapsed:.1f} s"
    msg = str(e.value)
    assert f"tcp://127.0.0.1:{port}" in msg and "rank 0 of 2" in msg and "within 3 s" in msg
    assert "all 2 processes were started" in msg and "timeout=" in msg
    # nothing half-launched is left behind
    assert not dist.is_initialized()
    assert gpc.config is None and gpc.get_world_size() == 1


@pytest.mark.slow  # takes seconds without starting a process
def test_dist_timeout_from_the_config_is_used():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="within 1 s"):
        launch(dict(dist_timeout=1), rank=0, world_size=2, host="127.0.0.1", port=free_port(), verbose=False)
    assert time.monotonic() - start < 30


def test_nccl_for_several_processes_on_the_cpu_is_a_clear_error():
    # (one process on the CPU is accepted with a warning: tests/test_launch_device.py)
    with pytest.raises(RuntimeError, match="backend='gloo'"):
        launch({}, rank=0, world_size=2, host="127.0.0.1", port=free_port(), backend="nccl", verbose=False,
               device="cpu")
    assert not dist.is_initialized()


# -- launch_from_* -------------------------------------------------------------------------------------------
def test_launch_from_torch_without_torchrun_is_one_process(capsys):
    launch_from_torch(config=dict(BATCH_SIZE=4))
    out = capsys.readouterr().out
    assert out.count("No torchrun environment found") == 1
    assert gpc.get_world_size() == 1 and gpc.get_global_rank() == 0 and gpc.config.BATCH_SIZE == 4


def test_exported_master_addr_alone_still_means_one_process(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # nothing listens there: a real rendezvous would fail
    launch_from_torch(config={}, verbose=False)
    assert gpc.get_world_size() == 1


def test_launch_from_torch_with_incomplete_environment(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(RuntimeError, match="missing LOCAL_RANK, MASTER_ADDR, MASTER_PORT.*torch.distributed.run"):
        launch_from_torch(config={}, verbose=False)
    assert not dist.is_initialized()


def test_launch_from_torch_reads_the_torchrun_variables(monkeypatch):
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)
    launch_from_torch(config={}, verbose=False)
    assert dist.get_world_size() == 1 and gpc.get_local_rank() == 0


def test_launch_from_slurm_and_openmpi(monkeypatch):
    for name in ("SLURM_PROCID", "SLURM_NPROCS", "SLURM_LOCALID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                 "OMPI_COMM_WORLD_LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="SLURM_PROCID"):
        launch_from_slurm({}, host="127.0.0.1", port=free_port(), verbose=False)
    with pytest.raises(RuntimeError, match="OMPI_COMM_WORLD_RANK"):
        launch_from_openmpi({}, host="127.0.0.1", port=free_port(), verbose=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NPROCS", "1")
    launch_from_slurm({}, host="127.0.0.1", port=free_port(), verbose=False)
    assert gpc.get_world_size() == 1
    gpc.destroy()
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    launch_from_openmpi({}, host="localhost", port=free_port(), verbose=False)
    assert gpc.get_world_size() == 1 and gpc.get_local_rank() == 0


def test_default_parser_has_the_legacy_arguments():
    parser = colossal_lite.get_default_parser()
    args = parser.parse_args(["--config", "c.py", "--host", "::1", "--port", "29500", "--world_size", "2",
                              "--rank", "1", "--local_rank", "0", "--backend", "gloo"])
    assert (args.config, args.host, args.port, args.world_size, args.rank, args.local_rank, args.backend) == \
        ("c.py", "::1", 29500, 2, 1, 0, "gloo")
    assert parser.parse_args([]).backend is None  # None: nccl with CUDA, gloo otherwise


# -- real processes ----------------------------------------------------------------------------------------------
SINGLE_PROCESS_SCRIPT = textwrap.dedent("""\
    import json, sys
    import torch.distributed as dist
    from colossal_lite import launch_from_torch
    from colossal_lite.core import global_context as gpc

    launch_from_torch(config=sys.argv[1])
    print("RESULT " + json.dumps(dict(world=gpc.get_world_size(), rank=gpc.get_global_rank(),
                                      dist=dist.is_initialized(), batch=gpc.config.BATCH_SIZE)))
    gpc.destroy()
    """)


def test_plain_python_script_runs_as_one_process(tmp_path):
    script = tmp_path / "single.py"
    script.write_text(SINGLE_PROCESS_SCRIPT)
    proc = run_python(script, [write_config(tmp_path)], timeout=120)
    lines = proc.stdout.splitlines()
    notes = [line for line in lines if "No torchrun environment found" in line]
    assert len(notes) == 1, proc.stdout  # exactly one one-line note
    result = json.loads(next(line for line in lines if line.startswith("RESULT "))[len("RESULT "):])
    assert result == dict(world=1, rank=0, dist=True, batch=8)
    assert "\x1b[" not in proc.stdout  # stdout is a pipe: plain text


TWO_PROCESS_SCRIPT = textwrap.dedent("""\
    import json, os, random, sys
    from pathlib import Path

    import numpy as np
    import torch
    import torch.distributed as dist

    import colossal_lite
    from colossal_lite.context import ParallelMode
    from colossal_lite.core import global_context as gpc

    config_path, out_dir = sys.argv[1], Path(sys.argv[2])
    before = dict(config=gpc.config is None, initialized=gpc.is_initialized(), world=gpc.get_world_size())
    colossal_lite.launch_from_torch(config=config_path, seed=1234)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    res = dict(
        before=before, env_rank=rank, env_world=world,
        rank=gpc.get_global_rank(), local_rank=gpc.get_local_rank(), world=gpc.get_world_size(),
        world_global=gpc.get_world_size(ParallelMode.GLOBAL), world_data=gpc.get_world_size(ParallelMode.DATA),
        rank_data=gpc.get_local_rank(ParallelMode.DATA), rank_global=gpc.get_local_rank(ParallelMode.GLOBAL),
        world_tensor=gpc.get_world_size(ParallelMode.TENSOR), dp_size=gpc.data_parallel_size,
        initialized=gpc.is_initialized(), initialized_data=gpc.is_initialized(ParallelMode.DATA),
        batch=gpc.config.BATCH_SIZE, accum=gpc.config.gradient_accumulation,
        device=str(gpc.device), backend=dist.get_backend(), ranks_in_group=gpc.get_ranks_in_group(ParallelMode.DATA),
    )
    for mode in ("GLOBAL", "DATA"):
        group = gpc.get_group(getattr(ParallelMode, mode))
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=group)
        res["sum_" + mode] = t.item()
        res["group_size_" + mode] = dist.get_world_size(group)
        res["group_is_world_" + mode] = group is dist.group.WORLD and group.size() == world
    draws = [random.random(), float(np.random.rand()), torch.rand(2).tolist()]
    everyone = [None] * world
    dist.all_gather_object(everyone, draws)
    res["seeds_equal"] = all(d == everyone[0] for d in everyone)
    random.seed(1234); np.random.seed(1234); torch.manual_seed(1234)
    res["seeds_are_the_seed"] = draws == [random.random(), float(np.random.rand()), torch.rand(2).tolist()]
    dist.barrier()
    gpc.destroy()
    res["after"] = dict(dist=dist.is_initialized(), config=gpc.config is None, world=gpc.get_world_size(),
                        group=gpc.get_group() is None)
    (out_dir / f"result_{rank}.json").write_text(json.dumps(res))
    """)


def test_two_processes_under_torchrun(tmp_path):
    script = tmp_path / "two.py"
    script.write_text(TWO_PROCESS_SCRIPT)
    proc = run_torchrun(script, [write_config(tmp_path), tmp_path], nproc=2, timeout=120)
    assert proc.stdout.count("Distributed environment is initialized") == 1, proc.stdout  # rank 0 only
    results = [json.loads((tmp_path / f"result_{r}.json").read_text()) for r in range(2)]
    for r, res in enumerate(results):
        assert res["before"] == dict(config=True, initialized=False, world=1)
        assert res["env_rank"] == res["rank"] == res["rank_data"] == res["rank_global"] == r
        assert res["local_rank"] == r  # one node: local rank = global rank
        assert res["env_world"] == res["world"] == res["world_global"] == res["world_data"] == res["dp_size"] == 2
        assert res["world_tensor"] == 1
        assert res["initialized"] and res["initialized_data"]
        assert res["batch"] == 8 and res["accum"] == 2
        assert res["device"] == "cpu" and res["backend"] == "gloo"
        assert res["ranks_in_group"] == [0, 1]
        assert res["sum_GLOBAL"] == res["sum_DATA"] == 3.0
        assert res["group_size_GLOBAL"] == res["group_size_DATA"] == 2
        assert res["group_is_world_GLOBAL"] and res["group_is_world_DATA"]
        assert res["seeds_equal"] and res["seeds_are_the_seed"]
        assert res["after"] == dict(dist=False, config=True, world=1, group=True)
