"""The logged learning rate follows the schedule everywhere it is shown.

The ``LR`` metric once cached its first read, so epoch log lines, TensorBoard, ``trainer.states`` and each
checkpoint's ``meta.json`` kept the first epoch's LR while the optimizer's really followed the schedule.
Here every place is compared with ``optimizer.param_groups[0]['lr']`` at each epoch of a cosine schedule:
by epoch and by step, torch's and colossal_lite's scheduler, one process and two (torchrun, gloo). The epoch
log line is compared with the LR the epoch's last update used (the optimizer's after that update, before the
scheduler stepped), the others with the optimizer's LR at the epoch's end.
"""
import json
import runpy
import textwrap

import pytest
from dist_helpers import run_ranks

SCRIPT = textwrap.dedent('''
    import json, re, sys
    from pathlib import Path

    import torch
    from torch import nn

    import colossal_lite
    from colossal_lite.core import global_context as gpc
    from colossal_lite.nn.lr_scheduler import CosineAnnealingLR as LiteCosine
    from colossal_lite.trainer import Trainer, hooks

    out_dir, kind, by_epoch, launch = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "epoch", sys.argv[4] == "launch"
    if launch:
        colossal_lite.launch_from_torch(config={}, verbose=False)
    EPOCHS, BATCHES = 5, 4

    class Lines:
        def __init__(self):
            self.lines = []
        def info(self, msg, *args, **kwargs):
            self.lines.append(str(msg))
        warning = error = info

    class Probe(hooks.BaseHook):
        """Runs after every other hook at an epoch's end: what the optimizer and trainer.states say then."""
        def __init__(self):
            super().__init__(priority=1000)
            self.seen = []
            self.trained = None
        def after_optimizer_step(self, trainer):
            self.trained = engine.optimizer.param_groups[0]["lr"]  # the LR this update used
        def after_train_epoch(self, trainer):
            metric = trainer.states["metrics"]["train"]["LR"]
            self.seen.append({"step": trainer.state.step, "optimizer": engine.optimizer.param_groups[0]["lr"],
                              "states": metric.get_accumulated_value(), "state_lr": trainer.state.lr,
                              "trained": self.trained})

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    length = EPOCHS if by_epoch else EPOCHS * BATCHES
    if kind == "torch":
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=length)
    else:
        scheduler = LiteCosine(optimizer, total_steps=length)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)) for _ in range(BATCHES)]
    engine, loader, _, scheduler = colossal_lite.initialize(model, optimizer, nn.CrossEntropyLoss(), data,
                                                            lr_scheduler=scheduler, verbose=False)
    logger, probe = Lines(), Probe()
    trainer = Trainer(engine, logger=logger)
    trainer.fit(loader, epochs=EPOCHS, display_progress=False, hooks=[
        hooks.LossHook(), hooks.LRSchedulerHook(scheduler, by_epoch=by_epoch), hooks.LogMetricByEpochHook(logger),
        hooks.TensorboardHook(str(out_dir / "tb"), ranks=[0]),
        hooks.SaveCheckpointHook(1, str(out_dir / "ck")), probe])
    for hook in trainer.hooks:
        if isinstance(hook, hooks.TensorboardHook):
            hook.close()
    if gpc.get_global_rank() == 0:
        logged = [float(m.group(1)) for line in logger.lines if "/ Train]" in line
                  for m in [re.search(r"LR = ([0-9.eE+-]+)", line)] if m]
        metas = sorted((json.loads(p.read_text()) for p in (out_dir / "ck").glob("*/meta.json")),
                       key=lambda m: m["step"])
        (out_dir / "result.json").write_text(json.dumps({
            "probe": probe.seen, "logged": logged,
            "meta": [[m["step"], m["metrics"].get("train/LR")] for m in metas]}))
    if launch:
        gpc.destroy()
''')


def _tensorboard_scalars(folder, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = [p for p in folder.rglob("events.out.tfevents.*")]
    assert runs, f"no TensorBoard event file under {folder}"
    acc = EventAccumulator(str(runs[0].parent))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def _check(out_dir, by_epoch):
    result = json.loads((out_dir / "result.json").read_text())
    probe = result["probe"]
    assert len(probe) == 5
    lrs = [p["optimizer"] for p in probe]
    assert len(set(round(lr, 8) for lr in lrs)) == 5, f"the schedule should change the LR each epoch: {lrs}"
    for p in probe:  # trainer.states and trainer.state.lr
        assert p["states"] == pytest.approx(p["optimizer"], rel=1e-9, abs=1e-12)
        assert p["state_lr"] == pytest.approx(p["optimizer"], rel=1e-9, abs=1e-12)
    # the epoch log lines (printed with 5 significant digits): the LR the epoch's last update used
    assert result["logged"] == pytest.approx([p["trained"] for p in probe], rel=1e-4, abs=1e-9)
    if by_epoch:
        assert result["logged"][0] == pytest.approx(0.1)  # epoch 0 trained at the base LR
    # each epoch's checkpoint
    assert [step for step, _ in result["meta"]] == [p["step"] for p in probe]
    assert [lr for _, lr in result["meta"]] == pytest.approx(lrs, rel=1e-9, abs=1e-12)
    # TensorBoard: by epoch, one point per epoch; by step, one per step (the LR after that step's update)
    scalars = _tensorboard_scalars(out_dir / "tb", "LR/train")
    if by_epoch:
        assert [scalars[p["step"]] for p in probe] == pytest.approx(lrs, rel=1e-6, abs=1e-9)
    else:
        assert [scalars[p["step"]] for p in probe] == pytest.approx(lrs, rel=1e-6, abs=1e-9)
        assert len(set(round(v, 7) for v in scalars.values())) == len(scalars) >= 19


@pytest.mark.parametrize("kind", ["torch", "lite"])
@pytest.mark.parametrize("by", ["epoch", "step"])
def test_logged_lr_equals_the_optimizers_at_every_epoch_one_process(tmp_path, monkeypatch, kind, by):
    script = tmp_path / "lr_script.py"
    script.write_text(SCRIPT)
    monkeypatch.setattr("sys.argv", [str(script), str(tmp_path), kind, by, "no-launch"])
    runpy.run_path(str(script), run_name="__main__")
    _check(tmp_path, by == "epoch")


def test_logged_lr_equals_the_optimizers_at_every_epoch_two_ranks(tmp_path):
    script = tmp_path / "lr_script.py"
    script.write_text(SCRIPT)
    run_ranks(script, [tmp_path, "lite", "step", "launch"], nproc=2, timeout=120)
    _check(tmp_path, by_epoch=False)
