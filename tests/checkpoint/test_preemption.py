"""SIGTERM / SIGINT: finish the optimizer step, write a checkpoint, exit with status 75; the run resumes exactly.

Real signals: a training process gets SIGTERM from this test; in-process runs send SIGINT to themselves;
on 2 ranks (torchrun) only rank 1 is signalled, both ranks stop after the same step, and torchrun's
``--max-restarts`` restarts them with ``resume_from='auto'`` to the uninterrupted run's parameters.
"""
import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from dist_helpers import REPO, _env, free_port
from torch import nn
from torch.utils.data import TensorDataset

import colossal_lite
from colossal_lite.checkpoint import read_checkpoint
from colossal_lite.core import global_context as gpc
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.checkpointing import PREEMPTED_EXIT_CODE, TrainingPreempted
from colossal_lite.trainer.hooks import BaseHook, LossHook, LRSchedulerHook, SaveCheckpointHook
from colossal_lite.utils import get_dataloader

COMMON = textwrap.dedent("""
    import json, os, signal, sys, time
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    import colossal_lite
    from colossal_lite.core import global_context as gpc
    from colossal_lite.trainer import Trainer
    from colossal_lite.trainer.checkpointing import CheckpointSession, TrainingPreempted
    from colossal_lite.trainer.hooks import BaseHook, LossHook, LRSchedulerHook, SaveCheckpointHook
    from colossal_lite.utils import get_dataloader

    def build(n, batch):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 3))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.8)
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
        engine, loader, _, sched = colossal_lite.initialize(model, opt, nn.CrossEntropyLoss(),
                                                            get_dataloader(data, shuffle=True, batch_size=batch),
                                                            lr_scheduler=sched, verbose=False)
        return model, engine, loader, sched

    def weights(model):
        return {k: v.tolist() for k, v in model.state_dict().items()}
""")

SINGLE = COMMON + textwrap.dedent("""
    ck, out = sys.argv[1], sys.argv[2]
    colossal_lite.launch_from_torch(config=dict(gradient_accumulation=2), seed=5, verbose=False)

    class Steps(BaseHook):
        def after_train_iter(self, trainer, *args):
            if trainer.state.stepped:
                print(f"step {trainer.cur_step}", flush=True)
                time.sleep(0.02)  # slow enough that the signal lands within a step or two

    def train(folder, resume):
        model, engine, loader, sched = build(80, 4)  # 20 batches, 10 steps per epoch
        hooks = [LossHook(), LRSchedulerHook(sched, by_epoch=False), Steps(), SaveCheckpointHook(1, folder)]
        Trainer(engine).fit(loader, epochs=3, hooks=hooks, resume_from=resume)
        return weights(model)

    before = signal.getsignal(signal.SIGTERM)
    try:
        final = train(ck, "auto")
    except TrainingPreempted as e:
        print(f"preempted: {e}; handler put back: {signal.getsignal(signal.SIGTERM) is before}", flush=True)
        raise
    print(f"finished; handler put back: {signal.getsignal(signal.SIGTERM) is before}", flush=True)
    reference = train(ck + "-reference", None)
    json.dump(dict(final=final, reference=reference), open(out, "w"))
""")


def _launch(script, ck, out):
    return subprocess.Popen([sys.executable, str(script), str(ck), str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO)


def test_sigterm_writes_a_checkpoint_exits_75_and_the_rerun_resumes_exactly(tmp_path):
    script, ck, out = tmp_path / "train.py", tmp_path / "ck", tmp_path / "out.json"
    script.write_text(SINGLE)
    proc = _launch(script, ck, out)
    try:
        lines = []
        for line in proc.stdout:  # the 6th optimizer step (mid-epoch 0) is done: preempt
            lines.append(line)
            if line.strip() == "step 6":
                proc.send_signal(signal.SIGTERM)
                break
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    out1 = "".join(lines) + rest + err
    assert proc.returncode == PREEMPTED_EXIT_CODE == 75, f"exit {proc.returncode}\n{out1}\n{err}"
    assert "SIGTERM received: finishing the current optimizer step, then writing a checkpoint" in err
    assert "handler put back: True" in out1
    stopped = [ln for ln in out1.splitlines() if "SIGTERM: stopped at epoch 0, step" in ln]
    assert stopped and "exiting with status 75. Run again with fit(..., resume_from='auto') to continue" in stopped[0]
    step = int(stopped[0].split("step ")[1].split(" ")[0])
    assert 6 <= step < 10  # the step in flight was finished; the epoch was not
    last = ck / (ck / "last").read_text().strip()
    assert last.name == f"epoch0-step{step}" and f"checkpoint {last};" in stopped[0]
    shared, _ = read_checkpoint(last)
    assert shared["trainer"]["progress"]["step"] == step and shared["engine"]["accumulation"]["micro_step"] == 0

    proc = _launch(script, ck, out)
    rest, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{rest}\n{err}"
    assert f"resumed from {last}: epoch 0, step {step}, batch {2 * step} of the epoch" in rest + err
    assert "finished; handler put back: True" in rest
    result = json.loads(out.read_text())
    for name, ref in result["reference"].items():
        assert torch.equal(torch.tensor(result["final"][name]), torch.tensor(ref)), name


# -- in process: SIGINT ------------------------------------------------------------------------
def _build():
    gpc.destroy()
    colossal_lite.launch_from_torch(config=dict(gradient_accumulation=2), seed=5, verbose=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.8)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g))
    engine, loader, _, sched = colossal_lite.initialize(model, opt, nn.CrossEntropyLoss(),
                                                        get_dataloader(data, shuffle=True, batch_size=4),
                                                        lr_scheduler=sched, verbose=False)
    return model, engine, loader, sched


class SendSignal(BaseHook):
    """Sends ``signum`` to this process ``times`` times at micro-batch ``at`` (inside an accumulation window)."""

    def __init__(self, signum, at, times=1):
        super().__init__()
        self.signum, self.at, self.times = signum, at, times

    def after_backward(self, trainer):
        if trainer.state.iteration + 1 == self.at:
            for _ in range(self.times):
                signal.raise_signal(self.signum)


def _fit(ck, resume=None, extra=()):
    model, engine, loader, sched = _build()
    trainer = Trainer(engine)
    trainer.fit(loader, epochs=2, resume_from=resume,
                hooks=[LossHook(), LRSchedulerHook(sched, by_epoch=False), SaveCheckpointHook("3ba", ck), *extra])
    return [p.detach().clone() for p in model.parameters()], trainer


@pytest.fixture
def clean():
    yield
    gpc.destroy()


def test_sigint_inside_a_window_finishes_the_window_saves_and_resumes_exactly(tmp_path, clean):
    want, _ = _fit(tmp_path / "reference")
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(TrainingPreempted) as info:
        _fit(tmp_path / "ck", extra=[SendSignal(signal.SIGINT, at=13)])  # micro-batch 13: window 7, first half
    assert info.value.code == 75 and info.value.signal == signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is before
    assert info.value.checkpoint == tmp_path / "ck" / "epoch1-step7"  # the window was finished: step 7, epoch 1
    assert str(info.value) == f"training preempted by SIGINT; checkpoint {info.value.checkpoint}; exit status 75"
    names = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert names == ["epoch0-step3", "epoch1-step6", "epoch1-step7", "last", "metrics.jsonl"]  # every 3 steps, then the stop
    got, trainer = _fit(tmp_path / "ck", resume="auto")
    assert trainer.cur_step == 10
    for a, b in zip(got, want):
        assert torch.equal(a, b)


class SignalInFinalEvaluation(BaseHook):
    """Sends SIGTERM to this process in the run's last evaluation, after the last step."""

    def after_test_iter(self, trainer, *args):
        if trainer.state.step == 10 and not getattr(self, "sent", False):
            self.sent = True
            signal.raise_signal(signal.SIGTERM)


@pytest.mark.parametrize("where", ["last-step", "final-evaluation"])
@pytest.mark.slow  # takes seconds without starting a process
def test_a_signal_as_the_run_ends_lets_it_end_normally(tmp_path, clean, where):
    """A SIGTERM during the last step or the final evaluation ended a finished run with status 75 ("run again to
    continue"), and the requeued job found nothing to do (found by a probe): the run is complete and saved, so
    fit returns as usual, with no extra checkpoint."""
    logs = []

    class ListLogger:
        def info(self, msg):
            logs.append(msg)

        warning = info

    model, engine, loader, sched = _build()
    g = torch.Generator().manual_seed(1)
    test = torch.utils.data.DataLoader(TensorDataset(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)),
                                       batch_size=4)
    send = SendSignal(signal.SIGTERM, at=20) if where == "last-step" else SignalInFinalEvaluation()
    before = signal.getsignal(signal.SIGTERM)
    trainer = Trainer(engine, logger=ListLogger())
    trainer.fit(loader, epochs=2, test_dataloader=test, hooks=[LossHook(), SaveCheckpointHook("3ba", tmp_path / "ck"), send])
    assert trainer.cur_step == 10 and signal.getsignal(signal.SIGTERM) is before
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        "epoch0-step3", "epoch1-step10", "epoch1-step6", "epoch1-step9", "last", "metrics.jsonl"]
    assert ("SIGTERM received as the run ended: training is complete and its checkpoint written, so the run ends "
            "normally (exit status 0)") in logs


def test_a_second_ctrl_c_stops_at_once_and_the_handlers_are_put_back(tmp_path, clean):
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        _fit(tmp_path / "ck", extra=[SendSignal(signal.SIGINT, at=3, times=2)])
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["metrics.jsonl"]  # stopped before any checkpoint was due


def test_without_a_save_hook_signals_are_left_alone(clean):
    model, engine, loader, _ = _build()
    seen = []

    class Probe(BaseHook):
        def before_train(self, trainer):
            seen.append(signal.getsignal(signal.SIGTERM))

    Trainer(engine).fit(loader, epochs=1, hooks=[Probe()])
    assert seen == [signal.getsignal(signal.SIGTERM)]  # fit installed nothing: nowhere to write a checkpoint


# -- 2 ranks -----------------------------------------------------------------------------------
TWO_RANKS = COMMON + textwrap.dedent("""
    out = sys.argv[1]
    # torchrun --max-restarts keeps its store across restarts; launch_from_torch starts each attempt's
    # group on its own prefix of that store, so the restarted ranks meet again
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    colossal_lite.launch_from_torch(config=dict(gradient_accumulation=2), seed=5, verbose=False)
    rank = gpc.get_global_rank()
    CheckpointSession.check_s = 0.0  # agree on the stop flag at every step (the default is about once a second)

    class SignalRank1(BaseHook):
        def __init__(self, at):
            super().__init__()
            self.at = at

        def after_train_iter(self, trainer, *args):
            if trainer.state.stepped and trainer.cur_step == self.at and rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)

    def train(folder, at=None, resume=None):
        torch.manual_seed(1)
        model, engine, loader, sched = build(64, 2)  # 16 batches per rank, 8 steps per epoch
        hooks = [LossHook(), LRSchedulerHook(sched, by_epoch=False), SignalRank1(at), SaveCheckpointHook(1, folder)]
        trainer = Trainer(engine)
        trainer.fit(loader, epochs=2, hooks=hooks, resume_from=resume)
        loss = trainer.states["metrics"]["train"]["Loss"].get_accumulated_value()  # both ranks: a collective
        return dict(weights(model), train_loss_of_last_epoch=loss)

    if attempt == 0:  # the uninterrupted run, on the same 2 ranks
        reference = train(os.path.join(out, "reference"))
        if rank == 0:
            json.dump(reference, open(os.path.join(out, "reference.json"), "w"))
    try:
        final = train(os.path.join(out, "ck"), at=11 if attempt == 0 else None, resume="auto")
    except TrainingPreempted as e:
        open(os.path.join(out, f"preempted.rank{rank}"), "w").write(f"{e.code} {e.checkpoint}")
        if rank == 1:
            raise
        final = None  # rank 0 catches it and goes on: with several ranks the process still ends with 75
    if rank == 0 and final is not None:
        json.dump(final, open(os.path.join(out, "final.json"), "w"))
    gpc.destroy()
""")


def test_two_ranks_stop_together_when_one_is_signalled_and_torchrun_restarts_them_exactly(tmp_path):
    script = tmp_path / "two.py"
    script.write_text(TWO_RANKS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=1",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(script), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=_env(), cwd=REPO)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "exitcode: 75" in log  # the first attempt's workers left with the preemption status
    assert (tmp_path / "preempted.rank1").read_text() == f"75 {tmp_path / 'ck' / 'epoch1-step11'}"
    assert (tmp_path / "preempted.rank0").read_text() == f"75 {tmp_path / 'ck' / 'epoch1-step11'}"
    assert "SIGTERM: stopped at epoch 1, step 11 (batch 6 of the epoch)" in log  # rank 0 stopped at the same step
    folder = tmp_path / "ck" / "epoch1-step11"
    assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "rank0.pt", "rank1.pt", "save_times.json", "shared.pt"]
    assert f"resumed from {folder}: epoch 1, step 11, batch 6 of the epoch" in log
    final = json.loads((tmp_path / "final.json").read_text())
    reference = json.loads((tmp_path / "reference.json").read_text())
    assert final.keys() == reference.keys()
    # epoch 1 resumed at its 6th batch on each rank: its loss still covers all its batches on both ranks
    assert final.pop("train_loss_of_last_epoch") == pytest.approx(reference.pop("train_loss_of_last_epoch"), rel=1e-12)
    for name in reference:
        assert torch.equal(torch.tensor(final[name]), torch.tensor(reference[name])), name
    assert Path(tmp_path / "ck" / "last").read_text().strip() == "epoch1-step16"


SAVE_TWO_RANKS = COMMON + textwrap.dedent("""
    colossal_lite.launch_from_torch(config={}, seed=5, verbose=False)
    model, engine, loader, sched = build(64, 2)  # 16 batches per rank
    Trainer(engine).fit(loader, epochs=1, hooks=[LossHook(), SaveCheckpointHook("5ba", sys.argv[1])])
    gpc.destroy()
""")


def test_resuming_a_two_rank_checkpoint_on_one_rank_warns_that_the_epochs_train_metrics_start_there(tmp_path):
    from dist_helpers import run_ranks

    script = tmp_path / "save.py"
    script.write_text(SAVE_TWO_RANKS)
    run_ranks(script, [tmp_path / "ck"], timeout=90)
    mid = tmp_path / "ck" / "epoch0-step5"
    assert sorted(p.name for p in mid.iterdir()) == ["meta.json", "rank0.pt", "rank1.pt", "save_times.json", "shared.pt"]
    namespace = {}
    exec(compile(COMMON, "common", "exec"), namespace)
    gpc.destroy()
    colossal_lite.launch_from_torch(config={}, seed=5, verbose=False)
    try:
        model, engine, loader, sched = namespace["build"](64, 2)
        trainer = Trainer(engine)
        # 5 of 16 batches per rank on 2 ranks are 10 of one rank's 32: it goes on after batch 10 (it went on after
        # batch 5, training 5 batches' samples twice), 22 more steps
        with pytest.warns(UserWarning, match=r"written by 2 ranks and this run has 1: the train metrics of the "
                                             r"resumed epoch \(Loss\) count only its batches from batch 10 on"):
            trainer.fit(loader, epochs=1, hooks=[LossHook()], resume_from=mid)
        assert trainer.cur_step == 5 + 22
    finally:
        gpc.destroy()


def test_the_hard_exit_after_a_preemption_keeps_status_75_when_the_script_goes_on(tmp_path):
    """With several ranks ``raise_if_preempted`` arms the exit at the raise: a script that catches the preemption,
    cleans up and ends normally still leaves with 75, after its own exit handlers and flushed output."""
    script = tmp_path / "goes_on.py"
    script.write_text(textwrap.dedent("""
        import atexit
        from colossal_lite.trainer._checkpoint.preemption import exit_hard_at_interpreter_exit
        atexit.register(lambda: print("cleanup ran", flush=True))
        try:
            exit_hard_at_interpreter_exit(75)
            raise SystemExit(75)
        except SystemExit:
            print("caught; going on", end="")
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=_env(),
                          cwd=REPO)
    assert proc.returncode == 75, proc.stderr
    assert proc.stdout == "caught; going oncleanup ran\n"
