"""A 2-process script that never calls ``gpc.destroy()`` exits with status 0.

Without a teardown such a process can abort at interpreter exit ("terminate called without an active
exception", status 134): a gloo worker thread that drops a finished collective after the script's last
line waits for the GIL while the interpreter finalizes (see ``colossal_lite/core/global_context.py``).
The library destroys the group it created from an exit handler, while the interpreter is whole.

Real processes with torchrun's environment (gloo), real interpreter exits. An exit handler registered before
``launch_from_torch`` runs after the library's and reports what is left of the group. Every process is a fork of
one that imported torch once (``run_ranks``; the twenty runs in a row have their own such launcher): a rank still
ends as an interpreter ends, exit handlers and finalization included, which is what the race is about.
"""
import json
import sys
import textwrap

from dist_helpers import REPO, _env, _run, run_ranks

PROBE = textwrap.dedent("""
    import atexit, json, os, sys
    import torch
    import torch.distributed as dist

    OUT = sys.argv[1]

    def gloo_worker_threads():
        names = []
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        return names.count("pt_gloo_runloop")

    def report():  # registered before launch: runs after colossal_lite's exit handler
        with open(os.path.join(OUT, f"rank{os.environ['RANK']}.json"), "w") as f:
            json.dump(dict(group_alive=dist.is_initialized(), gloo_threads=gloo_worker_threads()), f)

    atexit.register(report)
""")

TRAIN = textwrap.dedent("""
    import colossal_lite
    from torch import nn

    colossal_lite.launch_from_torch(config=CONFIG, verbose=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    engine, *_ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(),
                                          verbose=False)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    for _ in range(3):
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        engine.step()
""")

DCP_SAVE = textwrap.dedent("""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(engine.model, engine.optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(OUT, "dcp"))
""")


def run_without_destroy(tmp_path, config: dict, tail: str = ""):
    script = tmp_path / "train.py"
    script.write_text(PROBE + f"CONFIG = {config!r}\n" + TRAIN + tail)
    proc = run_ranks(script, [tmp_path], nproc=2, timeout=120)  # asserts exit status 0
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr  # no error from an exit handler either
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def test_ddp_group_is_destroyed_and_its_threads_joined_at_exit(tmp_path):
    for report in run_without_destroy(tmp_path, {}):
        assert report == dict(group_alive=False, gloo_threads=0), report


def test_fsdp2_group_is_destroyed_at_exit_after_a_distributed_checkpoint_save(tmp_path):
    """FSDP2 keeps the group object (and its threads) alive in the sharded module; the group is still destroyed."""
    for report in run_without_destroy(tmp_path, {"zero": {"stage": 3}}, DCP_SAVE):
        assert not report["group_alive"], report
    assert (tmp_path / "dcp" / ".metadata").is_file()


FIT = textwrap.dedent("""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    import colossal_lite
    from colossal_lite.trainer import Trainer
    from colossal_lite.trainer.hooks import LossHook
    from colossal_lite.utils import get_dataloader

    colossal_lite.launch_from_torch(config={}, verbose=False)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                    nn.CrossEntropyLoss(), get_dataloader(data, batch_size=4),
                                                    verbose=False)
    Trainer(engine).fit(loader, epochs=1, hooks=[LossHook()], display_progress=False)  # no gpc.destroy()
""")

RUNNER = textwrap.dedent("""
    import gc, io, json, os, runpy, socket, sys
    import torch, torch._dynamo  # what the script imports (DDP imports torch._dynamo)
    import colossal_lite, colossal_lite.trainer

    script, runs, logs = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    gc.freeze()  # the forks leave these objects to the OS at exit instead of collecting them one by one

    def start(rank, port, log):
        pid = os.fork()
        if pid:
            return pid
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # what torchrun sets
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0), write_through=True)  # unbuffered, as torchrun's -u
        sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0), write_through=True)
        sys.argv = [script]
        global script_globals  # kept, so the script's objects live until the interpreter exits, as a script's do
        script_globals = runpy.run_path(script, run_name="__main__")
        raise SystemExit(0)  # the interpreter's own exit: exit handlers, then finalization

    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    statuses = []
    for run in range(runs):
        port = free_port()
        pids = [start(rank, port, os.path.join(logs, f"run{run}_rank{rank}.log")) for rank in (0, 1)]
        statuses.append([os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids])
    print(json.dumps(statuses))
""")


def test_twenty_runs_in_a_row_without_destroy_all_exit_0(tmp_path):
    script, runner, logs = tmp_path / "fit.py", tmp_path / "runner.py", tmp_path / "logs"
    script.write_text(FIT)
    runner.write_text(RUNNER)
    logs.mkdir()
    proc = _run([sys.executable, str(runner), str(script), "20", str(logs)], timeout=240, env=_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    statuses = json.loads(proc.stdout.strip().splitlines()[-1])
    logged = {(run, rank): (logs / f"run{run}_rank{rank}.log").read_text() for run in range(20) for rank in (0, 1)}
    failed = {run: codes for run, codes in enumerate(statuses) if codes != [0, 0]}
    assert len(statuses) == 20 and not failed, {run: logged[run, 0][-2000:] + logged[run, 1][-2000:] for run in failed}
    noisy = {key: text for key, text in logged.items() if "Traceback" in text or "terminate called" in text}
    assert not noisy, noisy  # an exit handler's error would not change the status, only print
