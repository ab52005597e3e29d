"""Progress display (plain lines off a terminal, rich bar on one) and the no-sync-per-step invariant."""
import collections
import io
import os
import re
import sys
import time

import pytest
import torch
from dist_helpers import run_python
from torch import nn

from colossal_lite.engine.accumulation import AccumulationWindow
from colossal_lite.engine.engine import Engine
from colossal_lite.nn.metric import Accuracy
from colossal_lite.trainer import Trainer, progress
from colossal_lite.trainer.hooks import AccuracyHook, LogMetricByStepHook, LossHook, LRSchedulerHook
from colossal_lite.trainer.progress import RichProgress


def make_batches(n, batch_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch_size, 6, generator=g), torch.randint(0, 3, (batch_size,), generator=g))
            for _ in range(n)]


def make_engine(accumulation=1):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return Engine(model, opt, nn.CrossEntropyLoss(), window=AccumulationWindow(accumulation))


def metric_hooks(engine):
    sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1000)
    return [LossHook(), AccuracyHook(Accuracy(), track_train=True), LRSchedulerHook(sched, by_epoch=False),
            LogMetricByStepHook()]


def test_plain_progress_lines_when_stdout_is_not_a_terminal(capsys, monkeypatch):
    monkeypatch.setattr(progress, "stdout_is_terminal", lambda: False)
    monkeypatch.setattr(progress.PlainProgress, "min_gap_s", 0.0)  # a line at every tenth, however fast
    engine = make_engine()
    history = Trainer(engine).fit(make_batches(20), epochs=1, test_dataloader=make_batches(3, batch_size=5, seed=3),
                                  hooks=metric_hooks(engine), display_progress=True)
    out = capsys.readouterr().out
    assert "\x1b[" not in out  # no terminal control codes
    train = [line for line in out.splitlines() if line.startswith("[Epoch 0 / Train]")]
    assert [re.match(r"\[Epoch 0 / Train\] (\d+)/20 batches ", line).group(1) for line in train] == [
        str(n) for n in range(2, 21, 2)]  # every tenth of the epoch
    assert re.fullmatch(r"\[Epoch 0 / Train\] 2/20 batches \(10%\), [0-9.]+ batch/s, ETA \d+:\d\d:\d\d \| "
                        r"loss=[0-9.]+ accuracy=[0-9.]+ lr=0\.1", train[0]), train[0]
    test = [line for line in out.splitlines() if line.startswith("[Epoch 0 / Test]")]
    assert [line.split(",")[0] for line in test] == ["[Epoch 0 / Test] 1/3 batches (33%)",
                                                     "[Epoch 0 / Test] 2/3 batches (67%)",
                                                     "[Epoch 0 / Test] 3/3 batches (100%)"]
    # the test line shows the accuracy of the batches evaluated so far: at the end, the epoch's (the log line's)
    test_accuracy = history.series("test/Accuracy")[-1][1]
    assert test[-1].endswith(f"accuracy={progress.format_number(test_accuracy)}"), (test[-1], test_accuracy)
    assert round(test_accuracy * 15) % 3  # (a last batch of 5 could not show it)


REAL_RUN = """
import sys, time
import torch
from torch import nn
import colossal_lite
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import LossHook, LogMetricByStepHook

colossal_lite.launch_from_torch(config=dict(gradient_accumulation=2), verbose=False)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
g = torch.Generator().manual_seed(0)
batches = [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(100)]
engine, train, test, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                  nn.CrossEntropyLoss(), batches, batches[:3])
trainer = Trainer(engine)
start = time.monotonic()
trainer.fit(train, epochs=3, test_dataloader=test, hooks=[LossHook(), LogMetricByStepHook()], display_progress=True)
print(f"done: {trainer.cur_step} optimizer steps in {time.monotonic() - start:.3f} s")
"""


def test_plain_progress_of_a_real_run_into_a_pipe_is_one_line_per_short_epoch(tmp_path):
    """A few seconds of training into a pipe (as ``script.py > log.txt``): each epoch prints its last line,
    and no more than one line per ``min_gap_s`` besides; the count says it counts batches, not steps."""
    script = tmp_path / "run.py"
    script.write_text(REAL_RUN)
    out = run_python(script, timeout=120).stdout
    done = re.search(r"^done: (\d+) optimizer steps in ([0-9.]+) s$", out, re.M)
    assert done and done.group(1) == "150", out  # 3 epochs of 100 batches, 2 batches per optimizer step
    extra = int(float(done.group(2)) // progress.PlainProgress.min_gap_s)  # 0 unless this machine crawled
    train = [line for line in out.splitlines() if "/ Train]" in line]
    test = [line for line in out.splitlines() if "/ Test]" in line]
    assert 3 <= len(train) <= 3 + extra and 3 <= len(test) <= 3 + extra, out
    for epoch in range(3):
        run_eta = r" \(run \d+:\d\d:\d\d\)" if epoch < 2 else ""  # the run's ETA while it goes on past the epoch
        assert re.search(rf"^\[Epoch {epoch} / Train\] 100/100 batches \(100%\), [0-9.]+ batch/s, ETA 0:00:00"
                         rf"{run_eta} \| loss=[0-9.]+$", out, re.M), out
        assert re.search(rf"^\[Epoch {epoch} / Test\] 3/3 batches \(100%\), ", out, re.M), out


def test_plain_line_shows_the_runs_eta_next_to_the_epochs():
    """The run's ETA: the optimizer steps left in the run (``total_steps - step``), in batches, at the epoch's
    rate; shown while the run goes on past this epoch, not in its last epoch (where it is the epoch's)."""
    from colossal_lite.trainer.state import State

    st = State()
    st.total_steps, st.steps_per_epoch, st.iters_per_epoch = 15, 5, 10  # 3 epochs, 2 batches per step
    lines = []
    for epoch, step in ((1, 7), (2, 12)):
        st.epoch, st.step = epoch, step
        stream = io.StringIO()
        display = progress.PlainProgress(f"[Epoch {epoch} / Train]", 10, {}, stream=stream, run=st)
        display.start -= 10.0  # 5 batches in 10 s: 0.5 batch/s
        display.close(5)
        lines.append(stream.getvalue())
    # epoch: 5 batches left / 0.5 = 10 s; run: (15 - 7) steps * 2 batches / 0.5 = 32 s
    assert lines[0] == "[Epoch 1 / Train] 5/10 batches (50%), 0.50 batch/s, ETA 0:00:10 (run 0:00:32)\n"
    assert lines[1] == "[Epoch 2 / Train] 5/10 batches (50%), 0.50 batch/s, ETA 0:00:10\n"


def test_rich_bar_shows_the_runs_eta_and_drops_it_before_the_epochs():
    from rich.console import Console

    from colossal_lite.trainer.state import State

    st = State()
    st.total_steps, st.steps_per_epoch, st.iters_per_epoch, st.epoch, st.step = 15, 5, 10, 1, 7
    for width, expected in ((100, "ETA 0:00:10 (run 0:00:32)"), (54, "ETA 0:00:10")):
        buf = io.StringIO()
        display = RichProgress("[Epoch 1 / Train]", 10, {}, console=Console(file=buf, force_terminal=True,
                                                                            width=width), run=st)
        display.start -= 10.0
        display.close(5)
        last = frames(buf.getvalue())[-1]
        assert last.endswith(expected) and len(last) <= width, (width, last)


def test_plain_lines_come_at_tenths_no_closer_than_min_gap(monkeypatch):
    """Iterations of at least 10 ms: 50 iterations take at least 0.5 s and a tenth (5) at least 50 ms.
    A gap below a tenth's time prints every tenth; a gap of 120 ms prints fewer, each at a tenth."""
    class TimedStream(io.StringIO):
        def __init__(self):
            super().__init__()
            self.times = []

        def write(self, text):
            if text.strip():
                self.times.append(time.monotonic())
            return super().write(text)

    def run(min_gap):
        monkeypatch.setattr(progress.PlainProgress, "min_gap_s", min_gap)
        stream = TimedStream()
        display = progress.PlainProgress("[Epoch 0 / Train]", 50, {}, stream=stream)
        for _ in range(50):
            time.sleep(0.01)
            display.advance()
        display.close()
        counts = [int(re.match(r"\[Epoch 0 / Train\] (\d+)/50 batches ", line).group(1))
                  for line in stream.getvalue().splitlines()]
        return counts, stream.times, time.monotonic() - display.start

    counts, _, _ = run(0.045)
    assert counts == list(range(5, 51, 5))
    counts, times, elapsed = run(0.12)
    assert counts[-1] == 50 and all(n % 5 == 0 for n in counts), counts
    assert len(counts) - 1 <= elapsed / 0.12, (counts, elapsed)
    gaps = [b - a for a, b in zip(times[:-2], times[1:-1])]  # between the lines before the epoch's last one
    assert all(gap >= 0.12 - 0.005 for gap in gaps), gaps


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
    assert re.search(r"\[Epoch 0 / Train\] \S+ 3/3 batches [0-9.]+ batch/s ETA 0:00:00 loss=[0-9.]+ "
                     r"accuracy=[0-9.]+ lr=0\.1", text), text


def frames(raw: str):
    """The lines a terminal showed: rich redraws its line after a carriage return (and clears it)."""
    return [f for f in re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw)) if f]


@pytest.mark.parametrize("width", [60, 80, 120])
@pytest.mark.parametrize("total", [1234, None])
def test_rich_bar_fits_the_console_width(width, total):
    """A real rich Console of ``width`` columns: every frame fits, and keeps the count and a bar; the metrics
    are shortened, then dropped from the last one, before the count or the bar would be."""
    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=width, record=True)
    step_metrics = {"loss": torch.tensor(0.93705), "accuracy": torch.tensor(0.95703), "lr": 0.05,
                    "throughput": torch.tensor(43497.2)}
    display = RichProgress("[Epoch 12 / Train]", total, {"step_metrics": step_metrics}, console=console)
    display.update(567)
    display.close(1234)
    shown = frames(buf.getvalue())
    assert len(shown) >= 2, shown
    for line in shown:
        assert len(line) <= width, (width, line)
        assert re.search(r" [━╸╺]{10,}", line), line  # a bar of 10 cells or more
    last = shown[-1]
    assert re.search(r"\[Epoch 12 / Train\] ━+ +1234(/1234)? batches", last), last
    if total:
        assert "ETA 0:00:00" in last, last  # the last text to go
    if width >= 80:
        assert "loss=0.937" in last, last  # the first metric is the last one dropped
    if width >= 120:
        assert "acc=0.957 lr=0.05 tput=43497" in last, last
    assert console.export_text().count("batches") >= 2  # the record holds the same frames


def run_on_a_terminal(script, columns: int, timeout: float = 120) -> str:
    """Run ``python script`` with its stdout and stderr on a real pseudo-terminal ``columns`` wide; its output."""
    import fcntl
    import pty
    import select
    import struct
    import subprocess
    import termios

    from dist_helpers import _env

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = _env({"TERM": "xterm-256color"})
    env.pop("COLUMNS", None)  # rich would take the width from it instead of the terminal
    proc = subprocess.Popen([sys.executable, str(script)], stdin=slave, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 1.0)[0]:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the process closed its end of the terminal
                    break
                if not data:
                    break
                chunks.append(data)
        assert proc.wait(timeout=max(deadline - time.monotonic(), 1)) == 0, b"".join(chunks).decode()
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return b"".join(chunks).decode("utf-8", "replace")


@pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pseudo-terminal")
def test_rich_bar_of_a_real_run_on_an_80_column_terminal(tmp_path):
    """The same real run (gradient_accumulation=2) on a real 80-column terminal: every frame fits, and shows
    the bar and the count of batches (100 per epoch, 50 optimizer steps)."""
    script = tmp_path / "run.py"
    script.write_text(REAL_RUN)
    out = run_on_a_terminal(script, 80)
    assert "done: 150 optimizer steps" in out, out
    shown = [line for line in frames(out) if " / Train]" in line or " / Test]" in line]
    assert shown, out
    for line in shown:
        assert len(line) <= 80 and re.search(r"[━╸╺]{10,}", line), line
    for epoch in range(3):
        assert any(re.match(rf"\[Epoch {epoch} / Train\] [━╸╺]+ +100/100 batches (.* )?ETA 0:00:00 loss=", line)
                   for line in shown), shown


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
    # only the display, the epoch values of the metrics, the history's read of the per-step values and the
    # non-finite-loss check read the device, each once per epoch or evaluation (the checks at the end of fit have
    # nothing new to read): the same count for 20 and for 120 training steps
    assert sum(long.values()) == sum(short.values()), (short, long)
    per_epoch = {"loss_guard.py": 2, "_series.py": 2}  # two epochs
    for file, n in per_epoch.items():
        assert sum(count for key, count in long.items() if key[1] == file) == n, (file, long)
    allowed = set(per_epoch) | {os.path.basename(progress.__file__), "_metric_hook.py"}
    assert all(key[1] in allowed for key in long), long
    assert sum(long.values()) > 0  # the counter does see the reads the display makes


@pytest.mark.parametrize("min_gap, lines", [(0.0, range(2000, 20_001, 2000)), (10.0, [20_000])])
def test_display_is_updated_rarely_and_still_prints_on_time(monkeypatch, min_gap, lines):
    """``update`` runs only when a line or redraw may be due: ten times in 20,000 fast iterations (once per
    tenth), whether the tenth prints (no minimum gap) or not (the default: a fast epoch prints its last line);
    slow iterations still get their time-based lines (an unsized loader has only those)."""
    monkeypatch.setattr(progress.PlainProgress, "min_gap_s", min_gap)
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
    assert [line.split(" ")[1] for line in out.getvalue().splitlines()] == [f"{n}/20000" for n in lines]

    monkeypatch.setattr(progress.PlainProgress, "every_s", 0.05)
    out = io.StringIO()
    slow = progress.PlainProgress("[slow]", None, {}, stream=out)  # no total: lines by time alone
    start = time.monotonic()
    while time.monotonic() - start < 1.0:
        time.sleep(0.005)
        slow.advance()
    lines = out.getvalue().splitlines()
    assert 8 <= len(lines) <= 25, lines  # about one per 0.05 s, checked often enough
