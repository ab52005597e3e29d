"""ProfilerHook: real fits under torch.profiler; the trace of the active optimizer steps only, one file per rank and
cycle (a Chrome trace TensorBoard's plugin reads), short and failed runs, two gloo ranks, bad arguments."""
import json
import logging
import re
import textwrap

import pytest
import torch
from dist_helpers import doc_python_blocks, run_python, run_ranks
from hook_helpers import sigterm_at
from torch import nn
from torch.utils.data import TensorDataset

from colossal_lite.engine.accumulation import AccumulationWindow
from colossal_lite.engine.engine import Engine
from colossal_lite.registry import HOOKS
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import BaseHook, LossHook, ProfilerHook, SaveCheckpointHook
from colossal_lite.utils import get_dataloader


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def make_logger():
    logger = logging.getLogger(f"profiler-test-{id(object())}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    lines = Lines()
    logger.addHandler(lines)
    return logger, lines.lines


def build(accumulation=1, n=24):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                    window=AccumulationWindow(accumulation))
    return engine, get_dataloader(data, batch_size=4)  # 6 batches an epoch


def events(path):
    trace = json.loads(path.read_text())
    assert "traceEvents" in trace
    return [e for e in trace["traceEvents"] if isinstance(e, dict) and "name" in e]


def step_marks(path):
    return sorted(int(m.group(1)) for e in events(path) for m in [re.fullmatch(r"ProfilerStep#(\d+)", e["name"])] if m)


def count(path, name):
    return sum(e["name"] == name and e.get("ph") == "X" for e in events(path))


def test_the_active_steps_are_traced_once_for_tensorboard_and_chrome(tmp_path):
    engine, loader = build()
    logger, lines = make_logger()
    hook = ProfilerHook(wait=1, warmup=1, active=3, dir=tmp_path / "prof", logger=logger)
    Trainer(engine).fit(loader, epochs=2, hooks=[hook, LossHook()])
    trace = tmp_path / "prof" / "rank0.steps3-5.pt.trace.json"
    assert sorted(p.name for p in (tmp_path / "prof").iterdir()) == [trace.name]  # one file serves both viewers
    assert hook.trace_files == [trace]
    assert step_marks(trace) == [3, 4, 5]
    assert count(trace, "Optimizer.step#SGD.step") == 3
    assert count(trace, "aten::linear") == 3 * 2
    assert lines == [f"ProfilerHook: trace of steps 3-5 written to {trace}"]
    assert not torch._C._autograd._profiler_enabled()


def test_the_schedule_counts_optimizer_steps_not_micro_batches(tmp_path):
    engine, loader = build(accumulation=2)  # 3 optimizer steps an epoch, 2 micro-batches each
    hook = ProfilerHook(wait=0, warmup=1, active=2, dir=tmp_path, skip_first=1)
    Trainer(engine).fit(loader, epochs=2, hooks=[hook])
    (trace,) = hook.trace_files
    assert trace.name == "rank0.steps3-4.pt.trace.json"
    assert step_marks(trace) == [3, 4]
    assert count(trace, "Optimizer.step#SGD.step") == 2
    assert count(trace, "aten::linear") == 2 * 2 * 2  # steps x micro-batches x layers


def test_repeated_cycles_write_one_trace_each(tmp_path):
    engine, loader = build()
    logger, lines = make_logger()
    hook = ProfilerHook(wait=1, warmup=1, active=2, dir=tmp_path, repeat=0, print_summary=True, logger=logger)
    Trainer(engine).fit(loader, epochs=2, hooks=[hook])  # 12 steps: cycles of 4
    assert [p.name for p in hook.trace_files] == [f"rank0.steps{a}-{a + 1}.pt.trace.json" for a in (3, 7, 11)]
    for path, first in zip(hook.trace_files, (3, 7, 11)):
        assert step_marks(path) == [first, first + 1]
    summaries = [line for line in lines if line.startswith("ProfilerHook: the costliest operators of steps ")]
    assert len(summaries) == 3 and len(lines) == 6
    rows = [row for row in summaries[0].splitlines() if row.strip().startswith(("aten::", "Optimizer.", "Profiler"))]
    assert 3 <= len(rows) <= 10 and "Self CPU" in summaries[0]


def test_a_run_that_ends_inside_the_active_steps_writes_what_it_recorded(tmp_path):
    engine, loader = build()
    logger, lines = make_logger()
    hook = ProfilerHook(wait=1, warmup=1, active=3, dir=tmp_path, logger=logger)
    Trainer(engine).fit(loader, max_steps=4, hooks=[hook])
    (trace,) = hook.trace_files
    assert trace.name == "rank0.steps3-4.pt.trace.json"
    assert step_marks(trace) == [3, 4]
    assert lines == [f"ProfilerHook: trace of steps 3-4 (the fit ended inside the profiled steps 3-5) written to {trace}"]


def test_a_run_too_short_to_record_writes_nothing_and_says_so(tmp_path):
    engine, loader = build()
    logger, lines = make_logger()
    hook = ProfilerHook(wait=1, warmup=1, active=3, dir=tmp_path / "p", logger=logger)
    Trainer(engine).fit(loader, max_steps=2, hooks=[hook])
    assert hook.trace_files == [] and list((tmp_path / "p").iterdir()) == []
    assert lines == ["ProfilerHook: no trace written: this fit ran 2 optimizer step(s), and the first recorded step "
                     "would have been step 3 (skip_first=0, wait=1, warmup=1 steps come first)"]
    assert not torch._C._autograd._profiler_enabled()


def test_a_resumed_fit_counts_its_own_steps_and_names_the_trainers(tmp_path):
    engine, loader = build()
    trainer = Trainer(engine)
    trainer.fit(loader, max_steps=4)
    hook = ProfilerHook(wait=1, warmup=1, active=2, dir=tmp_path)
    trainer.fit(loader, max_steps=12, hooks=[hook])  # continues at step 5
    (trace,) = hook.trace_files
    assert trace.name == "rank0.steps7-8.pt.trace.json"
    assert step_marks(trace) == [7, 8]


class FailAt(BaseHook):
    def __init__(self, step):
        super().__init__(priority=0)
        self.step = step

    def before_train_iter(self, trainer):
        if trainer.state.step == self.step:
            raise RuntimeError("boom")


def test_a_fit_that_raises_stops_the_profiler_and_writes_what_it_recorded_and_the_hook_runs_again(tmp_path):
    """A fit that raises does not reach after_train: the profiler stops as the hooks are detached (it ran on until
    close(), a with block's end or the hook's next fit)."""
    engine, loader = build()
    hook = ProfilerHook(wait=1, warmup=1, active=3, dir=tmp_path / "a")
    with pytest.raises(RuntimeError, match="boom"):
        Trainer(engine).fit(loader, epochs=1, hooks=[hook, FailAt(4)])
    assert not torch._C._autograd._profiler_enabled()
    assert [p.name for p in hook.trace_files] == ["rank0.steps3-4.pt.trace.json"]

    hook = ProfilerHook(wait=0, warmup=1, active=1, dir=tmp_path / "b")
    with pytest.raises(RuntimeError, match="boom"):
        Trainer(engine).fit(loader, epochs=1, hooks=[hook, FailAt(1)])  # raised as step 2's recording began
    assert not torch._C._autograd._profiler_enabled() and hook.trace_files == []  # (no step was recorded)
    engine2, loader2 = build()
    Trainer(engine2).fit(loader2, epochs=1, hooks=[hook])  # the hook runs again
    assert [p.name for p in hook.trace_files] == ["rank0.steps2-2.pt.trace.json"]
    assert step_marks(hook.trace_files[0]) == [2]
    assert not torch._C._autograd._profiler_enabled()


def test_a_preempted_fit_writes_the_steps_it_recorded(tmp_path):
    engine, loader = build()
    hook = ProfilerHook(wait=1, warmup=1, active=3, dir=tmp_path / "p")
    with pytest.raises(SystemExit) as stopped:
        Trainer(engine).fit(loader, epochs=2, hooks=[hook, sigterm_at(4), SaveCheckpointHook(100, tmp_path / "ck")])
    assert stopped.value.code == 75
    assert [p.name for p in hook.trace_files] == ["rank0.steps3-4.pt.trace.json"]
    assert step_marks(hook.trace_files[0])[:2] == [3, 4]
    assert not torch._C._autograd._profiler_enabled()


@pytest.mark.parametrize("kwargs, message", [
    (dict(dir=None), r"ProfilerHook\(dir=None\): give the folder the traces are written to"),
    (dict(wait=-1), r"ProfilerHook\(wait=-1\) must be a whole number of optimizer steps >= 0"),
    (dict(warmup=1.5), r"ProfilerHook\(warmup=1.5\) must be a whole number of optimizer steps >= 0"),
    (dict(active=0), r"ProfilerHook\(active=0\) must be a whole number of optimizer steps >= 1"),
    (dict(skip_first=-2), r"ProfilerHook\(skip_first=-2\) must be"),
    (dict(repeat=-1), r"ProfilerHook\(repeat=-1\) must be"),
    (dict(ranks=()), r"ProfilerHook\(ranks=\(\)\) must name at least one global rank"),
    (dict(ranks=[-1]), r"ProfilerHook\(ranks=\(-1,\)\) must name at least one global rank"),
])
def test_bad_arguments_are_refused_naming_the_argument(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ProfilerHook(**{"dir": tmp_path, **kwargs})


def test_a_file_as_dir_and_a_rank_outside_the_run_are_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match=r"ProfilerHook\(dir=.*f'\) is a file; give a folder"):
        ProfilerHook(dir=str(tmp_path / "f"))
    engine, loader = build()
    with pytest.raises(ValueError, match=r"ProfilerHook\(ranks=\(1,\)\) names rank 1, but this run has 1 rank"):
        Trainer(engine).fit(loader, epochs=1, hooks=[ProfilerHook(dir=tmp_path, ranks=[1])])


def test_registered_for_configs(tmp_path):
    assert HOOKS.get_module("ProfilerHook") is ProfilerHook


SCRIPT = textwrap.dedent('''
    import sys
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    import colossal_lite
    from colossal_lite.core import global_context as gpc
    from colossal_lite.trainer import Trainer
    from colossal_lite.trainer.hooks import LossHook, ProfilerHook
    from colossal_lite.utils import get_dataloader

    out = sys.argv[1]
    colossal_lite.launch_from_torch(config=dict(), verbose=False)
    rank = gpc.get_global_rank()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(48, 6, generator=g), torch.randint(0, 3, (48,), generator=g))
    for name, ranks in (("default", (0,)), ("every", None)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                        nn.CrossEntropyLoss(), get_dataloader(data, batch_size=4),
                                                        verbose=False)
        hook = ProfilerHook(wait=1, warmup=1, active=2, dir=f"{out}/{name}", ranks=ranks)
        Trainer(engine).fit(loader, epochs=1, hooks=[hook, LossHook()])
        print(f"rank {rank} {name} wrote {[p.name for p in hook.trace_files]}" + "\\n", end="", flush=True)
    gpc.destroy()
''')


def test_two_ranks_rank_0_writes_by_default_and_every_rank_with_ranks_none(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    proc = run_ranks(script, [tmp_path], nproc=2, timeout=180)
    out = proc.stdout + proc.stderr
    assert sorted(p.name for p in (tmp_path / "default").iterdir()) == ["rank0.steps3-4.pt.trace.json"]
    assert sorted(p.name for p in (tmp_path / "every").iterdir()) == \
        ["rank0.steps3-4.pt.trace.json", "rank1.steps3-4.pt.trace.json"]
    assert "rank 1 default wrote []" in out and "rank 1 every wrote ['rank1.steps3-4.pt.trace.json']" in out
    for rank in (0, 1):
        trace = tmp_path / "every" / f"rank{rank}.steps3-4.pt.trace.json"
        assert step_marks(trace) == [3, 4]
        assert count(trace, "Optimizer.step#SGD.step") == 2
    said = [line for line in out.splitlines() if "ProfilerHook:" in line]
    assert len(said) == 2 and not any("[rank 1]" in line for line in said), said  # rank 0 speaks
    assert "every profiled rank writes its rank<R>.steps3-4.pt.trace.json there" in said[1]


def test_the_docs_snippet_runs(tmp_path):
    (snippet,) = doc_python_blocks("docs/profiling.md")
    (tmp_path / "snippet.py").write_text(snippet)
    proc = run_python(tmp_path / "snippet.py", cwd=tmp_path, timeout=120)
    assert "traces ['rank0.steps3-5.pt.trace.json'] steps [3, 4, 5]" in proc.stdout, \
        proc.stdout[-2000:] + proc.stderr[-2000:]
