"""Two ranks whose training loaders differ in length: fit refuses them at its start, on every rank, with both
counts and the fix, instead of a collective mismatch (gloo) or a hang (NCCL) at the longer rank's extra batch.
The same launch checks get_dataloader over an IterableDataset on two ranks: refused with what to do, and taken
with add_sampler=False (the dataset splits itself)."""
from dist_helpers import run_ranks

SCRIPT = '''
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
import colossal_lite
from colossal_lite.trainer import Trainer
from colossal_lite.utils import get_dataloader

colossal_lite.launch_from_torch(config={}, verbose=False, seed=0, backend="gloo", timeout=60)
rank = dist.get_rank()


class Stream(IterableDataset):
    def __iter__(self):  # this rank's part: every second item from its rank on
        for i in range(rank, 10, dist.get_world_size()):
            yield torch.tensor([float(i)])


try:
    get_dataloader(Stream(), batch_size=2)
    print(f"rank {rank} iterable: accepted\\n", end="", flush=True)
except ValueError as err:
    print(f"rank {rank} iterable refused: {err}\\n", end="", flush=True)
own = get_dataloader(Stream(), batch_size=2, add_sampler=False)
print(f"rank {rank} iterable add_sampler=False: {[b.flatten().tolist() for b in own]}\\n", end="", flush=True)

model = nn.Linear(6, 3)
engine, *_ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                                      verbose=False)
trainer = Trainer(engine)


def batches(n):
    return [(torch.randn(4, 6), torch.randint(0, 3, (4,))) for _ in range(n)]


def unsized(n):
    class Loader:
        def __iter__(self):
            return iter(batches(n))
    return Loader()


trainer.fit(unsized(2), max_steps=2)  # no len() on any rank: nothing to compare, the run goes on
print(f"rank {rank} unsized on both ranks: {engine.num_updates} steps\\n", end="", flush=True)
try:
    trainer.fit(unsized(3) if rank == 0 else batches(3), epochs=1)
except ValueError as err:
    print(f"rank {rank} mixed refused: {err}\\n", end="", flush=True)
loader = DataLoader(TensorDataset(torch.randn(20 + 4 * rank, 6), torch.randint(0, 3, (20 + 4 * rank,))),
                    batch_size=4)  # rank 0: 5 batches, rank 1: 6
trainer.fit(loader, epochs=1)
print(f"rank {rank} trained on uneven loaders\\n", end="", flush=True)
'''


def test_uneven_training_loaders_are_refused_on_every_rank(tmp_path):
    script = tmp_path / "uneven.py"
    script.write_text(SCRIPT)
    proc = run_ranks(script, nproc=2, timeout=120, check=False)
    out, err = proc.stdout, proc.stderr
    assert proc.returncode != 0, out + err
    for r in (0, 1):
        assert (f"rank {r} iterable refused: get_dataloader(Stream(), ...) on 2 ranks: an IterableDataset cannot "
                f"be split over the ranks by a sampler") in out, out + err
        assert f"rank {r} unsized on both ranks: 2 steps" in out, out + err
        assert (f"rank {r} mixed refused: fit(train_dataloader=...): the ranks' training loaders differ in length "
                f"(some have no len() and some do (up to 3 batches); this rank, rank {r}: "
                f"{'no len()' if r == 0 else '3 batches'})") in out, out + err
        # the uneven fit ends both ranks with the error, before any batch: neither trains, neither hangs
        assert (f"ValueError: fit(train_dataloader=...): the ranks' training loaders differ in length (from 5 "
                f"batches to 6 batches; this rank, rank {r}: {5 + r} batches)") in err, out + err
        assert f"rank {r} trained" not in out, out + err
    assert "pass add_sampler=False" in out and "DistributedSampler" in err and "drop_last=True" in err, out + err
    assert "rank 0 iterable add_sampler=False: [[0.0, 2.0], [4.0, 6.0], [8.0]]" in out, out + err
    assert "rank 1 iterable add_sampler=False: [[1.0, 3.0], [5.0, 7.0], [9.0]]" in out, out + err
    assert "Received data size" not in err, out + err  # (gloo's words for the mismatch the check prevents)
