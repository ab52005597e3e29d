"""Two real processes (torchrun, gloo): metrics reduced across ranks equal one process; early stopping stops both."""
import json
import runpy
import sys
import textwrap

import pytest
from dist_helpers import run_ranks

SCRIPT = textwrap.dedent('''
    import contextlib, io, json, sys
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    import colossal_lite
    from colossal_lite.core import global_context as gpc
    from colossal_lite.nn.metric import Accuracy
    from colossal_lite.trainer import Trainer
    from colossal_lite.trainer.hooks import (AccuracyHook, BaseHook, EarlyStoppingHook, LogMetricByStepHook,
                                            LossHook)
    from colossal_lite.utils import get_dataloader

    out_dir, total_batch = sys.argv[1], int(sys.argv[2])
    colossal_lite.launch_from_torch(config=dict(), verbose=False) if len(sys.argv) > 3 else None
    rank, world = gpc.get_global_rank(), gpc.get_world_size()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g)
    train = TensorDataset(x[:64], y[:64])
    test = TensorDataset(x[64:], y[64:])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    per_rank = total_batch // world
    engine, train_loader, test_loader, _ = colossal_lite.initialize(
        model, opt, nn.CrossEntropyLoss(), get_dataloader(train, batch_size=per_rank),
        get_dataloader(test, batch_size=per_rank), verbose=False)

    record = {"train_loss": [], "test_loss": [], "test_acc": []}

    class Record(BaseHook):
        priority = 20
        def after_train_epoch(self, trainer):
            record["train_loss"].append(trainer.states["metrics"]["train"]["Loss"].get_accumulated_value())
        def after_test_epoch(self, trainer):
            record["test_loss"].append(trainer.states["metrics"]["test"]["Loss"].get_accumulated_value())
            record["test_acc"].append(trainer.states["metrics"]["test"]["Accuracy"].get_accumulated_value())

    # random labels: the test loss rises from the first epoch on, so the second evaluation brings no improvement
    hooks = [LossHook(), AccuracyHook(Accuracy()), LogMetricByStepHook(), Record(),
             EarlyStoppingHook("test/Loss", mode="min", patience=1)]
    trainer = Trainer(engine)
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        trainer.fit(train_loader, epochs=6, test_dataloader=test_loader, hooks=hooks, display_progress=True)
    record.update(cur_epoch=trainer.cur_epoch, cur_step=trainer.cur_step, stop_reason=trainer.state.stop_reason,
                  progress_lines=sum(line.startswith("[Epoch") for line in stdout.getvalue().splitlines()),
                  world=world)
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(record, f)
    gpc.destroy()
''')


def test_two_ranks_match_one_process_and_stop_together(tmp_path, monkeypatch):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    single_dir, dist_dir = tmp_path / "single", tmp_path / "dist"
    single_dir.mkdir()
    dist_dir.mkdir()
    monkeypatch.setattr(sys, "argv", [str(script), str(single_dir), "8"])
    runpy.run_path(str(script), run_name="__main__")  # the same script as one process, here (no torchrun)
    run_ranks(script, [dist_dir, 8, "launch"], nproc=2, timeout=120)
    single = json.loads((single_dir / "rank0.json").read_text())
    ranks = [json.loads((dist_dir / f"rank{r}.json").read_text()) for r in (0, 1)]

    assert single["world"] == 1 and ranks[0]["world"] == 2
    for key in ("train_loss", "test_loss", "test_acc", "cur_epoch", "cur_step", "stop_reason"):
        assert ranks[0][key] == ranks[1][key], key  # every rank reads the same reduced value
    assert ranks[0]["test_acc"] == single["test_acc"]
    assert ranks[0]["test_loss"] == pytest.approx(single["test_loss"], rel=1e-5)
    assert ranks[0]["train_loss"] == pytest.approx(single["train_loss"], rel=1e-5)
    # both ranks stopped after the second epoch (index 1), at the same step as one process
    assert ranks[0]["cur_epoch"] == single["cur_epoch"] == 2
    assert ranks[0]["cur_step"] == single["cur_step"] == 16
    assert ranks[0]["stop_reason"].startswith("EarlyStoppingHook: test/Loss did not improve by more than 0 for 1 checks")
    # progress lines only on rank 0
    assert ranks[0]["progress_lines"] > 0 and ranks[1]["progress_lines"] == 0
