"""docs/trainer.md snippets of issue 23 run as written in a fresh process (stdout a pipe, as in a batch job)."""
import re

from dist_helpers import doc_python_blocks, run_python


def test_the_runs_eta_snippet_prints_it_until_the_last_epoch(tmp_path):
    script = tmp_path / "run_eta.py"
    script.write_text(doc_python_blocks("docs/trainer.md", "The run's ETA")[0])
    out = run_python(script, timeout=180, cwd=tmp_path).stdout
    for epoch in range(3):
        run_eta = r" \(run \d+:\d\d:\d\d\)" if epoch < 2 else ""
        assert re.search(rf"^\[Epoch {epoch} / Train\] 8/8 batches \(100%\), [0-9.]+ batch/s, ETA 0:00:00{run_eta} "
                         r"\| loss=[0-9.]+$", out, re.M), out


def test_the_writing_a_hook_snippet_runs_as_written(capsys):
    """Its ``GradNormReport`` stacks the norms with ``torch``: the block imports what it uses, so copied as written
    it reports instead of raising NameError at its first report."""
    import torch
    from torch import nn

    from colossal_lite.engine.accumulation import AccumulationWindow
    from colossal_lite.engine.engine import Engine
    from colossal_lite.logging import get_dist_logger
    from colossal_lite.trainer import Trainer

    block, = doc_python_blocks("docs/trainer.md", "Writing a hook")
    namespace = {"__name__": "trainer_md_writing_a_hook"}  # a fresh module's globals: only what the block imports
    exec(compile(block, "docs/trainer.md", "exec"), namespace)
    hook = namespace["GradNormReport"](get_dist_logger("grad_norm_report"), every_n_steps=2)
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                    window=AccumulationWindow(1))
    batches = [(torch.randn(4, 6), torch.randint(0, 3, (4,))) for _ in range(3)]
    Trainer(engine).fit(batches, epochs=1, hooks=[hook], log_dir=False)
    assert len(hook.norms) == 1  # the report after step 2 took the first two norms; step 3's waits for the next
    out = capsys.readouterr().out  # (the logger writes to the stdout of the moment)
    assert len(re.findall(r"grad_norm_report.* grad norm mean \d+\.\d{3}$", out, re.M)) == 1, out
