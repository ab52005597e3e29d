"""EMAHook: the average follows every applied step, evaluation runs on it, and a resumed run's average is the
uninterrupted run's."""
import copy
import json
import textwrap

import pytest
import torch
from dist_helpers import doc_python_blocks, run_python, run_ranks
from torch import nn
from torch.utils.data import TensorDataset

import colossal_lite
from colossal_lite.amp import AMP_TYPE
from colossal_lite.core import global_context as gpc
from colossal_lite.engine.engine import Engine
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import BaseHook, EMAHook, LoadCheckpointHook, LossHook, SaveCheckpointHook
from colossal_lite.utils import get_dataloader


def dataset(n=40):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = Engine(model, opt, nn.CrossEntropyLoss())
    return model, engine, get_dataloader(dataset(), shuffle=True, seed=7, batch_size=4)


class Weights(BaseHook):
    """The live weights after every applied step, and the outputs evaluation produced."""

    def __init__(self, model):
        super().__init__(priority=50)
        self.model, self.after_steps, self.eval_outputs = model, [], []

    def after_optimizer_step(self, trainer):
        if trainer.state.updated:
            self.after_steps.append([t.detach().clone() for t in self.model.state_dict().values()])

    def after_test_iter(self, trainer, output, label, loss):
        self.eval_outputs.append(output.detach().clone())


def test_the_average_follows_every_applied_step():
    model, engine, loader = build()
    ema, weights = EMAHook(decay=0.9), Weights(model)
    Trainer(engine).fit(loader, epochs=2, hooks=[ema, weights])
    expected = [t.clone() for t in weights.after_steps[0]]
    for step in weights.after_steps[1:]:
        expected = [e if not e.is_floating_point() else 0.9 * e + 0.1 * s for e, s in zip(expected, step)]
    got = list(ema.ema_model.module.state_dict().values())
    assert len(weights.after_steps) == 20 and int(ema.ema_model.n_averaged) == 20
    for e, g in zip(expected, got):
        if e.is_floating_point():
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    assert not torch.equal(got[0], model[0].weight)  # the live weights are not the average


def test_evaluation_runs_on_the_average_and_training_weights_come_back():
    model, engine, loader = build()
    ema, weights = EMAHook(decay=0.8), Weights(model)
    test = [(x, y) for x, y in get_dataloader(dataset(12), batch_size=6)]
    trainer = Trainer(engine)
    trainer.fit(loader, epochs=1, test_dataloader=test, hooks=[ema, weights, LossHook()])
    live = copy.deepcopy(model.state_dict())
    averaged = copy.deepcopy(ema.ema_model.module).eval()
    with torch.no_grad():
        expected = torch.cat([averaged(x) for x, _ in test])
    torch.testing.assert_close(torch.cat(weights.eval_outputs), expected)
    for name, t in model.state_dict().items():
        assert torch.equal(t, live[name]), name  # evaluation gave the live weights back
    assert not torch.equal(averaged[0].weight, model[0].weight)


def test_an_evaluation_that_raises_gives_the_model_its_live_weights_back():
    """The average trades places with the live weights in before_test and back in after_test: an evaluation that
    raised in between (a Ctrl-C in a notebook) left the average in the model, and the next fit trained from it.
    The swap back now also runs as the hooks are detached, however evaluate or fit ended."""
    model, engine, loader = build()
    ema = EMAHook(decay=0.8)
    trainer = Trainer(engine)
    trainer.fit(loader, epochs=1, hooks=[ema])
    live = copy.deepcopy(model.state_dict())

    class Interrupt(BaseHook):  # (first at before_test: it sees the live weights, before EMAHook's swap)
        def before_test(self, trainer):
            self.live = copy.deepcopy(model.state_dict())

        def after_test_iter(self, trainer, output, label, loss):
            raise KeyboardInterrupt

    test = [(x, y) for x, y in get_dataloader(dataset(12), batch_size=6)]
    for run in ("evaluate", "fit"):
        interrupt = Interrupt(priority=0)
        with pytest.raises(KeyboardInterrupt):
            if run == "evaluate":
                trainer.evaluate(test, hooks=[ema, interrupt])
            else:
                trainer.fit(loader, epochs=2, test_dataloader=test, hooks=[ema, interrupt])
        for name, t in model.state_dict().items():
            assert torch.equal(t, interrupt.live[name]), (run, name)
    assert not torch.equal(live["0.weight"], model[0].weight)  # (the fit trained a step before it was stopped)
    assert not torch.equal(ema.ema_model.module[0].weight, model[0].weight)


def test_a_resumed_run_has_the_uninterrupted_runs_average():
    _, ref_engine, ref_loader = build()
    ref = EMAHook(decay=0.9)
    Trainer(ref_engine).fit(ref_loader, epochs=3, hooks=[ref])

    _, engine, loader = build()
    trainer = Trainer(engine)
    first = EMAHook(decay=0.9)
    trainer.fit(loader, epochs=3, max_steps=13, hooks=[first])  # stops inside epoch 1
    saved = dict(engine=copy.deepcopy(engine.state_dict()), trainer=copy.deepcopy(trainer.state_dict()))
    assert "EMAHook.0" in saved["trainer"]["hooks"]

    _, engine2, loader2 = build()
    engine2.load_state_dict(saved["engine"])
    trainer2 = Trainer(engine2)
    trainer2.load_state_dict(saved["trainer"])
    resumed = EMAHook(decay=0.9)
    trainer2.fit(loader2, epochs=3, hooks=[resumed])
    assert trainer2.cur_step == 30
    for (name, a), b in zip(ref.ema_model.state_dict().items(), resumed.ema_model.state_dict().values()):
        assert torch.equal(a, b), name


def test_decay_outside_0_1_is_refused():
    with pytest.raises(ValueError, match="decay"):
        EMAHook(decay=1.5)


def test_the_docs_snippet_runs(tmp_path):
    snippet = doc_python_blocks("docs/ema.md")[0]
    (tmp_path / "snippet.py").write_text(snippet)
    proc = run_python(tmp_path / "snippet.py", cwd=tmp_path, timeout=120)
    assert "ema steps 16 keys" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_the_average_resumes_from_a_checkpoint_file(tmp_path):
    _, ref_engine, ref_loader = build()
    ref = EMAHook(decay=0.9)
    Trainer(ref_engine).fit(ref_loader, epochs=3, hooks=[ref])

    _, engine, loader = build()
    Trainer(engine).fit(loader, epochs=1, hooks=[EMAHook(decay=0.9), SaveCheckpointHook(1, tmp_path / "ck")])
    _, engine2, loader2 = build()
    resumed = EMAHook(decay=0.9)
    trainer2 = Trainer(engine2)
    trainer2.fit(loader2, epochs=3, hooks=[LoadCheckpointHook(tmp_path / "ck"), resumed])
    assert trainer2.cur_step == 30
    for (name, a), b in zip(ref.ema_model.state_dict().items(), resumed.ema_model.state_dict().values()):
        assert torch.equal(a, b), name


ZERO_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from torch import nn
    import colossal_lite
    from colossal_lite.core import global_context as gpc
    from colossal_lite.trainer import Trainer
    from colossal_lite.trainer.hooks import EMAHook, LossHook
    from colossal_lite.utils import get_dataloader

    colossal_lite.launch_from_torch(config={}, seed=0, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(48, 6, generator=g), torch.randint(0, 3, (48,), generator=g))
    for zero in json.loads(sys.argv[1]):  # the same training under each zero setting (None: DDP)
        gpc.config["zero"] = zero
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
        engine, loader, test_loader, _ = colossal_lite.initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), nn.CrossEntropyLoss(),
            get_dataloader(data, batch_size=4, shuffle=True, seed=3), get_dataloader(data, batch_size=12),
            verbose=False)
        ema = EMAHook(decay=0.8)
        history = Trainer(engine).fit(loader, epochs=2, test_dataloader=test_loader, hooks=[LossHook(), ema])
        average = [t.tolist() for t in ema.ema_model.module.state_dict().values() if t.is_floating_point()]
        print(json.dumps({"rank": gpc.get_global_rank(), "zero": zero, "strategy": type(engine.strategy).__name__, "average": average,
                          "test": history["test/Loss"]}) + "\\n", end="", flush=True)
    gpc.destroy()
""")


def test_zero_stage_1_averages_as_ddp_and_a_sharded_model_is_refused_on_every_rank(tmp_path):
    script = tmp_path / "ema_zero.py"
    script.write_text(ZERO_SCRIPT)
    out = run_ranks(script, [json.dumps([None, {"stage": 1}])], nproc=2, timeout=180).stdout
    runs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    ddp = [r for r in runs if r["zero"] is None]
    zero1 = [r for r in runs if r["zero"] is not None]
    assert sorted(r["rank"] for r in ddp) == sorted(r["rank"] for r in zero1) == [0, 1]
    assert {r["strategy"] for r in ddp} == {"DDPStrategy"} and {r["strategy"] for r in zero1} == {"ZeroStage1Strategy"}
    assert ddp[0]["average"] == ddp[1]["average"] and zero1[0]["average"] == zero1[1]["average"]  # ranks agree
    for a, b in zip(ddp[0]["average"], zero1[0]["average"]):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-5, atol=1e-6)
    assert zero1[0]["test"] == pytest.approx(ddp[0]["test"], rel=1e-5)  # evaluated on the average, as under DDP

    refused = run_ranks(script, [json.dumps([{"stage": 2}])], nproc=2, timeout=180, check=False)
    assert refused.returncode != 0
    message = "EMAHook cannot average a model sharded by FSDP2 (zero stage 2 or 3)"
    assert refused.stderr.count(message) >= 2, refused.stderr  # each rank says it (none hangs waiting)
    assert "Use zero=dict(stage=1)" in refused.stderr


@pytest.fixture
def naive_fp16():
    gpc.destroy()
    colossal_lite.launch_from_torch(config=dict(fp16=dict(mode=AMP_TYPE.NAIVE, initial_scale=1024.0)), verbose=False)
    yield
    gpc.destroy()


def test_under_naive_fp16_the_average_is_kept_in_fp32_and_evaluations_leave_it_as_it_was(naive_fp16):
    """The averaged copy of an fp16 model was fp16 too: ``(1 - decay)``'s steps rounded away and the average hardly
    moved (found by the mixed-precision probe). It is the fp32 average of the fp16 weights each update left, as a
    hand-written ``lerp_`` in fp32 gives it, bit for bit, and evaluations on it (which put it in the fp16 model and
    take it out again) leave it so."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    engine, loader, test_loader, _ = colossal_lite.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.05), nn.CrossEntropyLoss(),
        get_dataloader(dataset(), batch_size=4), get_dataloader(dataset(12), batch_size=6), verbose=False)
    hand = {}

    class HandAverage(BaseHook):
        def after_optimizer_step(self, trainer):
            if trainer.state.updated:
                for name, p in engine.unwrapped_model.named_parameters():
                    w = p.detach().float()
                    hand[name] = w.clone() if name not in hand else hand[name].lerp_(w, 1 - 0.99)

    ema = EMAHook(decay=0.99)
    Trainer(engine).fit(loader, epochs=3, test_dataloader=test_loader, hooks=[ema, HandAverage(priority=6)])
    assert engine.num_updates == 30 and len(hand) == 4
    for name, p in ema.ema_model.module.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, hand[name]), name
        assert not torch.equal(p, p.half().float()), name  # more than fp16 holds
    assert all(p.dtype == torch.float16 for p in engine.unwrapped_model.parameters())  # the model is left as it was
