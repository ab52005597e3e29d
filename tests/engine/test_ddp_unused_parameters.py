"""DDP's "unused parameters" error, met by a model with a parameter that the loss does not use on 2 gloo ranks:
the user reads the config line that fixes it and the parameter's name, on every rank where it happens (torch's own
error is chained beneath), and the line given does fix it."""
import json
import textwrap

import pytest
from dist_helpers import run_ranks

SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    import colossal_lite
    from colossal_lite.core import global_context as gpc
    from colossal_lite.trainer import Trainer


    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(6, 8)
            self.head = torch.nn.Linear(8, 4)
            self.aux_head = torch.nn.Linear(8, 2)  # never used in forward: DDP waits for its gradient

        def forward(self, x):
            return self.head(torch.tanh(self.body(x)))


    loop, out, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    colossal_lite.launch_from_torch(config=dict(torch_ddp=dict(broadcast_buffers=False)), overrides=overrides,
                                    verbose=False)
    rank = gpc.get_global_rank()
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(4, 6, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(3)]
    torch.manual_seed(0)
    model = TwoHeads()
    engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                    torch.nn.CrossEntropyLoss(), batches, verbose=False)
    result = {}
    try:
        if loop == "trainer":
            Trainer(engine).fit(loader, epochs=1)
        else:
            for x, y in loader:
                engine.zero_grad()
                engine.backward(engine.criterion(engine(x), y))
                engine.step()
    except RuntimeError as err:
        result = {"error": str(err), "cause": str(err.__cause__)}
    result["updates"] = engine.num_updates
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)
''')


@pytest.mark.parametrize("loop", ["engine", "trainer"])
def test_every_rank_reads_the_config_line_that_fixes_it(tmp_path, loop):
    script = tmp_path / "unused.py"
    script.write_text(SCRIPT)
    run_ranks(script, [loop, tmp_path], nproc=2, timeout=180)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        error = result.get("error", "")
        assert error.startswith(f"DDP on rank {rank}: the last backward gave no gradient to the parameters "
                                f"aux_head.weight, aux_head.bias of the model"), result
        assert "Fix: write torch_ddp = dict(broadcast_buffers=False, find_unused_parameters=True) in the config " \
               "(or --set torch_ddp.find_unused_parameters=True" in error
        assert "Expected to have finished reduction in the prior iteration" in result["cause"]  # torch's, chained
        assert result["updates"] == 1  # the first step ran; the second forward found the missing gradients


def test_the_fix_it_names_trains(tmp_path):
    script = tmp_path / "unused.py"
    script.write_text(SCRIPT)
    run_ranks(script, ["trainer", tmp_path, "torch_ddp.find_unused_parameters=True"], nproc=2, timeout=180)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {"updates": 3}
