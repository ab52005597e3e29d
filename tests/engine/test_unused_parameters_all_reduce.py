"""Gradients all-reduced by the library (``gradient_accumulation='auto'``, ``DataParallelGradientHandler``) when each
rank's batches leave other parameters unused: every rank must lay out the same buffer. The reduction packed only the
gradients a rank had, so two ranks using two heads of the same size added one head's gradient to the other's (the
ranks drifted apart), and heads of different sizes aborted gloo (found by a probe)."""
import json
import textwrap

import pytest
import torch
from dist_helpers import run_ranks

SCRIPT = textwrap.dedent('''
    import contextlib, json, sys
    import torch
    import colossal_lite
    from colossal_lite.core import global_context as gpc

    mode, out = sys.argv[1], sys.argv[2]

    class Net(torch.nn.Module):
        """A body and two heads of different sizes; which head a batch takes depends on its data."""
        def __init__(self, limit):
            super().__init__()
            torch.manual_seed(0)
            self.body, self.a = torch.nn.Linear(6, 8), torch.nn.Linear(8, 4)
            self.b, self.b2 = torch.nn.Linear(8, 4), torch.nn.Linear(4, 4)
            self.limit = limit
        def forward(self, x):
            if x.shape[0] > self.limit:  # what a batch too large for the device raises
                raise torch.OutOfMemoryError("injected")
            h = torch.tanh(self.body(x))
            return self.a(h) if x[0, 0] > 0 else self.b2(self.b(h))

    config = dict(gradient_accumulation="auto", torch_ddp=dict(find_unused_parameters=True)) if mode == "auto" \\
        else dict(gradient_handler=[dict(type="DataParallelGradientHandler")])
    colossal_lite.launch_from_torch(config=config, verbose=False)
    rank = gpc.get_global_rank()
    g = torch.Generator().manual_seed(10 + rank)
    batches = []
    for _ in range(3):
        x = torch.randn(4, 6, generator=g)
        x[:, 0] = 1.0 if rank == 0 else -1.0  # rank 0 trains head a, rank 1 heads b and b2
        batches.append((x, torch.randint(0, 4, (4,), generator=g)))
    model = Net(limit=2 if mode == "auto" else 100)
    engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                    torch.nn.CrossEntropyLoss(), batches, verbose=False)
    it = iter(loader)
    for _ in batches:
        engine.zero_grad()
        engine.execute_schedule(it)
        engine.step()

    # the hand-written loop: DDP with find_unused_parameters, the batch in the pieces 'auto' trained it in
    ref = Net(limit=100)
    ddp = torch.nn.parallel.DistributedDataParallel(ref, find_unused_parameters=True)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    pieces = 2 if mode == "auto" else 1
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        xs, ys = x.chunk(pieces), y.chunk(pieces)
        for i, (xp, yp) in enumerate(zip(xs, ys)):
            with contextlib.nullcontext() if i == len(xs) - 1 else ddp.no_sync():
                (torch.nn.functional.cross_entropy(ddp(xp), yp) * len(xp) / len(x)).backward()
        opt.step()
    mine = {n: p.detach().tolist() for n, p in model.named_parameters()}
    hand = {n: p.detach().tolist() for n, p in ref.named_parameters()}
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(dict(mine=mine, hand=hand), f)
''')


@pytest.mark.parametrize("mode", ["auto", "handler"])
def test_ranks_that_use_different_parameters_reduce_the_same_buffers(tmp_path, mode):
    script = tmp_path / "unused.py"
    script.write_text(SCRIPT)
    run_ranks(script, [mode, tmp_path / "out"], nproc=2, timeout=120)
    ranks = [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["mine"] == ranks[1]["mine"]  # the ranks hold the same parameters, bit for bit
    for name, values in ranks[0]["mine"].items():
        if mode == "auto":  # the same all-reduce as DDP's: one sum of two terms per element, divided by 2
            assert values == ranks[0]["hand"][name], name
        else:  # (the handler sums the ranks' gradients then divides; DDP divides first: rounding apart)
            assert torch.allclose(torch.tensor(values), torch.tensor(ranks[0]["hand"][name]), atol=1e-6), name
