"""Two torchrun agents on this machine stand for two nodes: ``--nnodes 2 --nproc-per-node 1``, c10d rendezvous.

One job trains DDP, then ZeRO stage 3, with a checkpoint every 2 steps and ``resume_from='auto'``. In the
stage 3 run the worker of global rank 1 kills itself with SIGKILL after step 5, like a crashed node; torchrun
(``--max-restarts 1``) restarts the workers of both nodes and the job finishes. The parameters must equal, bit
for bit, those of an uninterrupted single-node run of the same world size (2 ranks on one node, forked by the
tests' launcher: ``run_ranks``).

What torchrun does when one node's worker dies: that node's agent sees its worker fail, counts a restart and
joins a new rendezvous round; the other agent sees a node waiting and restarts its workers too, but counts no
restart (a membership change). So the restarted workers see TORCHELASTIC_RESTART_COUNT 1 on the failed node
and 0 on the other, and torchrun's store still holds the killed attempt's keys. Rank 0 waits at the kill step
until its agent stops it, so the job always takes that path.
"""
import datetime
import json
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist
from dist_helpers import REPO, _env, free_port, run_ranks

from colossal_lite.launch import _attempt_store

KILL_AT = 5  # optimizer step after which rank 1 is killed; checkpoints every 2 steps, so it resumes from step 4

SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, time
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    import colossal_lite
    from colossal_lite.core import global_context as gpc
    from colossal_lite.logging import get_dist_logger
    from colossal_lite.trainer import Trainer
    from colossal_lite.trainer.hooks import BaseHook, LossHook, SaveCheckpointHook
    from colossal_lite.utils import get_dataloader

    out, kill_at = sys.argv[1], int(sys.argv[2])
    colossal_lite.launch_from_torch(config={}, seed=5, timeout=30)
    rank = gpc.get_global_rank()
    print(f"worker: global rank {rank}, local rank {gpc.get_local_rank()}, world size {gpc.get_world_size()}, "
          f"device {gpc.device}, restart count {os.environ.get('TORCHELASTIC_RESTART_COUNT', 'none')}\\n", end="",
          flush=True)  # one write: the agent's log lines share this pipe
    get_dist_logger().info("rank 0 only: start")


    class KillRank1Once(BaseHook):
        \"\"\"After step ``kill_at``, once per job: rank 1 dies by SIGKILL; rank 0 waits until its agent stops it.\"\"\"

        def after_train_iter(self, trainer, *args):
            marker = os.path.join(out, "killed")
            if not (trainer.state.stepped and trainer.cur_step == kill_at) or os.path.exists(marker + ".done"):
                return
            if rank == 1:
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            while not os.path.exists(marker):  # rank 1 is about to die
                time.sleep(0.01)
            open(marker + ".done", "w").close()
            got, previous = [], signal.getsignal(signal.SIGTERM)  # fit's handler: a checkpoint, then exit 75

            def note(signum, frame):
                got.append(signum)
                previous(signum, frame)

            signal.signal(signal.SIGTERM, note)
            deadline = time.monotonic() + 60
            while not got and time.monotonic() < deadline:
                time.sleep(0.01)


    def train(mode, hooks):
        gpc.load_config(dict(zero=dict(stage=3)) if mode == "zero3" else {})
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
        engine, loader, _, _ = colossal_lite.initialize(
            model, torch.optim.Adam(model.parameters(), lr=0.01), nn.CrossEntropyLoss(),
            get_dataloader(data, shuffle=True, batch_size=4), verbose=False)
        hooks = [LossHook(), SaveCheckpointHook("2ba", os.path.join(out, "ck-" + mode))] + hooks
        Trainer(engine).fit(loader, epochs=2, hooks=hooks, resume_from="auto")
        state = engine.strategy.model_state_dict(engine.model)  # full parameters: a collective
        if rank == 0:
            json.dump({k: v.tolist() for k, v in state.items()}, open(os.path.join(out, mode + ".json"), "w"))


    train("ddp", [])
    train("zero3", [KillRank1Once()] if kill_at else [])
    gpc.destroy()
""")


def _agent(script, out, port, *torchrun_args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=multinode-test",
           "--rdzv-conf=join_timeout=60", *torchrun_args, str(script), str(out), str(KILL_AT)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=REPO)


def _finish(agents, timeout):
    """Each agent's (exit status, output); agents still running after ``timeout`` s are stopped and fail the test."""
    results = []
    for proc in agents:
        try:
            results.append((proc.wait(timeout=timeout), proc.stdout.read()))
        except subprocess.TimeoutExpired:
            for p in agents:
                p.send_signal(signal.SIGTERM)  # the agent stops its workers
            for p in agents:
                try:
                    p.wait(timeout=40)
                except subprocess.TimeoutExpired:
                    p.kill()
            logs = "\n".join(f"== agent {i}\n{p.stdout.read()}" for i, p in enumerate(agents))
            raise AssertionError(f"the 2-node job did not finish within {timeout} s\n{logs}") from None
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The single-node reference (2 processes, no kill) and the 2-node job with the kill, on the same script."""
    folder = tmp_path_factory.mktemp("multinode")
    script = folder / "train.py"
    script.write_text(SCRIPT)
    single, multi = folder / "single", folder / "multi"
    single.mkdir()
    multi.mkdir()
    agents = [_agent(script, multi, port, "--max-restarts=1") for port in [free_port()] * 2]
    run_ranks(script, [single, 0], nproc=2, timeout=120)  # the reference: same world size, one node, no agent
    results = _finish(agents, timeout=150)
    for i, (status, log) in enumerate(results):
        assert status == 0, f"agent {i} exited {status}\n{log}"
    logs = [log for _, log in results]
    worker_lines = [re.findall(r"^worker: global rank (\d), local rank (\d), world size (\d), device (\w+), "
                               r"restart count (\d)$", log, re.M) for log in logs]
    first = [int(lines[0][0]) for lines in worker_lines]
    assert sorted(first) == [0, 1], worker_lines  # the rendezvous gave the agents ranks 0 and 1, in either order
    by_rank = {rank: dict(log=logs[i], workers=worker_lines[i]) for i, rank in enumerate(first)}
    return {"single": single, "multi": multi, **by_rank}


def _parameters(path):
    return {k: torch.tensor(v) for k, v in json.loads(path.read_text()).items()}


@pytest.mark.parametrize("mode", ["ddp", "zero3"])
def test_two_nodes_train_to_the_parameters_of_one_node_with_the_same_world_size(runs, mode):
    reference, final = _parameters(runs["single"] / f"{mode}.json"), _parameters(runs["multi"] / f"{mode}.json")
    assert final.keys() == reference.keys()
    for name in reference:
        assert torch.equal(final[name], reference[name]), (mode, name)


def test_the_rank_0_lines_are_printed_by_the_node_of_global_rank_0_only(runs):
    rank0, rank1 = runs[0]["log"], runs[1]["log"]
    assert rank0.count("Distributed environment is initialized: world size 2") == 2  # once per attempt
    assert rank0.count("rank 0 only: start") == 2
    assert "resumed from" in rank0
    assert "colossal_lite - INFO" not in rank1, rank1
    assert "colossal_lite [rank 1] - INFO" not in rank1, rank1  # its lines name their rank (issue 23)


def test_each_node_has_local_rank_0_and_its_own_global_rank(runs):
    for rank in (0, 1):
        for global_rank, local_rank, world, device, _ in runs[rank]["workers"]:
            assert (int(global_rank), int(local_rank), int(world), device) == (rank, 0, 2, "cpu")


def test_a_killed_node_restarts_both_nodes_workers_which_resume_from_the_last_checkpoint(runs):
    rank0, rank1 = runs[0], runs[1]
    for log in (rank0["log"], rank1["log"]):  # each restarted worker found this attempt's peers at once
        assert "could not start the process group" not in log, log
    assert "exitcode: -9" in rank1["log"]  # torchrun's report of the worker killed by SIGKILL
    # the failed node's agent counts the restart; the other restarts its workers for the membership change
    assert [w[4] for w in rank1["workers"]] == ["0", "1"]
    assert [w[4] for w in rank0["workers"]] == ["0", "0"]
    checkpoint = runs["multi"] / "ck-zero3" / "epoch0-step4"
    assert f"resumed from {checkpoint}: epoch 0, step 4, batch 4 of the epoch" in rank0["log"]
    assert (runs["multi"] / "ck-zero3" / "last").read_text().strip() == "epoch1-step16"


def test_each_attempt_gets_its_own_prefix_of_torchruns_store_even_with_a_killed_attempts_keys_left():
    """The handshake of ``launch`` on a store that still holds a killed attempt's hello and answer (no torchrun)."""
    timeout = datetime.timedelta(seconds=20)
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
    server.set("colossal_lite/attempt/hello1", "killed-attempts-hello")  # what the killed rank 1 left
    server.set("colossal_lite/attempt/welcome1/killed-attempts-hello", "killed-attempts-name")
    stores, errors = {}, []

    def worker(rank):
        try:
            stores[rank] = _attempt_store("127.0.0.1", server.port, rank, 2, timeout)
        except Exception as e:  # reported below: a thread's exception would otherwise be lost
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(rank,)) for rank in (0, 1)]
    threads[0].start()  # rank 0 reads the killed attempt's hello first
    time.sleep(0.3)
    threads[1].start()
    for t in threads:
        t.join(30)
    assert not errors and sorted(stores) == [0, 1], errors
    stores[0].set("rank0", "here")
    assert stores[1].get("rank0") == b"here"  # both ranks are on the same fresh prefix
    assert not server.check(["colossal_lite/attempt/killed-attempts-name/rank0"])  # not the killed attempt's
