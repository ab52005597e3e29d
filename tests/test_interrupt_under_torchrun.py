"""Ctrl-C under torchrun: a real torchrun job gets SIGINT on its whole process group, as from a terminal.

torchrun starts each worker in a session of its own, so the terminal's SIGINT reaches its agent, which
forwards it to the workers, waits for them and then ends with its own SignalException traceback and
exit status 1. The workers finish the step, write a checkpoint, exit 75 and say how to continue; a
second Ctrl-C (forwarded by the agent as SIGTERM) stops them at once, without a checkpoint.
"""
import os
import signal
import subprocess
import sys
import textwrap
import time

from dist_helpers import REPO, _env, free_port, run_ranks

SCRIPT = textwrap.dedent("""
    import sys, time
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    import colossal_lite
    from colossal_lite.core import global_context as gpc
    from colossal_lite.trainer import Trainer
    from colossal_lite.trainer.checkpointing import CheckpointSession
    from colossal_lite.trainer.hooks import BaseHook, LossHook, SaveCheckpointHook
    from colossal_lite.utils import get_dataloader

    ck, slow, check_s = sys.argv[1], sys.argv[2] == "slow", float(sys.argv[3])
    CheckpointSession.check_s = check_s  # how often the ranks agree on a stop request (seconds)
    colossal_lite.launch_from_torch(config={}, verbose=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(400, 6, generator=g), torch.randint(0, 3, (400,), generator=g))
    engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                    nn.CrossEntropyLoss(), get_dataloader(data, batch_size=4),
                                                    verbose=False)

    class Steps(BaseHook):
        def after_train_iter(self, trainer, *args):
            if trainer.state.stepped and slow:
                if gpc.get_global_rank() == 0:
                    print(f"step {trainer.cur_step}\\n", end="", flush=True)  # one write: the ranks' lines never mix
                time.sleep(0.05)  # slow enough that the Ctrl-C lands mid-epoch

    Trainer(engine).fit(loader, epochs=1, hooks=[LossHook(), Steps(), SaveCheckpointHook(1000, ck)],
                        resume_from="auto", display_progress=False)
    print(f"finished at step {engine.num_updates}\\n", end="", flush=True)
""")


def _torchrun(script, *args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(script), *map(str, args)]
    # a session of its own, like a job started from a terminal: SIGINT goes to its whole process group
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=REPO,
                            start_new_session=True)


def _ctrl_c(proc, after_line: str, again_after: str = "", again_seen: int = 2, timeout: float = 90):
    """Press Ctrl-C once ``after_line`` is printed (again once ``again_after`` has been printed ``again_seen`` times:
    by both ranks, so that each has handled the first press and takes the second as a press of its own, not one
    signal that arrived twice while it waited in a collective); returns (output, seconds to exit)."""
    lines, pressed, seen = [], None, 0
    try:
        for line in proc.stdout:
            lines.append(line)
            if pressed is None and line.strip() == after_line:
                os.killpg(proc.pid, signal.SIGINT)
                pressed = time.monotonic()
                if not again_after:
                    break
            elif pressed is not None and again_after in line:
                seen += 1
                if seen == again_seen:
                    os.killpg(proc.pid, signal.SIGINT)
                    break
        rest, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return "".join(lines) + rest, time.monotonic() - pressed


def _library_frames(out: str):
    return [ln for ln in out.splitlines() if 'File "' in ln and "colossal_lite" in ln]


def test_ctrl_c_writes_a_checkpoint_says_how_to_continue_and_the_same_command_resumes(tmp_path):
    script, ck = tmp_path / "train.py", tmp_path / "ck"
    script.write_text(SCRIPT)
    proc = _torchrun(script, ck, "slow", 1.0)
    out, _ = _ctrl_c(proc, after_line="step 5")

    assert proc.returncode == 1, out  # torchrun's own status after a Ctrl-C, whatever the workers did (documented)
    assert "SIGINT received: finishing the current optimizer step, then writing a checkpoint" in out
    stopped = [ln for ln in out.splitlines() if "SIGINT: stopped at epoch 0, step" in ln]
    assert len(stopped) == 1, out  # rank 0 only
    step = int(stopped[0].split("step ")[1].split(" ")[0])
    last = ck / f"epoch0-step{step}"
    assert (ck / "last").read_text().strip() == last.name
    assert stopped[0].endswith(
        f"checkpoint {last}; the workers exit with status 75, and torchrun, which got the Ctrl-C too, then ends with "
        f"a SignalException traceback and status 1. Run the same command again with fit(..., resume_from='auto') "
        f"to continue"), stopped[0]
    assert "SignalException" in out  # torchrun's own report of the Ctrl-C
    assert not _library_frames(out), out  # the workers stopped cleanly: no traceback through colossal_lite

    # the rerun of the same script on two ranks (forked: the resume does not depend on the launcher, and the
    # torchrun path of a resume is test_preemption.py's)
    rest = run_ranks(script, [ck, "fast", 1.0], nproc=2, timeout=90).stdout
    assert f"resumed from {last}: epoch 0, step {step}" in rest and "finished at step 50" in rest


def test_a_second_ctrl_c_stops_the_workers_at_once_without_a_checkpoint(tmp_path):
    script, ck = tmp_path / "train.py", tmp_path / "ck"
    script.write_text(SCRIPT)
    # the ranks agree on a stop every 30 s here, so the second Ctrl-C always lands before the checkpoint
    out, seconds = _ctrl_c(_torchrun(script, ck, "slow", 30.0), after_line="step 3", again_after="SIGINT received")
    assert "KeyboardInterrupt" in out, out
    checkpoints = sorted(p.name for p in ck.iterdir() if p.name != "metrics.jsonl") if ck.exists() else []
    assert checkpoints == [], checkpoints  # (the run's metrics file may be there)
    assert seconds < 25, out  # not torchrun's 30 s wait before SIGKILL
