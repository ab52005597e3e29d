"""EMAHook with SaveCheckpointHook(save_best=...): the best checkpoint is chosen by the metric measured on the EMA
weights, ``load_weights(path, ema=True)`` / ``ckpt export --ema`` give that average (equal to a hand-written
``torch.optim.swa_utils`` loop over the same batches), and a resume restores the live weights into the model and
the average into the hook, from 'best' or from a save taken during evaluation."""
import json
import shutil

import pytest
import torch
from dist_helpers import doc_python_blocks, run_python, run_ranks
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import TensorDataset

from colossal_lite.checkpoint import CheckpointError, load_weights, read_checkpoint
from colossal_lite.checkpoint.cli import main as ckpt_main
from colossal_lite.engine.engine import Engine
from colossal_lite.nn.metric import Accuracy
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import AccuracyHook, BaseHook, EMAHook, LossHook, SaveCheckpointHook
from colossal_lite.utils import get_dataloader, save_checkpoint

DECAY, EPOCHS = 0.8, 5  # 10 optimizer steps per epoch


def dataset(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x[:, 0] + 0.5 * x[:, 1] > 0).long() + (x[:, 2] > 1).long())


TRAIN, TEST = dataset(40, 0), dataset(24, 1)


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def loaders():
    return get_dataloader(TRAIN, shuffle=True, seed=7, batch_size=4), get_dataloader(TEST, batch_size=8)


def cloned(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_same(got, expected):
    assert set(got) == set(expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


@pytest.fixture(scope="module")
def by_hand():
    """The same training written with plain torch and swa_utils: per epoch, the live and EMA weights and the
    EMA's test accuracy and loss."""
    model, opt = build()
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY), use_buffers=True)
    train, _ = loaders()
    x_test, y_test = TEST.tensors
    epochs = []
    for _ in range(EPOCHS):
        model.train()
        for x, y in train:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            ema.update_parameters(model)
        model.eval()
        ema.module.eval()
        with torch.no_grad():
            out, live_out = ema.module(x_test), model(x_test)
        epochs.append(dict(live=cloned(model), ema=cloned(ema.module),
                           acc=(out.argmax(1) == y_test).float().mean().item(),
                           live_acc=(live_out.argmax(1) == y_test).float().mean().item(),
                           loss=nn.functional.cross_entropy(out, y_test).item(),
                           live_loss=nn.functional.cross_entropy(live_out, y_test).item()))
    return epochs


class AtEvaluation(BaseHook):
    """Each evaluation's EMA weights as the EMAHook holds them (after the swap back), by step."""

    def __init__(self):
        super().__init__(priority=50)
        self.ema, self.by_step = None, {}

    def after_hook_is_attached(self, trainer):
        self.ema = next(h for h in trainer.hooks if isinstance(h, EMAHook))

    def after_test(self, trainer):
        self.by_step[trainer.state.step] = cloned(self.ema.ema_model.module)


def trained(folder, hooks=(), resume_from=None):
    """A run with EMAHook and SaveCheckpointHook(save_best=('Accuracy', 'max')); -> (model, EMAHook)."""
    model, opt = build()
    engine = Engine(model, opt, nn.CrossEntropyLoss())
    train, test = loaders()
    ema = EMAHook(decay=DECAY)
    run = [ema, LossHook(), AccuracyHook(Accuracy()), *hooks,
           SaveCheckpointHook(1, folder, save_best=("Accuracy", "max"))]
    Trainer(engine).fit(train, epochs=EPOCHS, test_dataloader=test, hooks=run, resume_from=resume_from)
    return model, ema


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ema") / "ck"
    at_eval = AtEvaluation()
    model, ema = trained(folder, hooks=[at_eval])
    return dict(folder=folder, model=cloned(model), ema=cloned(ema.ema_model.module), at_eval=at_eval.by_step)


def best_epoch(folder):
    return int((folder / "best").read_text().strip().split("-")[0][len("epoch"):])


def test_best_is_chosen_by_the_metric_measured_on_the_ema_weights(run, by_hand):
    folder = run["folder"]
    for epoch, expected in enumerate(by_hand):
        metrics = json.loads((folder / f"epoch{epoch}-step{10 * (epoch + 1)}" / "meta.json").read_text())["metrics"]
        assert metrics["test/Accuracy"] == pytest.approx(expected["acc"], abs=1e-6), epoch
        assert metrics["test/Loss"] == pytest.approx(expected["loss"], rel=1e-5), epoch
        assert metrics["test/Loss"] != pytest.approx(expected["live_loss"], rel=1e-3), epoch
    accs = [e["acc"] for e in by_hand]
    best = accs.index(max(accs))
    live_accs = [e["live_acc"] for e in by_hand]
    assert best != live_accs.index(max(live_accs))  # the live weights would have chosen another epoch
    assert (folder / "best").read_text().strip() == f"epoch{best}-step{10 * (best + 1)}"


def test_the_best_checkpoints_ema_weights_are_the_hand_written_average(run, by_hand):
    folder = run["folder"]
    best = best_epoch(folder)
    step = 10 * (best + 1)
    ema = load_weights(folder / "best", ema=True)
    assert_same(ema, by_hand[best]["ema"])  # bit for bit
    assert_same(ema, run["at_eval"][step])  # the hook's ema_model.module at that step
    assert_same(load_weights(folder / "best"), by_hand[best]["live"])  # without ema: the live weights
    fresh, _ = build()
    fresh.load_state_dict(ema)  # keyed as the model's own state_dict
    assert_same(load_weights(folder, ema=True), run["ema"])  # the folder: its last checkpoint, the end of the run


def test_ckpt_export_ema_writes_the_average(run, by_hand, tmp_path, capsys):
    folder = run["folder"]
    out = tmp_path / "model.pt"
    assert ckpt_main(["ckpt", "export", str(folder / "best"), str(out), "--ema"]) == 0
    printed = capsys.readouterr().out
    best = best_epoch(folder)
    checkpoint = folder / (folder / "best").read_text().strip()
    assert f"(the EMA weights of EMAHook.0, {10 * (best + 1)} steps averaged) of {checkpoint} to {out}" in printed
    assert_same(torch.load(out, weights_only=True), by_hand[best]["ema"])
    assert ckpt_main(["ckpt", "export", str(folder / "best"), str(out)]) == 0
    assert "EMA" not in capsys.readouterr().out
    assert_same(torch.load(out, weights_only=True), by_hand[best]["live"])


class AtStart(BaseHook):
    """The model's and the average's weights when training starts (after a resume restored them)."""

    def __init__(self):
        super().__init__(priority=50)
        self.model = self.average = None

    def before_train(self, trainer):
        self.model = cloned(trainer.engine.unwrapped_model)
        self.average = cloned(next(h for h in trainer.hooks if isinstance(h, EMAHook)).ema_model.module)


def resumed(resume_from, folder):
    start = AtStart()
    model, ema = trained(folder, hooks=[start], resume_from=resume_from)
    return model, ema, start


def test_resume_from_best_puts_the_live_weights_in_the_model_and_the_average_in_the_hook(run, by_hand, tmp_path):
    folder = tmp_path / "ck"
    shutil.copytree(run["folder"], folder)
    best = best_epoch(folder)
    model, ema, start = resumed("best", folder)
    assert_same(start.model, by_hand[best]["live"])
    assert_same(start.average, by_hand[best]["ema"])
    assert_same(cloned(model), run["model"])  # and the run goes on as the uninterrupted one
    assert_same(cloned(ema.ema_model.module), run["ema"])


class SaveDuringEvaluation(BaseHook):
    """Writes a checkpoint from ``after_test_epoch`` of one evaluation, while EMAHook has the average in the model."""

    def __init__(self, at_step):
        super().__init__(priority=40)
        self.at_step, self.path, self.model_then = at_step, None, None

    def after_test_epoch(self, trainer):
        if trainer.state.step == self.at_step:
            self.model_then = cloned(trainer.engine.unwrapped_model)
            save = next(h for h in trainer.hooks if isinstance(h, SaveCheckpointHook))
            self.path = save.save(trainer)


def test_a_save_taken_during_evaluation_keeps_the_live_weights_as_the_model(run, by_hand, tmp_path):
    during = SaveDuringEvaluation(at_step=20)
    model, ema = trained(tmp_path / "ck", hooks=[during])
    assert_same(during.model_then, by_hand[1]["ema"])  # the model held the average when it was saved
    shared, _ = read_checkpoint(during.path)
    assert_same(shared["engine"]["model"], by_hand[1]["live"])
    assert_same(load_weights(during.path, ema=True), by_hand[1]["ema"])
    assert_same(cloned(model), run["model"])  # the save changed nothing in the run
    _, ema2, start = resumed(str(during.path), tmp_path / "ck2")
    assert_same(start.model, by_hand[1]["live"])
    assert_same(start.average, by_hand[1]["ema"])
    assert_same(cloned(ema2.ema_model.module), run["ema"])


def test_ema_asked_of_a_checkpoint_without_an_average_says_what_to_do(tmp_path, capsys):
    model, opt = build()
    engine = Engine(model, opt, nn.CrossEntropyLoss())
    train, _ = loaders()
    Trainer(engine).fit(train, epochs=1, hooks=[SaveCheckpointHook(1, tmp_path / "ck")])
    with pytest.raises(CheckpointError, match=r"holds no EMA weights: .* no EMAHook in fit's hooks\. Export the "
                                              r"model's own weights without --ema"):
        load_weights(tmp_path / "ck", ema=True)
    assert ckpt_main(["ckpt", "export", str(tmp_path / "ck" / "last"), str(tmp_path / "w.pt"), "--ema"]) == 1
    assert "holds no EMA weights" in capsys.readouterr().err and not (tmp_path / "w.pt").exists()
    save_checkpoint(tmp_path / "legacy.pt", 0, model, opt)  # a save_checkpoint file keeps no hook state
    with pytest.raises(CheckpointError, match="holds no EMA weights"):
        load_weights(tmp_path / "legacy.pt", ema=True)
    assert set(load_weights(tmp_path / "legacy.pt")) == set(model.state_dict())


def test_with_two_averages_one_is_named(tmp_path, capsys):
    model, opt = build()
    engine = Engine(model, opt, nn.CrossEntropyLoss())
    train, _ = loaders()
    slow, fast = EMAHook(decay=0.99), EMAHook(decay=0.5)
    Trainer(engine).fit(train, epochs=1, hooks=[slow, fast, SaveCheckpointHook(1, tmp_path / "ck")])
    with pytest.raises(CheckpointError, match=r"holds 2 EMA averages \(EMAHook.0, EMAHook.1\): name the one to "
                                              r"export, e.g. --ema-hook EMAHook.1"):
        load_weights(tmp_path / "ck", ema=True)
    assert_same(load_weights(tmp_path / "ck", ema="EMAHook.1"), cloned(fast.ema_model.module))
    out = tmp_path / "slow.pt"
    assert ckpt_main(["ckpt", "export", str(tmp_path / "ck"), str(out), "--ema-hook", "EMAHook.0"]) == 0
    assert_same(torch.load(out, weights_only=True), cloned(slow.ema_model.module))
    with pytest.raises(CheckpointError, match=r"no EMA weights under 'EMAHook.2'; it has \['EMAHook.0', 'EMAHook.1'\]"):
        load_weights(tmp_path / "ck", ema="EMAHook.2")


DDP_SCRIPT = '''
import sys
import torch
from torch import nn
from torch.utils.data import TensorDataset
import colossal_lite
from colossal_lite.checkpoint import load_weights
from colossal_lite.core import global_context as gpc
from colossal_lite.nn.metric import Accuracy
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import AccuracyHook, BaseHook, EMAHook, LossHook, SaveCheckpointHook
from colossal_lite.utils import get_dataloader

out_dir, folder = sys.argv[1], sys.argv[2]
if len(sys.argv) > 3:
    colossal_lite.launch_from_torch(config={}, seed=0, verbose=False)
rank, world = gpc.get_global_rank(), gpc.get_world_size()
g = torch.Generator().manual_seed(0)
x = torch.randn(64, 6, generator=g)
y = (x[:, 0] + 0.5 * x[:, 1] > 0).long() + (x[:, 2] > 1).long()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
engine, train, test, _ = colossal_lite.initialize(
    model, torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9), nn.CrossEntropyLoss(),
    get_dataloader(TensorDataset(x[:40], y[:40]), shuffle=True, seed=7, batch_size=8 // world),
    get_dataloader(TensorDataset(x[40:], y[40:]), batch_size=8 // world), verbose=False)
ema = EMAHook(decay=0.8)

class AtEvaluation(BaseHook):
    by_step = {}
    def after_test(self, trainer):
        self.by_step[trainer.state.step] = {k: v.clone() for k, v in ema.ema_model.module.state_dict().items()}

Trainer(engine).fit(train, epochs=4, test_dataloader=test, hooks=[
    ema, LossHook(), AccuracyHook(Accuracy()), AtEvaluation(priority=50),
    SaveCheckpointHook(1, folder, save_best=("Accuracy", "max"))])
best = open(folder + "/best").read().strip()
step = int(best.split("step")[1])
exported = load_weights(folder + "/best", ema=True)   # written by rank 0
own = AtEvaluation.by_step[step]                        # this rank's own average at that step
same = set(own) == set(exported) and all(torch.equal(own[k], exported[k]) for k in own)
torch.save({"best": best, "own": own}, f"{out_dir}/rank{rank}.pt")
print(f"rank {rank}: best {best}, own average equals the exported one: {same}\\n", end="", flush=True)
'''


def test_two_ranks_ddp_have_one_ema_best_and_match_one_process(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(DDP_SCRIPT)
    for name in ("single", "dist"):
        (tmp_path / name).mkdir()
    run_python(script, [tmp_path / "single", tmp_path / "single" / "ck"], timeout=120)
    proc = run_ranks(script, [tmp_path / "dist", tmp_path / "dist" / "ck", "launch"], nproc=2, timeout=180)
    for r in (0, 1):
        assert f"rank {r}: best " in proc.stdout and "equals the exported one: True" in proc.stdout.split(
            f"rank {r}: ")[1].splitlines()[0], proc.stdout + proc.stderr[-3000:]
    single = torch.load(tmp_path / "single" / "rank0.pt", weights_only=True)
    ranks = [torch.load(tmp_path / "dist" / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert ranks[0]["best"] == ranks[1]["best"] == single["best"] == "epoch1-step10"  # neither the first nor the last
    assert_same(ranks[1]["own"], ranks[0]["own"])  # the same average on both ranks, bit for bit
    for name, expected in single["own"].items():
        torch.testing.assert_close(ranks[0]["own"][name], expected, rtol=1e-5, atol=1e-6)


def test_the_docs_snippet_deploys_the_best_checkpoints_average(tmp_path):
    (snippet,) = doc_python_blocks("docs/ema.md", "The weights to deploy: the EMA of the best checkpoint")
    (tmp_path / "snippet.py").write_text(snippet)
    proc = run_python(tmp_path / "snippet.py", cwd=tmp_path, timeout=120)
    assert "deployed the EMA weights: 4 tensors" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    *saves, last = proc.stdout.splitlines()  # nothing else is printed but a line for each save
    assert last.startswith("best: epoch") and len(saves) == 3, proc.stdout
    assert all(line.startswith("colossal_lite - INFO: checkpoint saved: ") for line in saves), proc.stdout
