"""Progress display (plain lines off a terminal, rich bar on one) and the no-sync-per-step invariant."""
import collections
import io
import os
import re
import sys
import time

import pytest
import torch
from torch import nn

from colossal_lite.engine.engine import Engine
from colossal_lite.nn.metric import Accuracy
from colossal_lite.trainer import Trainer, progress
from colossal_lite.trainer.hooks import AccuracyHook, LogMetricByStepHook, LossHook, LRSchedulerHook
from colossal_lite.trainer.progress import RichProgress


def make_batches(n, batch_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch_size, 6, generator=g), torch.randint(0, 3, (batch_size,), generator=g))
            for _ in range(n)]


def make_engine():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return Engine(model, opt, nn.CrossEntropyLoss())


def metric_hooks(engine):
    sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1000)
    return [LossHook(), AccuracyHook(Accuracy(), track_train=True), LRSchedulerHook(sched, by_epoch=False),
            LogMetricByStepHook()]


def test_plain_progress_lines_when_stdout_is_not_a_terminal(capsys, monkeypatch):
    monkeypatch.setattr(progress, "stdout_is_terminal", lambda: False)
    engine = make_engine()
    Trainer(engine).fit(make_batches(20), epochs=1, test_dataloader=make_batches(3), hooks=metric_hooks(engine),
                        display_progress=True)
    out = capsys.readouterr().out
    assert "\x1b[" not in out  # no terminal control codes
    train = [line for line in out.splitlines() if line.startswith("[Epoch 0 / Train]")]
    assert [re.match(r"\[Epoch 0 / Train\] (\d+)/20 ", line).group(1) for line in train] == [
        str(n) for n in range(2, 21, 2)]  # every tenth of the epoch
    assert re.fullmatch(r"\[Epoch 0 / Train\] 2/20 \(10%\), [0-9.]+ it/s, ETA \d+:\d\d:\d\d \| "
                        r"loss=[0-9.]+ accuracy=[0-9.]+ lr=0\.1", train[0]), train[0]
    test = [line for line in out.splitlines() if line.startswith("[Epoch 0 / Test]")]
    assert [line.split(",")[0] for line in test] == ["[Epoch 0 / Test] 1/3 (33%)", "[Epoch 0 / Test] 2/3 (67%)",
                                                     "[Epoch 0 / Test] 3/3 (100%)"]
    assert test[-1].endswith(tuple(f"accuracy={a}" for a in ("0", "0.25", "0.5", "0.75", "1")))


def test_no_progress_output_unless_asked(capsys):
    engine = make_engine()
    Trainer(engine).fit(make_batches(4), epochs=1, hooks=metric_hooks(engine))
    assert capsys.readouterr().out == ""


def test_rich_bar_on_a_terminal_shows_counts_rate_and_metrics(monkeypatch):
    from rich.console import Console

    buf = io.StringIO()
    monkeypatch.setattr(progress, "stdout_is_terminal", lambda: True)
    monkeypatch.setattr(RichProgress, "refresh_s", 0.0)

    original_init = RichProgress.__init__

    def init(self, description, total, states, console=None):
        original_init(self, description, total, states, console=Console(file=buf, force_terminal=True, width=160))

    monkeypatch.setattr(RichProgress, "__init__", init)
    engine = make_engine()
    Trainer(engine).fit(make_batches(3), epochs=1, hooks=metric_hooks(engine), display_progress=True)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buf.getvalue())
    assert re.search(r"\[Epoch 0 / Train\] \S+ 3/3 [0-9.]+ it/s ETA 0:00:00 loss=[0-9.]+ accuracy=[0-9.]+ lr=0\.1",
                     text), text


SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "__format__")


def count_syncs(run):
    """Calls of host-reading Tensor methods made directly from colossal_lite code while ``run()`` runs."""
    counts = collections.Counter()
    marker = os.sep + "colossal_lite" + os.sep
    originals = {name: torch.Tensor.__dict__.get(name) for name in SYNC_METHODS}

    def wrap(name, original):
        def wrapper(self, *args, **kwargs):
            frame = sys._getframe(1)
            if marker in frame.f_code.co_filename:
                counts[name, os.path.basename(frame.f_code.co_filename), frame.f_lineno] += 1
            return original(self, *args, **kwargs)

        return wrapper

    for name in SYNC_METHODS:
        setattr(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name)))
    try:
        run()
    finally:
        for name, original in originals.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)
    return counts


@pytest.mark.parametrize("terminal", [False, True])
def test_no_host_device_sync_per_step(monkeypatch, capsys, terminal):
    from rich.console import Console

    monkeypatch.setattr(progress, "stdout_is_terminal", lambda: terminal)
    monkeypatch.setattr(RichProgress, "refresh_s", 1e9)  # the bar draws only when an epoch closes
    original_init = RichProgress.__init__
    monkeypatch.setattr(RichProgress, "__init__", lambda self, d, t, s, console=None: original_init(
        self, d, t, s, console=Console(file=io.StringIO(), force_terminal=True)))

    def fit(num_batches):
        def run():
            engine = make_engine()
            Trainer(engine).fit(make_batches(num_batches), epochs=2, test_dataloader=make_batches(5),
                                hooks=metric_hooks(engine), display_progress=True)
        return run

    short = count_syncs(fit(10))
    long = count_syncs(fit(60))
    capsys.readouterr()
    # only the display reads the device, and the non-finite-loss check once per epoch and at the end of fit:
    # the same count for 20 and for 120 training steps
    assert sum(long.values()) == sum(short.values()), (short, long)
    guard_reads = {key: n for key, n in long.items() if key[1] == "loss_guard.py"}
    assert sum(guard_reads.values()) == 3, guard_reads
    assert all(key[1] == os.path.basename(progress.__file__) for key in long if key not in guard_reads), long
    assert sum(long.values()) > 0  # the counter does see the reads the display makes


def test_display_is_updated_rarely_and_still_prints_on_time(monkeypatch):
    """``update`` runs only when a line or redraw is due: ten times in 20,000 fast iterations (one per line);
    slow iterations still get their time-based lines (an unsized loader has only those)."""
    out = io.StringIO()
    fast = progress.PlainProgress("[fast]", 20_000, {}, stream=out)
    calls = 0
    original = fast.update

    def counting_update(n):
        nonlocal calls
        calls += 1
        original(n)

    fast.update = counting_update
    for _ in range(20_000):
        fast.advance()
    fast.close()
    assert calls == 10, calls
    assert [line.split(" ")[1] for line in out.getvalue().splitlines()] == [f"{n}/20000" for n in
                                                                           range(2000, 20_001, 2000)]

    monkeypatch.setattr(progress.PlainProgress, "every_s", 0.05)
    out = io.StringIO()
    slow = progress.PlainProgress("[slow]", None, {}, stream=out)  # no total: lines by time alone
    start = time.monotonic()
    while time.monotonic() - start < 1.0:
        time.sleep(0.005)
        slow.advance()
    lines = out.getvalue().splitlines()
    assert 8 <= len(lines) <= 25, lines  # about one per 0.05 s, checked often enough
