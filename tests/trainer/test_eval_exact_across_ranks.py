"""Evaluation on two real gloo ranks equals one process's figures: the distributed sampler's padded repeats are
counted by no metric, hook, history entry, ``save_best`` or early stopping.

One torchrun launch checks everything. Each rank computes the exact figures itself (the model that evaluation
sees, over the whole test set in one batch, as one process would), so no second run is needed. The test set
has an odd size, so one rank's share ends with a repeat; the batch sizes leave a partial last batch, and one
of them a last batch that is only the repeat.
"""
import json

import pytest
import torch
from dist_helpers import run_ranks
from engine_helpers import make_batches, make_model
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

from colossal_lite.engine import Engine
from colossal_lite.engine.schedule import NonPipelineSchedule
from colossal_lite.engine.step import TrainStep
from colossal_lite.trainer._padding import RealRows, real_samples
from colossal_lite.utils.data import DataParallelSampler

SCRIPT = '''
import json, sys
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset
import colossal_lite
from colossal_lite.checkpoint.manager import read_meta
from colossal_lite.core import global_context as gpc
from colossal_lite.nn.metric import Accuracy
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import (AccuracyHook, BaseHook, EarlyStoppingHook, LossHook, SaveCheckpointHook,
                                        ThroughputHook)
from colossal_lite.utils import get_dataloader

out_dir = sys.argv[1]
colossal_lite.launch_from_torch(config=dict(), verbose=False)
rank, world = gpc.get_global_rank(), gpc.get_world_size()
g = torch.Generator().manual_seed(0)
x, y = torch.randn(165, 6, generator=g), torch.randint(0, 3, (165,), generator=g)
train, test = TensorDataset(x[:64], y[:64]), TensorDataset(x[64:], y[64:])  # 101 test samples
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.2)
engine, train_loader, test_loader, _ = colossal_lite.initialize(
    model, opt, nn.CrossEntropyLoss(), get_dataloader(train, batch_size=8),
    get_dataloader(test, batch_size=8, shuffle=True), verbose=False)


def exact(dataset):
    """What one process gives over ``dataset``: the correct count and the loss sum, in one batch."""
    data, label = dataset.tensors if isinstance(dataset, TensorDataset) else dataset
    engine.unwrapped_model.eval()
    with torch.no_grad():
        logits = engine.unwrapped_model(data)
    return {"correct": int((logits.argmax(-1) == label).sum()), "n": len(label),
            "loss_sum": float(F.cross_entropy(logits.double(), label, reduction="sum"))}


class Seen(BaseHook):
    """What any hook sees in evaluation: the rows of outputs and labels, and the exact figures of that model."""
    def before_test(self, trainer):
        self.rows, self.outputs = 0, 0
        reference.append(exact(test))
    def after_test_iter(self, trainer, output, label, loss):
        self.rows += label.shape[0]
        self.outputs += (output["logits"] if isinstance(output, dict) else output).shape[0]
    def after_test(self, trainer):
        seen.append({"rows": self.rows, "outputs": self.outputs})


reference, seen = [], []
throughput = ThroughputHook()
checkpoints = SaveCheckpointHook(1, f"{out_dir}/ck", save_best=("Accuracy", "max"))
stopping = EarlyStoppingHook("test/Loss", mode="min", patience=10)
trainer = Trainer(engine)
trainer.fit(train_loader, epochs=3, test_dataloader=test_loader, display_progress=False,
            hooks=[LossHook(), AccuracyHook(Accuracy()), throughput, Seen(), checkpoints, stopping])
fit = {"throughput_samples": throughput.test_metric._samples,
       "history_acc": trainer.history["test/Accuracy"], "history_loss": trainer.history["test/Loss"],
       "saved": [read_meta(p)["metrics"] for p in sorted((checkpoints.checkpoint_dir).glob("epoch*"))],
       "best_value": checkpoints._manager.best_value, "stopping_best": stopping.best}

# after fit: other loaders through evaluate (the model no longer changes, so one exact figure holds for all)
share = Subset(test, range(60) if rank == 0 else range(60, 101))  # each rank its own part, no sampler
loaders = {
    "last_batch_all_padding": get_dataloader(test, batch_size=25),  # 51 per rank: rank 1's last batch is the repeat
    "torch_sampler": DataLoader(test, batch_size=7, sampler=DistributedSampler(test, shuffle=True, seed=3)),
    "torch_drop_last": DataLoader(test, batch_size=7, sampler=DistributedSampler(test, shuffle=False, drop_last=True)),
    "no_sampler": DataLoader(share, batch_size=8),
}
evaluated = {}
accuracy = {name: Accuracy() for name in loaders}
loaders["torchmetrics"] = get_dataloader(test, batch_size=25)  # torchmetrics refuses an empty batch
accuracy["torchmetrics"] = MulticlassAccuracy(num_classes=3, average="micro")
for name, loader in loaders.items():
    values = trainer.evaluate(loader, hooks=[LossHook(), AccuracyHook(accuracy[name]), Seen()])
    evaluated[name] = dict(values, **seen.pop())
    reference.pop()


class OwnLoss(nn.Module):
    """The trained model computing its own mean loss over the rows it is given, as a Hugging Face model does."""
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
    def forward(self, x, labels):
        logits = self.inner(x)
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return len(test)
    def __getitem__(self, i):
        return {"x": test[i][0], "labels": test[i][1]}


# no criterion: the model's loss; batches of 8 leave rank 1 a last batch of 2 real rows and its repeat
own, *_ = colossal_lite.initialize(OwnLoss(engine.unwrapped_model), torch.optim.SGD(model.parameters(), lr=0.1),
                                   verbose=False)
values = Trainer(own).evaluate(get_dataloader(Rows(), batch_size=8), hooks=[LossHook(), Seen()])
evaluated["model_loss"] = dict(values, **seen.pop())
reference.pop()
final = {"all": exact(test), "first_100": exact(test[:100])}
with open(f"{out_dir}/rank{rank}.json", "w") as f:
    json.dump({"world": world, "reference": reference, "seen": seen, "fit": fit, "evaluated": evaluated,
               "final": final}, f)
print(f"rank {rank}: fit test/Accuracy {fit['history_acc']} test/Loss {fit['history_loss']}\\n", end="", flush=True)
gpc.destroy()
'''


def _accuracy(ref):
    return ref["correct"] / ref["n"]


def _loss(ref):
    return ref["loss_sum"] / ref["n"]


def test_two_ranks_give_one_process_figures(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    run_ranks(script, [tmp_path], nproc=2, timeout=180)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["world"] == 2
    for name in ("history_acc", "history_loss", "saved", "stopping_best"):
        assert ranks[0]["fit"][name] == ranks[1]["fit"][name], name  # every rank reads the same reduced values
    result, refs = ranks[0], ranks[0]["reference"]
    assert len(refs) == 3 and refs == ranks[1]["reference"]  # both ranks hold the same model at each evaluation

    # fit: the history's test/ entries, what each checkpoint recorded, the best that save_best and early stopping saw
    fit = result["fit"]
    assert fit["history_acc"] == [_accuracy(ref) for ref in refs]  # counts: exactly
    assert fit["history_loss"] == pytest.approx([_loss(ref) for ref in refs], rel=1e-6, abs=0)
    assert [saved["test/Accuracy"] for saved in fit["saved"]] == fit["history_acc"]
    assert [saved["test/Loss"] for saved in fit["saved"]] == fit["history_loss"]
    assert fit["best_value"] == max(_accuracy(ref) for ref in refs)  # (rank 0 moves the best pointer)
    assert fit["stopping_best"] == min(fit["history_loss"])
    # every hook saw each real sample once: 51 rows on rank 0, 50 on rank 1 (its repeat left out)
    for r, rank in enumerate(ranks):
        assert rank["seen"] == [{"rows": 51 - r, "outputs": 51 - r}] * 3
        assert rank["fit"]["throughput_samples"] == 51 - r  # ThroughputHook counts the real samples too

    final = result["final"]
    expected = {"last_batch_all_padding": final["all"], "torch_sampler": final["all"],
                "torch_drop_last": final["first_100"],  # drop_last: no padding, the sampler's 100 samples
                "no_sampler": final["all"],  # no sampler to ask: nothing dropped (the ranks' parts make the set)
                "torchmetrics": final["all"]}
    rows = {"last_batch_all_padding": (51, 50), "torch_sampler": (51, 50), "torch_drop_last": (50, 50),
            "no_sampler": (60, 41), "torchmetrics": (51, 50)}
    for name, ref in expected.items():
        got = result["evaluated"][name]
        assert {k: ranks[1]["evaluated"][name][k] for k in ("Accuracy", "Loss")} == \
            {k: got[k] for k in ("Accuracy", "Loss")}, name
        if name == "torchmetrics":  # its count is exact, but it divides in float32
            assert got["Accuracy"] == pytest.approx(_accuracy(ref), rel=1e-6, abs=0)
        else:
            assert got["Accuracy"] == _accuracy(ref), name
        assert got["Loss"] == pytest.approx(_loss(ref), rel=1e-6, abs=0), name
        assert (got["rows"], ranks[1]["evaluated"][name]["rows"]) == (rows[name][0], rows[name][1]), name
        assert got["outputs"] == got["rows"], name
    own = result["evaluated"]["model_loss"]  # the loss a model computes itself leaves the repeat out too
    assert own["Loss"] == ranks[1]["evaluated"]["model_loss"]["Loss"]
    assert own["Loss"] == pytest.approx(_loss(final["all"]), rel=1e-6, abs=0)
    assert (own["rows"], ranks[1]["evaluated"]["model_loss"]["rows"]) == (51, 50)


@pytest.mark.parametrize("kind", ["torch", "colossal"])
@pytest.mark.parametrize("drop_last", [False, True])
def test_each_rank_knows_its_real_samples(kind, drop_last):
    """No process group needed: the samplers are told their rank. Over all ranks, the real prefixes of the shares
    hold each sampled index once, and what is past them repeats indices already held."""
    for size in (1, 2, 5, 13, 101):
        for world in (2, 3, 4, 8):
            if drop_last and size < world:
                continue
            make = DistributedSampler if kind == "torch" else DataParallelSampler
            samplers = [make(range(size), num_replicas=world, rank=r, shuffle=True, seed=1, drop_last=drop_last)
                        for r in range(world)]
            shares = [list(sampler) for sampler in samplers]
            real = [share[:real_samples(sampler)] for sampler, share in zip(samplers, shares)]
            held = sorted(i for part in real for i in part)
            assert len(held) == len(set(held)) == (world * (size // world) if drop_last else size), (size, world)
            repeats = [i for share, part in zip(shares, real) for i in share[len(part):]]
            assert set(repeats) <= set(held) and len(repeats) == world * len(shares[0]) - len(held)


def test_a_resumed_share_and_loaders_without_known_padding():
    data = TensorDataset(torch.arange(13.0), torch.arange(13))
    sampler = DataParallelSampler(data, num_replicas=2, rank=1)  # 7 positions, the last one a repeat
    sampler.load_state_dict({"epoch": 0, "offset": 4})
    assert real_samples(sampler) == 2
    rows = RealRows(DataLoader(data, batch_size=2, sampler=sampler))
    assert [rows.of((torch.zeros(n), torch.zeros(n))) for n in (2, 1)] == [None, 0]
    # no distributed sampler, or a batch sampler that is not torch's (it may reorder): nothing is dropped
    assert RealRows(DataLoader(data, batch_size=4)).left is None
    batches = BatchSampler(DistributedSampler(data, num_replicas=2, rank=1), 4, False)
    assert RealRows(DataLoader(data, batch_sampler=batches)).left == 6  # torch's BatchSampler keeps the order

    class Buckets:
        sampler = DistributedSampler(data, num_replicas=2, rank=1)

        def __iter__(self):
            return iter([[0, 1], [2]])

    assert RealRows(DataLoader(data, batch_sampler=Buckets())).left is None


def test_the_evaluation_step_keeps_the_real_rows():
    model = make_model()
    step = TrainStep(Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss()))
    (x, y), = make_batches(1)
    step.forward_only((x, y), keep=3)  # the forward sees the real rows only
    rec, logits = step.record, model(x[:3]).detach()
    assert rec.output.shape[0] == rec.label.shape[0] == rec.data.shape[0] == step.engine.schedule.batch_size == 3
    assert torch.equal(rec.output, logits) and torch.equal(rec.loss, nn.functional.cross_entropy(logits, y[:3]))
    step.forward_only((x, y), keep=0)  # only padding: no rows, and a loss that weighs nothing (not NaN)
    assert rec.output.shape[0] == rec.label.shape[0] == 0 and rec.loss.item() == 0.0
    # an output that is not batch-first: the input's rows are cut before the forward, so it matches its labels
    step = TrainStep(Engine(_SequenceFirst(), torch.optim.SGD(model.parameters(), lr=0.1), _SequenceFirstLoss()))
    step.forward_only((x, y), keep=3)
    assert step.record.label.shape[0] == 3 and step.record.output.shape == (2, 3, 4)
    # ... and when a batch is all padding it is left whole: cutting the labels alone would not match the output
    step.forward_only((x, y), keep=0)
    assert step.record.label.shape[0] == 4 and step.record.output.shape == (2, 4, 4)


def test_a_loss_the_model_computes_covers_the_real_rows_only():
    """A Hugging Face style model computes its own loss over the rows it is given: padded repeats must not be
    among them (they would weigh the repeated samples twice in the evaluation loss)."""
    model = _OwnLoss()
    step = TrainStep(Engine(model, torch.optim.SGD(model.parameters(), lr=0.1)))  # no criterion: the model's loss
    (x, y), = make_batches(1)
    step.forward_only({"x": x, "labels": y}, keep=3)
    assert torch.equal(step.record.loss, model(x[:3], y[:3])["loss"].detach())
    assert not torch.equal(step.record.loss, model(x, y)["loss"].detach())  # the padded row changes it


class _OwnLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 4)

    def forward(self, x, labels):
        logits = self.linear(x)
        return {"logits": logits, "loss": nn.functional.cross_entropy(logits, labels)}


class _SequenceFirst(nn.Module):
    def forward(self, x):
        return torch.stack([x[:, :4], x[:, 2:]])  # [time, batch, classes]


class _SequenceFirstLoss(nn.Module):
    def forward(self, output, label):
        return nn.functional.cross_entropy(output[-1], label)


class _Bag(nn.Module):
    """Sequences of token ids of any length, given as a list: the mean of their embeddings, classified."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.embed, self.out = nn.Embedding(9, 4), nn.Linear(4, 3)

    def forward(self, seqs):
        return self.out(torch.stack([self.embed(s).mean(0) for s in seqs]))


@pytest.mark.parametrize("rank", [0, 1])
def test_a_batch_of_variable_length_sequences_in_a_list_keeps_its_real_samples(rank):
    """A collate_fn that gives (list of sequences, labels): the batch's rows were read from its first tensor, a
    sequence's length, so a real sample was cut away on one rank and a padded repeat counted on the other, and a
    sequence could be cut short (found by a probe). The rows come from the loader; the list is cut per sample."""
    lengths, labels = [3, 2, 4, 5, 1], torch.tensor([0, 1, 2, 1, 0])  # rank 1's first sequence has 2 tokens
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 9, (n,), generator=g), y) for n, y in zip(lengths, labels)]
    loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=rank, shuffle=False),
                        collate_fn=lambda items: ([s for s, _ in items], torch.stack([y for _, y in items])))
    model = _Bag()
    schedule = NonPipelineSchedule(data_process_func=lambda batch: ((batch[0],), batch[1]))
    step = TrainStep(Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(reduction="sum"),
                            schedule=schedule))
    real, seen = RealRows(loader), []
    for batch in loader:
        keep = real.of(batch)
        step.forward_only(batch, keep=keep, rows=real.rows)
        seen.append(([len(s) for s in step.record.data[0]], step.record.label.tolist(), float(step.record.loss)))
    mine = [i for i in range(rank, 5, 2)]  # this rank's real samples: 0, 2, 4 or 1, 3 (then a repeat of 0)
    with torch.no_grad():
        want = float(nn.functional.cross_entropy(model([data[i][0] for i in mine]), labels[mine], reduction="sum"))
    assert [n for lens, _, _ in seen for n in lens] == [lengths[i] for i in mine]  # whole sequences, the real ones
    assert [y for _, ys, _ in seen for y in ys] == labels[mine].tolist()
    # (the batches' sums added against one sum over the rank's samples: the same terms, added in another order)
    assert sum(loss for _, _, loss in seen) == pytest.approx(want, rel=1e-6)
