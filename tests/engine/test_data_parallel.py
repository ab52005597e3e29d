"""2 ranks on two halves of a batch give the same parameters as 1 process on the whole batch."""
import json

import torch
from dist_helpers import run_ranks
from engine_helpers import make_batches, make_model

RANK_SCRIPT = r'''
import json, sys
import torch
import torch.distributed as dist
sys.path.insert(0, {tests!r})
from engine_helpers import make_batches, make_model
import colossal_lite
from colossal_lite.core import global_context as gpc
from colossal_lite.engine.strategy import AllReduceStrategy, DDPStrategy

colossal_lite.launch_from_torch(config=dict(gradient_accumulation=2, clip_grad_norm=0.05), verbose=False)
rank, world = gpc.get_global_rank(), gpc.get_world_size()
result = {{}}
for name, extra in [("ddp", dict(torch_ddp=dict(broadcast_buffers=False))),
                    ("handler", dict(gradient_handler=[dict(type="DataParallelGradientHandler", bucket_size_mb=0.0001)]))]:
    gpc.load_config(dict(gradient_accumulation=2, clip_grad_norm=0.05, **extra))
    torch.manual_seed(100 + rank)  # different init per rank: initialize must broadcast rank 0's
    model = make_model(seed=rank)
    engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                    torch.nn.CrossEntropyLoss(), make_batches(5, b=8), verbose=False)
    assert isinstance(engine.strategy, DDPStrategy if name == "ddp" else AllReduceStrategy), engine.strategy
    for x, y in loader:
        half = x.shape[0] // world
        x, y = x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        engine.step()
    result[name] = dict(params=[p.detach().tolist() for p in engine.unwrapped_model.parameters()],
                        norm=float(engine.grad_norm))
with open({out!r} + f".rank{{rank}}", "w") as f:
    json.dump(result, f)
gpc.destroy()
'''


def test_two_ranks_equal_one_process_on_whole_batch(tmp_path):
    out = tmp_path / "result"
    script = tmp_path / "ddp_rank.py"
    script.write_text(RANK_SCRIPT.format(tests=str(__import__("pathlib").Path(__file__).parents[1]), out=str(out)))
    run_ranks(script, nproc=2, timeout=180)

    # one process, whole batches, same accumulation and clipping
    model = make_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = make_batches(5, b=8)
    for i in range(0, 5, 2):
        window = batches[i:i + 2]
        opt.zero_grad()
        loss = torch.nn.CrossEntropyLoss()(model(torch.cat([b[0] for b in window])), torch.cat([b[1] for b in window]))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
    for rank in (0, 1):
        result = json.loads((tmp_path / f"result.rank{rank}").read_text())
        for name in ("ddp", "handler"):
            got = result[name]
            for p, q in zip(got["params"], model.parameters()):
                torch.testing.assert_close(torch.tensor(p), q.detach(), rtol=1e-5, atol=1e-6)
            # the clipping norm is the global one, identical on every rank
            assert abs(got["norm"] - float(norm)) < 1e-5
