"""Evaluation on two ranks of a model with buffers (BatchNorm): after training each rank's statistics hold its own
last batch's update, and every evaluation, one after ``fit``'s evaluation on the EMA weights included, is of rank
0's model (the one its checkpoints keep), as one process would evaluate it over the whole test set; so is
``trainer.predict`` over a distributed loader, whose rows are gathered from both ranks. Under DDP and under ZeRO
stage 3, whose FSDP2 syncs no buffer at all (its evaluations and predictions mixed the ranks' statistics; found by
the evaluation probe)."""
import json

import torch
from dist_helpers import run_ranks

SCRIPT = '''
import json, sys
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset
import colossal_lite
from colossal_lite.core import global_context as gpc
from colossal_lite.nn.metric import Accuracy
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import AccuracyHook, EMAHook, LossHook
from colossal_lite.utils import get_dataloader

colossal_lite.launch_from_torch(config={}, verbose=False, seed=7)
rank = dist.get_rank()
g = torch.Generator().manual_seed(0)
x, y = torch.randn(63, 6, generator=g), torch.randint(0, 3, (63,), generator=g)
train, test = TensorDataset(x[:40], y[:40]), TensorDataset(x[40:] * 2, y[40:])  # 23 test samples: one repeat

def build():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))

def check(config, fit_hooks, evaluate_in_fit):
    gpc.load_config(config)
    engine, train_loader, test_loader, _ = colossal_lite.initialize(
        build(), lambda params: torch.optim.SGD(params, lr=0.1), nn.CrossEntropyLoss(),
        get_dataloader(train, batch_size=4, shuffle=True), get_dataloader(test, batch_size=5), verbose=False)
    trainer = Trainer(engine)
    trainer.fit(train_loader, epochs=1, test_dataloader=test_loader if evaluate_in_fit else None, hooks=fit_hooks,
                display_progress=False)
    own = engine.unwrapped_model[1].running_mean.clone()  # this rank's statistics after its last batch
    gathered = [torch.empty_like(own) for _ in range(2)]
    dist.all_gather(gathered, own)
    # rank 0's model (its whole state sent to every rank) over the whole test set in one batch
    state = [engine.state_dict()["model"]]  # (a collective: whole tensors under ZeRO 3)
    dist.broadcast_object_list(state, src=0)
    plain = build()
    plain.load_state_dict(state[0])
    plain.eval()
    with torch.no_grad():
        logits = plain(test.tensors[0])
    expected = {"correct": int((logits.argmax(-1) == test.tensors[1]).sum()),
                "loss": float(nn.functional.cross_entropy(logits, test.tensors[1])), "logits": logits.tolist()}
    predicted = trainer.predict(test_loader).tolist()  # before any evaluation: each rank still has its own statistics
    hooks = lambda: [LossHook(), AccuracyHook(Accuracy())]
    first = trainer.evaluate(test_loader, hooks=hooks())
    second = trainer.evaluate(test_loader, hooks=hooks())
    after = engine.unwrapped_model[1].running_mean.clone()
    together = [torch.empty_like(after) for _ in range(2)]
    dist.all_gather(together, after)
    return dict(differed=not torch.equal(*gathered), together=torch.equal(*together), expected=expected,
                first=first, second=second, predicted=predicted)

# under DDP fit's evaluation runs on the EMA weights and puts the live ones back, each rank's own statistics with
# them; ZeRO 3 leaves each rank its own statistics after training (FSDP2 syncs no buffer)
results = dict(ddp=check(dict(gradient_accumulation=2), [LossHook(), EMAHook(decay=0.8)], True),
               zero3=check(dict(zero=dict(stage=3)), [LossHook()], False))
with open(sys.argv[1] + f".rank{rank}", "w") as f:
    json.dump(results, f)
gpc.destroy()
'''


def test_every_evaluation_is_of_rank_0s_model_on_two_ranks(tmp_path):
    script = tmp_path / "eval_buffers.py"
    script.write_text(SCRIPT)
    run_ranks(script, [tmp_path / "out"], nproc=2, timeout=120)
    results = [json.loads((tmp_path / f"out.rank{rank}").read_text())[kind] for rank in (0, 1) for kind in ("ddp", "zero3")]
    for r in results:
        assert r["differed"], r  # training left each rank with its own statistics: the case under test
        assert r["together"], r
        expected = r["expected"]
        for figures in (r["first"], r["second"]):
            assert round(figures["Accuracy"] * 23) == expected["correct"], r
            # per-batch float32 means summed in float64 against one mean over the set: the same terms in
            # another order, so the last bits may differ
            assert abs(figures["Loss"] - expected["loss"]) < 1e-6, r
        # batches of 5 rows against one of 23: the same products summed in other blocks, so not bit for bit; rank
        # 1's own statistics put its rows off by far more than this tolerance
        assert torch.allclose(torch.tensor(r["predicted"]), torch.tensor(expected["logits"]), atol=1e-5), r
