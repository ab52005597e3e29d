"""A model that computes its own loss (a dict with 'loss', as Hugging Face models return a ModelOutput) trains with
no criterion, against the hand-written loop bit for bit; ``ModelLoss`` names another entry; the metric hooks find
logits and labels in dict outputs and batches; every wrong setup says what to fix. Plain torch models here (fast);
tests/engine/test_hf_model_loss.py runs real GPT-2 and BERT models."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import colossal_lite
from colossal_lite.engine import ModelLoss
from colossal_lite.nn.metric import Accuracy
from colossal_lite.trainer import Trainer, hooks

CLIP, LR = 0.5, 0.1


class OwnLoss(nn.Module):
    """Returns ``{'logits': ..., 'loss': ...}`` when given ``labels``, the way a Hugging Face model does."""

    def __init__(self, loss_key: str = "loss"):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 3)
        self.norm = nn.BatchNorm1d(3)  # a buffer that training changes, compared too
        self.loss_key = loss_key

    def forward(self, x, labels=None):
        logits = self.norm(self.lin(x))
        out = {"logits": logits}
        if labels is not None:
            out[self.loss_key] = F.cross_entropy(logits, labels)
        return out


def dict_batches(n=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [dict(x=torch.randn(4, 4, generator=g), labels=torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


def optimizer_of(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def hand_loop(batches, acc):
    """What the user writes by hand: the model's loss divided by its window's real size, clipping, and the train
    accuracy counted from each micro-batch's logits."""
    model = OwnLoss()
    optimizer = optimizer_of(model.parameters())
    correct, losses = 0, []
    for i, batch in enumerate(batches):
        start = i - i % acc
        size = min(acc, len(batches) - start)
        if i == start:
            optimizer.zero_grad(set_to_none=True)
        out = model(**batch)
        (out["loss"] / size).backward()
        losses.append(out["loss"].detach())
        correct += int((out["logits"].argmax(-1) == batch["labels"]).sum())
        if i == start + size - 1:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
    return model, correct / (4 * len(batches)), losses


def assert_same_model(a: nn.Module, b: nn.Module):
    tensors = list(a.named_parameters()) + list(a.named_buffers())
    other = dict(list(b.named_parameters()) + list(b.named_buffers()))
    for name, t in tensors:
        assert torch.equal(t, other[name]), name


def test_trainer_with_no_criterion_trains_on_the_models_loss_as_the_hand_loop(launched):
    launched(dict(gradient_accumulation=2, clip_grad_norm=CLIP))
    batches = dict_batches()
    hand, hand_accuracy, hand_losses = hand_loop(batches, acc=2)
    engine, loader, _, _ = colossal_lite.initialize(OwnLoss(), optimizer_of, train_dataloader=batches, verbose=False)
    losses = []

    class Record(hooks.BaseHook):
        def after_train_iter(self, trainer, output, label, loss):
            assert label is trainer.state.batch["labels"]  # a dict batch's label: its 'labels'
            losses.append(loss.detach())

    trainer = Trainer(engine)
    trainer.fit(loader, epochs=1, hooks=[Record(), hooks.AccuracyHook(Accuracy(), track_train=True), hooks.LossHook()],
                display_progress=False)
    assert_same_model(hand, engine.unwrapped_model)
    assert [float(x) for x in losses] == [float(x) for x in hand_losses]
    metrics = trainer.states["metrics"]["train"]
    assert metrics["Accuracy"].get_accumulated_value() == hand_accuracy
    # (not bitwise: the hook sums float32 losses weighted by batch size in float64, the hand check averages in float32)
    assert metrics["Loss"].get_accumulated_value() == pytest.approx(float(torch.stack(hand_losses).mean()), rel=1e-6)
    assert engine.num_updates == 3  # windows of 2, 2 and 1


def test_evaluation_reads_the_models_loss_and_accuracy_and_none_without_one(launched):
    launched()
    engine, *_ = colossal_lite.initialize(OwnLoss(), optimizer_of, verbose=False)
    trainer = Trainer(engine)
    batches = dict_batches(3, seed=5)
    trainer.evaluate(batches, hooks=[hooks.AccuracyHook(Accuracy()), hooks.LossHook()], display_progress=False)
    model = engine.unwrapped_model.eval()
    with torch.no_grad():
        outs = [model(**b) for b in batches]
    correct = sum(int((o["logits"].argmax(-1) == b["labels"]).sum()) for o, b in zip(outs, batches))
    test = trainer.states["metrics"]["test"]
    assert test["Accuracy"].get_accumulated_value() == correct / 12
    # (not bitwise: the hook sums in float64 weighted by batch size, the hand check sums float32 losses)
    assert test["Loss"].get_accumulated_value() == pytest.approx(float(sum(o["loss"] for o in outs) / 3), rel=1e-6)
    # a batch without labels: the model computes no loss, and evaluation records none rather than failing
    output, label, loss = engine.execute_schedule(iter([dict(x=torch.randn(2, 4))]), forward_only=True)
    assert loss is None and label is None and output["logits"].shape == (2, 3)


def test_model_loss_names_another_entry_in_the_engine_loop(launched):
    launched()
    engine, *_ = colossal_lite.initialize(OwnLoss("total"), optimizer_of, ModelLoss(key="total"), verbose=False)
    batch = dict_batches(1)[0]
    engine.zero_grad()
    output, label, loss = engine.execute_schedule(iter([batch]))
    assert loss is output["total"] and label is batch["labels"]
    assert engine.criterion(output, label) is output["total"]  # engine.criterion is the same ModelLoss
    assert engine.step()


def test_a_criterion_gets_a_dict_output_whole_beside_tensor_labels(launched):
    launched()
    batches = dict_batches(2)
    engine, *_ = colossal_lite.initialize(OwnLoss(), optimizer_of, lambda out, y: F.cross_entropy(out["logits"], y),
                                          data_process_func=lambda b: ({"x": b["x"]}, b["labels"]), verbose=False)
    output, label, loss = engine.execute_schedule(iter(batches))
    assert set(output) == {"logits"}  # the model got no labels, so the loss is the criterion's
    assert torch.equal(loss, F.cross_entropy(output["logits"], batches[0]["labels"]))


def test_model_loss_finds_the_first_item_of_a_tuple_only_when_it_is_one_number():
    loss, logits = torch.tensor(1.5), torch.randn(2, 3)
    assert ModelLoss().find((loss, logits)) is loss  # Hugging Face's return_dict=False form
    assert ModelLoss().find((logits, loss)) is None
    assert ModelLoss(key=1).find((logits, loss)) is loss
    assert ModelLoss().find(logits) is None
    assert ModelLoss(key="aux").find(type("Out", (), {"aux": loss})()) is loss  # an attribute of an output object


def test_wrong_setups_say_what_to_fix(launched):
    launched()
    engine, *_ = colossal_lite.initialize(nn.Linear(4, 3), optimizer_of, verbose=False)
    with pytest.raises(RuntimeError, match=r"initialize\(\) got no criterion, so the loss must come from the model, "
                                           r"but its output is a Tensor with no loss under 'loss'.*criterion=torch"):
        Trainer(engine).fit([(torch.randn(2, 4), torch.tensor([0, 1]))], epochs=1, display_progress=False)
    own, *_ = colossal_lite.initialize(OwnLoss(), optimizer_of, verbose=False)
    with pytest.raises(RuntimeError, match=r"a dict with the entries \['logits'\] with no loss under 'loss'\. A "
                                           r"Hugging Face model computes its loss when the batch has 'labels'"):
        own.execute_schedule(iter([dict(x=torch.randn(2, 4))]))
    criterion, *_ = colossal_lite.initialize(OwnLoss(), optimizer_of, nn.CrossEntropyLoss(), verbose=False)
    with pytest.raises(ValueError, match="the batch is a dict with no 'labels' entry, so the criterion has no target"):
        criterion.execute_schedule(iter([dict(x=torch.randn(2, 4))]))
    with pytest.raises(TypeError, match=r"ModelLoss\(key=...\) names the loss .* got 1.5"):
        ModelLoss(key=1.5)
    with pytest.raises(TypeError, match=r"ModelLoss\(num_tokens=...\) must be a function of the batch"):
        ModelLoss(num_tokens=3)


def test_per_token_mean_without_a_token_count_names_model_loss_num_tokens(launched):
    launched(dict(grad_reduction="per-token-mean"))
    engine, *_ = colossal_lite.initialize(OwnLoss(), optimizer_of, verbose=False)
    with pytest.raises(RuntimeError, match=r"criterion=ModelLoss\(num_tokens=lambda batch: count\)"):
        engine.execute_schedule(iter(dict_batches(1)))


def test_accuracy_hook_says_where_logits_and_labels_are_missing(launched):
    launched()
    engine, *_ = colossal_lite.initialize(OwnLoss("total"), optimizer_of, ModelLoss(key="total"), verbose=False)
    trainer = Trainer(engine)
    batches = [dict(x=torch.randn(4, 4), labels=torch.tensor([0, 1, 2, 0]))]

    def renamed(outputs):  # an output whose logits are under another name
        return dict(scores=outputs["logits"], total=outputs["total"])

    class Renamed(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **kw):
            return renamed(self.inner(**kw))

    engine2, *_ = colossal_lite.initialize(Renamed(OwnLoss("total")), optimizer_of, ModelLoss(key="total"),
                                           verbose=False)
    with pytest.raises(ValueError, match=r"no 'logits' entry \(it has \['scores', 'total'\]\): say where the logits "
                                         r"are, e.g. AccuracyHook\(..., logits_from=lambda output: output\['scores'\]\)"):
        Trainer(engine2).evaluate(batches, hooks=[hooks.AccuracyHook(Accuracy())], display_progress=False)
    found = Trainer(engine2)
    found.evaluate(batches, hooks=[hooks.AccuracyHook(Accuracy(), logits_from=lambda out: out["scores"])],
                   display_progress=False)
    assert 0 <= found.states["metrics"]["test"]["Accuracy"].get_accumulated_value() <= 1
    with pytest.raises(TypeError, match=r"AccuracyHook\(labels_from=...\) must be a function"):
        hooks.AccuracyHook(Accuracy(), labels_from="labels")
    assert trainer.engine is engine


def test_the_models_loss_with_a_token_count_makes_no_host_sync(launched):
    from sync_counter import count_syncs

    launched(dict(gradient_accumulation=2, clip_grad_norm=CLIP, grad_reduction="per-token-mean"))
    criterion = ModelLoss(num_tokens=lambda batch: (batch["labels"] >= 0).sum())  # a count on the device
    engine, loader, _, _ = colossal_lite.initialize(OwnLoss(), optimizer_of, criterion, dict_batches(), verbose=False)
    accuracy = hooks.AccuracyHook(Accuracy(), track_train=True)
    trainer = Trainer(engine)
    accuracy.after_hook_is_attached(trainer)
    with count_syncs() as calls:
        it = iter(loader)
        for _ in range(len(loader)):
            engine.zero_grad()
            output, label, loss = engine.execute_schedule(it)
            accuracy.after_train_iter(trainer, output, label, loss)  # the metric stays on the device
            engine.step()
    assert all(not v for v in calls.values()), calls
    assert engine.num_updates == 3
