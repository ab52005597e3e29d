"""get_dataloader: shards across ranks, reshuffles every epoch by itself, seeds every worker differently."""
import json
from pathlib import Path

import torch
from dist_helpers import run_ranks
from torch.utils.data import Dataset

from colossal_lite.utils import get_dataloader

SCRIPT = r'''
import json, torch
import colossal_lite
from colossal_lite.core import global_context as gpc
from colossal_lite.utils import get_dataloader
colossal_lite.launch_from_torch(config={{}}, verbose=False)
data = torch.utils.data.TensorDataset(torch.arange(10))
loader = get_dataloader(data, shuffle=True, seed=7, batch_size=2)
epochs = [[int(i) for (b,) in loader for i in b] for _ in range(3)]
with open({out!r} + f".{{gpc.get_global_rank()}}", "w") as f:
    json.dump(epochs, f)
gpc.destroy()
'''


def test_two_ranks_get_disjoint_shards_that_reshuffle(tmp_path):
    out = tmp_path / "order"
    script = tmp_path / "loader_rank.py"
    script.write_text(SCRIPT.format(out=str(out)))
    run_ranks(script, nproc=2, timeout=120)
    r0 = json.loads(Path(f"{out}.0").read_text())
    r1 = json.loads(Path(f"{out}.1").read_text())
    for e in range(3):
        assert len(r0[e]) == len(r1[e]) == 5
        assert sorted(r0[e] + r1[e]) == list(range(10))  # disjoint, covering
    assert r0[0] != r0[1] or r0[1] != r0[2]  # a new order each epoch without set_epoch
    # same seed, same orders on a rerun
    run_ranks(script, nproc=2, timeout=120)
    assert json.loads(Path(f"{out}.0").read_text()) == r0


class RandomItems(Dataset):
    """Each item is a random draw made inside the worker that loads it."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        import random

        import numpy as np
        return torch.tensor([torch.rand(()).item(), random.random(), float(np.random.rand())])


def test_each_worker_gets_its_own_reproducible_seed():
    def draws(seed):
        loader = get_dataloader(RandomItems(), seed=seed, num_workers=2, batch_size=1)
        return torch.cat(list(loader))

    a, b, c = draws(3), draws(3), draws(4)
    torch.testing.assert_close(a, b)  # reproducible from the seed
    assert not torch.equal(a, c)
    # items 0 and 1 come from different workers: every generator differs between them
    assert (a[0] != a[1]).all()


def test_batch_size_comes_from_micro_batch_size_unless_given():
    import colossal_lite
    from colossal_lite.core import global_context as gpc

    data = torch.utils.data.TensorDataset(torch.arange(40))
    gpc.destroy()
    try:
        colossal_lite.launch_from_torch(config=dict(micro_batch_size=8, gradient_accumulation=2), verbose=False)
        loader = get_dataloader(data)
        assert loader.batch_size == 8 and [len(b) for (b,) in loader] == [8] * 5
        assert get_dataloader(data, batch_size=4).batch_size == 4  # an explicit batch size wins
        own = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(data), 10, False)
        assert [len(b) for (b,) in get_dataloader(data, batch_sampler=own, add_sampler=False)] == [10] * 4
    finally:
        gpc.destroy()
    assert get_dataloader(data).batch_size == 1  # no config: torch's default, as before
