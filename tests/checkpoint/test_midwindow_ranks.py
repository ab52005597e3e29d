"""A checkpoint taken inside an accumulation window on 2 ranks (DDP, ZeRO stage 1) resumes exactly.

Inside a window each rank gathers its own gradients (under no_sync, reduced at the window's end): each rank's file
keeps its own, and every rank resumes the window with them. The legacy single file, which rank 0 alone writes,
refuses such a save; a trainer checkpoint taken inside a window on 2 ranks is refused on 1.
"""
from __future__ import annotations

import json
import textwrap

import pytest
import torch
from dist_helpers import run_ranks

import colossal_lite
from colossal_lite.checkpoint.io import CheckpointError
from colossal_lite.core import global_context as gpc

SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch
    from torch import nn
    import colossal_lite
    from colossal_lite.core import global_context as gpc
    from colossal_lite.trainer import Trainer
    from colossal_lite.trainer.hooks import BaseHook, LossHook, SaveCheckpointHook
    from colossal_lite.utils import get_dataloader
    from colossal_lite.utils.checkpointing import save_checkpoint

    out = Path(sys.argv[1])
    colossal_lite.launch_from_torch(config={}, seed=3, verbose=False)
    rank = gpc.get_global_rank()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)

    def run(stage, folder, cut=False, resume=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))  # BN: buffers
        config = dict(gradient_accumulation=3, **({"zero": dict(stage=stage)} if stage else {}))
        engine, loader, _, _ = colossal_lite.initialize(
            model, torch.optim.Adam(model.parameters(), lr=0.01), nn.CrossEntropyLoss(),
            get_dataloader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=True), verbose=False,
            config=config)
        saver = SaveCheckpointHook(100, folder)
        refused = []

        class Cut(BaseHook):
            def after_train_iter(self, trainer, *args):
                if cut and trainer.state.iteration == 5:  # 2nd micro-batch of the 2nd window
                    assert not trainer.engine.window.at_start
                    try:  # the legacy single file (rank 0's alone) cannot keep every rank's gradients
                        save_checkpoint(out / f"legacy{stage}.pt", 0, model, engine.optimizer)
                    except RuntimeError as e:
                        refused.append(str(e))
                    saver.save(trainer)
                    trainer.state.stop_training = True

        Trainer(engine).fit(loader, epochs=2, hooks=[LossHook(), Cut(), saver], resume_from=resume)
        if cut:
            (out / f"refused{stage}.rank{rank}").write_text(json.dumps(refused))
        return {k: v.detach().clone() for k, v in engine.unwrapped_model.state_dict().items()}

    for stage in (0, 1):
        full = run(stage, out / f"full{stage}")
        run(stage, out / f"ck{stage}", cut=True)
        resumed = run(stage, out / f"ck{stage}", resume="last")
        torch.save(dict(full=full, resumed=resumed), out / f"result{stage}.rank{rank}.pt")
    gpc.destroy()
""")


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("midwindow")
    script = out / "midwindow.py"
    script.write_text(SCRIPT)
    run_ranks(script, [out], nproc=2, timeout=240)
    return out


@pytest.mark.parametrize("stage", [0, 1], ids=["ddp", "zero1"])
def test_a_checkpoint_inside_a_window_on_two_ranks_resumes_exactly(two_rank_runs, stage):
    out = two_rank_runs
    for rank in (0, 1):
        result = torch.load(out / f"result{stage}.rank{rank}.pt", weights_only=True)
        assert result["full"].keys() == result["resumed"].keys()
        assert any("running_mean" in name for name in result["full"])  # buffers are compared too
        for name, want in result["full"].items():
            assert torch.equal(result["resumed"][name], want), f"rank {rank}: {name}"
    ck = out / f"ck{stage}" / "epoch0-step1"  # the save inside the 2nd window
    shared = torch.load(ck / "shared.pt", weights_only=True)
    assert "window_grads" not in shared["engine"]  # each rank's own are in its file
    grads = [torch.load(ck / f"rank{r}.pt", weights_only=True)["engine"]["window_grads"] for r in (0, 1)]
    assert not all(torch.equal(a, b) for a, b in zip(*grads))  # gathered alone: they differ between the ranks


@pytest.mark.parametrize("stage", [0, 1], ids=["ddp", "zero1"])
def test_the_legacy_file_refuses_a_save_inside_a_window_on_two_ranks(two_rank_runs, stage):
    for rank in (0, 1):
        refused = json.loads((two_rank_runs / f"refused{stage}.rank{rank}").read_text())
        assert len(refused) == 1 and "save at a window's end" in refused[0], refused
    assert not (two_rank_runs / f"legacy{stage}.pt").exists()


@pytest.mark.filterwarnings("ignore:checkpoint .* was written by 2 rank")
def test_a_checkpoint_inside_a_window_on_two_ranks_is_refused_on_one(two_rank_runs):
    from torch import nn

    from colossal_lite.trainer import Trainer
    from colossal_lite.utils import get_dataloader

    ck = two_rank_runs / "ck0" / "epoch0-step1"  # the save inside the 2nd window
    gpc.destroy()
    try:
        model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
        data = torch.utils.data.TensorDataset(torch.randn(64, 6), torch.randint(0, 3, (64,)))
        engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.Adam(model.parameters()),
                                                        nn.CrossEntropyLoss(), get_dataloader(data, batch_size=4),
                                                        verbose=False, config=dict(gradient_accumulation=3))
        with pytest.raises(CheckpointError, match=r"inside an accumulation window by 2 rank\(s\).*resume it with 2"):
            Trainer(engine).fit(loader, epochs=1, resume_from=ck)
    finally:
        gpc.destroy()
