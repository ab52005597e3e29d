"""A loop that calls the module given to ``initialize`` (``model(x)``) instead of ``engine(x)`` on several ranks: the
forward bypasses DDP, whose backward then synchronises nothing, and the ranks trained apart without a word (found
by a probe). The first update refuses, on every rank, before anything is applied; ``engine.model(x)`` (the DDP
module) and ``engine(x)`` train together."""
import json
import textwrap

from dist_helpers import run_ranks

SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    import torch.distributed as dist
    from torch import nn
    import colossal_lite

    out = sys.argv[1]
    colossal_lite.launch_from_torch(config={}, verbose=False)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)  # each rank its own data
    batches = [(torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)) for _ in range(3)]
    results = {}
    for how in ("engine", "engine.model", "model"):  # an engine each, in one launch
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        engine, *_ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                              nn.CrossEntropyLoss(), verbose=False)
        before = [p.detach().clone() for p in model.parameters()]
        forward = {"engine": engine, "engine.model": engine.model, "model": model}[how]
        error = None
        try:
            for x, y in batches:
                engine.zero_grad()
                engine.backward(engine.criterion(forward(x), y))
                engine.step()
        except RuntimeError as e:
            error = str(e)
        weights = [p.detach() for p in model.parameters()]
        gathered = [torch.zeros_like(weights[0]) for _ in range(2)]
        dist.all_gather(gathered, weights[0])
        results[how] = dict(error=error, same_on_ranks=torch.equal(*gathered),
                            updated=not all(torch.equal(a, b) for a, b in zip(before, weights)))
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(results, f)
''')


def test_a_forward_that_bypasses_ddp_is_refused_at_the_first_update(tmp_path):
    script = tmp_path / "bypass.py"
    script.write_text(SCRIPT)
    run_ranks(script, [tmp_path / "out"], nproc=2, timeout=120)
    for rank in range(2):
        for how, got in json.loads((tmp_path / f"out.{rank}.json").read_text()).items():
            if how == "model":
                assert got["error"] == (f"engine.step() on rank {rank}: no forward went through the engine's model "
                                        f"since initialize, so DDP synchronised no gradient and the ranks would train "
                                        f"apart (nothing was updated). The loop calls the module given to initialize "
                                        f"(model(x)): call engine(x), or engine.model(x)")
                assert not got["updated"] and got["same_on_ranks"]
            else:
                assert got["error"] is None and got["updated"] and got["same_on_ranks"], how
