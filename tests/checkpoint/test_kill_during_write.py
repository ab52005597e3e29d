"""A writer killed with SIGKILL at random moments always leaves ``last`` loadable and matching a state it wrote.

A driver process imports torch once and forks one writer process per round (a real process, killed
with a real SIGKILL); the writer resumes from ``last`` like a restarted job and saves ~8 MB
checkpoints in a loop (~25 ms each, so most kills land inside a write). After each kill this test
checks the folder and tells the driver to start the next round.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from dist_helpers import REPO

from colossal_lite.checkpoint import CheckpointManager

KILLS = 8
SEED = 20240605
N = 1_000_000

_DRIVER = textwrap.dedent("""
    import os, random, signal, sys, time
    import torch
    torch.set_num_threads(1)  # no thread pool in the parent: forking stays safe
    from colossal_lite.checkpoint import CheckpointManager

    d, log, kills, seed, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])

    def writer():
        m = CheckpointManager(d, keep_last_n=2)
        path = m.resolve("auto")
        step = 0
        if path is not None:
            shared, rank = m.load(path)
            step = shared["step"] + 1
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        while True:
            w = torch.full((n,), float(step))
            m.save(f"epoch0-step{step}", {"step": step, "w": w, "w2": w + 1}, {"rank_step": step},
                   {"loss": float(step)})
            os.write(fd, f"saved {step}\\n".encode())
            step += 1

    rng = random.Random(seed)
    for k in range(kills):
        pid = os.fork()
        if pid == 0:
            try:
                writer()
            finally:
                os._exit(1)
        # each round first completes one save (however loaded the machine), then dies at a random moment
        grown = time.monotonic() + 60
        size = os.path.getsize(log) if os.path.exists(log) else 0
        while (os.path.getsize(log) if os.path.exists(log) else 0) == size and time.monotonic() < grown:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.03, 0.4))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        print(f"killed {k}", flush=True)
        if sys.stdin.readline().strip() != "next":
            break
""")


def _last_saved(log):
    if not log.exists():
        return -1
    lines = log.read_text().split()
    return int(lines[-1]) if lines else -1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork and SIGKILL")
def test_sigkill_at_random_moments_leaves_last_loadable(tmp_path):
    script, d, log = tmp_path / "driver.py", tmp_path / "ck", tmp_path / "saved.log"
    script.write_text(_DRIVER)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p))
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.Popen([sys.executable, str(script), str(d), str(log), str(KILLS), str(SEED), str(N)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=REPO)
    mid_write, steps = 0, []
    try:
        for k in range(KILLS):
            line = proc.stdout.readline()
            assert line.strip() == f"killed {k}", f"driver said {line!r}; stderr:\n{proc.stderr.read()}"
            last_saved = _last_saved(log)
            leftovers = [n for n in os.listdir(d) if n.startswith(".")] if d.exists() else []
            mid_write += bool(leftovers)
            m = CheckpointManager(d, keep_last_n=2)  # the next start cleans what the killed write left
            assert sorted(p.name for p in m.removed_leftovers) == sorted(leftovers)
            assert not [n for n in os.listdir(d) if n.startswith(".")] if d.exists() else True
            path = m.resolve("auto")
            if path is None:  # killed before its first checkpoint was complete
                assert last_saved == -1
                steps.append(None)
            else:
                shared, rank = m.load("last")
                step = shared["step"]
                # the newest state whose save returned, or the one being saved when the pointer had just moved; a
                # kill between a save's return and its log line leaves the log behind: the state the previous round
                # found is then the newest known one
                known = max([last_saved] + [s for s in steps if s is not None])
                assert step in (known, known + 1), (step, last_saved, steps)
                assert rank == {"rank_step": step}
                assert torch.equal(shared["w"], torch.full((N,), float(step)))
                assert torch.equal(shared["w2"], torch.full((N,), float(step + 1)))
                assert len(m.list_checkpoints()) <= 3  # keep_last_n=2, plus at most one orphan of the kill
                steps.append(step)
            proc.stdin.write("next\n")
            proc.stdin.flush()
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    done = [s for s in steps if s is not None]
    assert len(done) == KILLS and all(b > a for a, b in zip(done, done[1:])), steps  # each round resumed and went on
    assert mid_write >= 2, f"only {mid_write} of {KILLS} kills landed inside a write; the test proves little"
