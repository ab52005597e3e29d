"""Trainer.predict over a whole loader: eval mode, no gradients, outputs in dataset order; on two real gloo ranks
the gathered result equals one process's (the sampler's padding removed); predict(batch) still works."""
import runpy
import sys
import textwrap

import pytest
import torch
from dist_helpers import doc_python_blocks, run_python, run_ranks
from torch import nn

import colossal_lite
from colossal_lite.trainer import Trainer
from colossal_lite.utils import get_dataloader

SCRIPT = textwrap.dedent('''
    import sys
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    import colossal_lite
    from colossal_lite.core import global_context as gpc
    from colossal_lite.trainer import Trainer
    from colossal_lite.utils import get_dataloader

    out_dir = sys.argv[1]
    if len(sys.argv) > 2:
        colossal_lite.launch_from_torch(config=dict(), verbose=False)
    rank, world = gpc.get_global_rank(), gpc.get_world_size()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(13, 5, generator=g), torch.randint(0, 3, (13,), generator=g))  # 13: odd
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.5), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, loader, _, _ = colossal_lite.initialize(model, opt, nn.CrossEntropyLoss(),
                                                    get_dataloader(data, batch_size=2), verbose=False)
    trainer = Trainer(engine)
    shuffled = get_dataloader(data, batch_size=3, shuffle=True)
    next(iter(shuffled))  # the sampler moves on to a new epoch's order at the next iteration
    torch_sampler = DistributedSampler(data, shuffle=True, seed=3) if world > 1 else None
    plain = DataLoader(data, batch_size=4, sampler=torch_sampler)
    result = dict(world=world, training=engine.training, ordered=trainer.predict(loader),
                  shuffled=trainer.predict(shuffled), torch_sampler=trainer.predict(plain))
    result["training_after"] = engine.training
    torch.save(result, f"{out_dir}/rank{rank}.pt")
    gpc.destroy()
''')


def test_two_ranks_return_exactly_the_one_process_result(tmp_path, monkeypatch):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    single_dir, dist_dir = tmp_path / "single", tmp_path / "dist"
    single_dir.mkdir()
    dist_dir.mkdir()
    monkeypatch.setattr(sys, "argv", [str(script), str(single_dir)])
    runpy.run_path(str(script), run_name="__main__")
    run_ranks(script, [dist_dir, "launch"], nproc=2, timeout=120)
    single = torch.load(single_dir / "rank0.pt")
    ranks = [torch.load(dist_dir / f"rank{r}.pt") for r in (0, 1)]
    assert single["world"] == 1 and ranks[0]["world"] == 2
    for key in ("ordered", "shuffled", "torch_sampler"):
        assert single[key].shape == (13, 3), key
        for r in ranks:
            assert r[key].shape == (13, 3), key  # 14 padded samples over two ranks: the repeat removed
            torch.testing.assert_close(r[key], single[key], rtol=1e-5, atol=1e-6, msg=key)
    assert all(r["training"] and r["training_after"] for r in ranks + [single])


def _engine_and_data(n=11):
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g))
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.5), nn.Linear(6, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = colossal_lite.initialize(model, opt, nn.CrossEntropyLoss(), verbose=False)
    return engine, model, data


def test_one_process_equals_a_hand_written_loop_over_the_loader():
    engine, model, data = _engine_and_data()
    trainer = Trainer(engine)
    loader = torch.utils.data.DataLoader(data, batch_size=3)
    out = trainer.predict(loader)
    model.eval()
    with torch.no_grad():
        expected = torch.cat([model(x) for x, _ in loader])
    model.train()
    torch.testing.assert_close(out, expected)
    assert not out.requires_grad and engine.training and model.training
    batches = list(loader)  # a list of (data, label) batches is a loader too
    torch.testing.assert_close(trainer.predict(batches), expected)
    # a loader of inputs alone (bare tensors, from a generator)
    torch.testing.assert_close(trainer.predict(x for x, _ in batches), expected)
    # a shuffled loader of colossal_lite's own comes back in dataset order
    torch.testing.assert_close(trainer.predict(get_dataloader(data, batch_size=4, shuffle=True)), expected)


def test_a_training_mode_model_is_put_back_and_eval_mode_kept():
    engine, model, data = _engine_and_data()
    trainer = Trainer(engine)
    engine.eval()
    trainer.predict(torch.utils.data.DataLoader(data, batch_size=5))
    assert not model.training
    engine.train()
    trainer.predict(torch.utils.data.DataLoader(data, batch_size=5))
    assert model.training


def test_the_mode_set_on_the_model_itself_and_a_frozen_layer_are_put_back():
    """predict put back the engine's own flag: after ``model.eval()`` (not ``engine.eval()``) the model came back
    in training mode, and a layer kept in eval mode inside a training model (a frozen BatchNorm) came back training
    (found by a probe of predict.md's "the mode it found is put back")."""
    engine, model, data = _engine_and_data()
    trainer = Trainer(engine)
    model.eval()
    trainer.predict(torch.utils.data.DataLoader(data, batch_size=5))
    assert not any(m.training for m in model.modules()) and engine.training  # as found, both
    model.train()
    model[1].eval()  # the dropout frozen
    trainer.predict(data.tensors[0][:3])
    assert [m.training for m in model.modules()] == [True, True, False, True]


def test_nested_outputs_are_joined_leaf_by_leaf():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 2), nn.Linear(4, 3)

        def forward(self, x):
            return {"a": self.a(x), "b": (self.b(x), x.sum(1))}

    torch.manual_seed(0)
    model = TwoHeads()
    engine, *_ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    x = torch.randn(7, 4)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.zeros(7)), batch_size=3)
    out = Trainer(engine).predict(loader)
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(out["a"], expected["a"])
    torch.testing.assert_close(out["b"][0], expected["b"][0])
    torch.testing.assert_close(out["b"][1], expected["b"][1])


class OwnLoss(nn.Module):
    """A Hugging Face style model: keyword inputs, its own loss when given labels, a dict output."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(4, 3)

    def forward(self, features, labels=None):
        logits = self.head(features)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


def test_a_dict_loader_with_labels_predicts_what_it_evaluates_on():
    """The loader a Hugging Face model evaluates on (dict batches holding 'labels') predicts too: the model gets the
    inputs without the labels, as a (data, label) pair's data (with them it added its loss, a 0-dim value of the
    batch, and predict refused to join it, naming a tensor)."""
    model = OwnLoss()
    engine, *_ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    g = torch.Generator().manual_seed(1)
    batches = [{"features": torch.randn(3, 4, generator=g), "labels": torch.randint(0, 3, (3,), generator=g)}
               for _ in range(3)]
    out = Trainer(engine).predict(batches)
    with torch.no_grad():
        expected = torch.cat([model(b["features"])["logits"] for b in batches])
    assert list(out) == ["logits"] and torch.equal(out["logits"], expected)


def test_outputs_that_cannot_be_joined_are_refused_with_the_fix():
    class PerBatch(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, x):
            return {"logits": x * self.scale, "total": x.sum()}  # a value of the whole batch

    model = PerBatch()
    engine, *_ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    with pytest.raises(TypeError, match=r"got a 0-dim tensor \(a value of the whole batch, such as a loss\)\. Fix:"):
        Trainer(engine).predict([torch.randn(2, 3), torch.randn(2, 3)], loader=True)
    model = nn.Linear(3, 3)
    engine, *_ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    padded = [torch.randn(2, 5, 3), torch.randn(2, 7, 3)]  # each batch padded to its own longest sequence
    with pytest.raises(ValueError, match=r"batch 1's differ from batch 0's beyond it \(\(batch, 7, 3\) against "
                                         r"\(batch, 5, 3\)\).*pad every batch to one length"):
        Trainer(engine).predict(padded, loader=True)


def test_predict_of_one_batch_still_works():
    engine, model, data = _engine_and_data()
    trainer = Trainer(engine)
    x = data.tensors[0][:4]
    model.eval()
    with torch.no_grad():
        expected = model(x)
    model.train()
    torch.testing.assert_close(trainer.predict(x), expected)  # a tensor
    torch.testing.assert_close(trainer.predict([x]), expected)  # a list of inputs spread into the model
    torch.testing.assert_close(trainer.predict((x,)), expected)
    torch.testing.assert_close(trainer.predict({"input": x}), expected)
    assert engine.training


def test_the_docs_snippet_runs(tmp_path):
    (snippet,) = doc_python_blocks("docs/predict.md")
    (tmp_path / "snippet.py").write_text(snippet)
    proc = run_python(tmp_path / "snippet.py", cwd=tmp_path, timeout=120)
    assert "predicted (13, 2) (3, 2)" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
