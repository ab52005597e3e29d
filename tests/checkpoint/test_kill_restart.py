"""A training run killed with SIGKILL at random moments and restarted with resume_from='auto' ends like an unkilled run.

A driver process imports torch once and forks each training process (a real process, killed with a
real SIGKILL, like a crashed node or the OOM killer). Training saves a checkpoint at every optimizer
step. Most rounds kill it a random number of steps after it started, at a random instant inside a
step or a save; the "write" rounds kill it while a checkpoint is being written (the writer prints a
marker between its files and waits there). Each restart cleans what the killed write left and
continues from ``last``. The final parameters must equal, bit for bit, those of a run never killed.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from dist_helpers import REPO, _env

SEED = 20240611
ROUNDS = ["steps", "write", "steps", "steps", "write", "steps"]

DRIVER = textwrap.dedent("""
    import json, os, random, signal, sys, time
    import torch
    torch.set_num_threads(1)  # no thread pool in the parent: forking stays safe
    from torch import nn
    from torch.utils.data import TensorDataset
    import colossal_lite
    import colossal_lite.checkpoint.writer as writer_module
    from colossal_lite.core import global_context as gpc
    from colossal_lite.trainer import Trainer
    from colossal_lite.trainer.hooks import BaseHook, LossHook, LRSchedulerHook, SaveCheckpointHook
    from colossal_lite.utils import get_dataloader

    ck, out, seed, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4].split(",")
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # its first use imports torch._dynamo (2 s): once, here

    def train(folder, marker_fd=None, pause_at_save=None):
        gpc.destroy()
        colossal_lite.launch_from_torch(config=dict(gradient_accumulation=2), seed=5, verbose=False)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 3))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, 4, 0.9)
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(128, 6, generator=g), torch.randint(0, 3, (128,), generator=g))
        engine, loader, _, sched = colossal_lite.initialize(model, opt, nn.CrossEntropyLoss(),
                                                            get_dataloader(data, shuffle=True, batch_size=4),
                                                            lr_scheduler=sched, verbose=False)

        class Steps(BaseHook):
            def after_train_iter(self, trainer, *args):
                if marker_fd is not None and trainer.state.stepped:
                    os.write(marker_fd, f"step {trainer.cur_step}\\n".encode())

        if pause_at_save is not None:  # stop inside the pause_at_save-th write, after its shared.pt
            writes = [0]
            original = writer_module.save_file

            def slow_save_file(obj, path):
                n = original(obj, path)
                if os.path.basename(str(path)) == "shared.pt":
                    writes[0] += 1
                    if writes[0] == pause_at_save:
                        os.write(marker_fd, f"writing {path}\\n".encode())
                        time.sleep(30)
                return n

            writer_module.save_file = slow_save_file
        hooks = [LossHook(), LRSchedulerHook(sched, by_epoch=False), Steps(), SaveCheckpointHook("1ba", folder)]
        Trainer(engine).fit(loader, epochs=3, hooks=hooks, resume_from="auto")
        return {k: v.tolist() for k, v in model.state_dict().items()}

    def in_child(fn):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                fn(w)
                os._exit(0)
            except BaseException as e:
                os.write(2, f"child failed: {type(e).__name__}: {e}\\n".encode())
                os._exit(1)
        os.close(w)
        return pid, os.fdopen(r)

    def finish(path):
        def run(fd):
            json.dump(train(path), open(os.path.join(out, os.path.basename(path) + ".json"), "w"))
        pid, reader = in_child(run)
        reader.read()
        assert os.waitpid(pid, 0)[1] == 0

    rng = random.Random(seed)
    for k, kind in enumerate(rounds):
        pause = rng.randint(2, 6) if kind == "write" else None
        pid, reader = in_child(lambda fd: train(ck, fd, pause))
        wanted, seen, last = rng.randint(3, 9), 0, ""
        for line in reader:  # kill after `wanted` more steps (at a random instant), or inside the paused write
            last = line.strip()
            if kind == "write" and last.startswith("writing"):
                break
            if kind == "steps" and last.startswith("step"):
                seen += 1
                if seen == wanted:
                    time.sleep(rng.uniform(0, 0.004))
                    break
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        reader.close()
        leftovers = sorted(n for n in os.listdir(ck) if n.startswith(".")) if os.path.isdir(ck) else []
        print(json.dumps(dict(round=k, kind=kind, last=last, killed=os.WIFSIGNALED(status), leftovers=leftovers)),
              flush=True)
    finish(ck)
    finish(ck + "-never-killed")
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork and SIGKILL")
def test_sigkill_at_random_moments_then_resume_auto_ends_like_an_unkilled_run(tmp_path):
    script, ck = tmp_path / "driver.py", tmp_path / "ck"
    script.write_text(DRIVER)
    proc = subprocess.run([sys.executable, str(script), str(ck), str(tmp_path), str(SEED), ",".join(ROUNDS)],
                          capture_output=True, text=True, timeout=120, env=_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rounds = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["kind"] for r in rounds] == ROUNDS
    assert all(r["killed"] for r in rounds), rounds  # every round was really killed, none ran to its end
    for r in rounds:
        if r["kind"] == "write":  # killed inside a write: its temporary folder is left, `last` is not moved
            assert r["last"].startswith("writing") and any(n.startswith(".tmp-") for n in r["leftovers"]), r
    assert not [n for n in os.listdir(ck) if n.startswith(".")]  # the next start cleaned them
    steps = sorted(int(n.split("step")[1].split("-")[0]) for n in os.listdir(ck) if n.startswith("epoch"))
    assert steps[-1] == 48 and (ck / "last").read_text().strip() == "epoch2-step48"
    final = json.loads((tmp_path / "ck.json").read_text())
    reference = json.loads((tmp_path / "ck-never-killed.json").read_text())
    assert final.keys() == reference.keys()
    for name in reference:
        assert torch.equal(torch.tensor(final[name]), torch.tensor(reference[name])), name
