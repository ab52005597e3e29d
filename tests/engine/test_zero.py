"""ZeRO stages 1/2/3 (torch ZeroRedundancyOptimizer, FSDP2) train to the same parameters as DDP, on 2 ranks."""
import json
from pathlib import Path

import pytest
import torch
from dist_helpers import run_ranks

RANK_SCRIPT = r'''
import json, sys
import torch
sys.path.insert(0, {tests!r})
import colossal_lite
from colossal_lite.amp import AMP_TYPE
from colossal_lite.core import global_context as gpc
from engine_helpers import make_batches

class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
    def forward(self, x):
        return torch.tanh(self.lin(x))

def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), Block(16), Block(16), torch.nn.Linear(16, 4))

colossal_lite.launch_from_torch(config={{}}, verbose=False)
rank, world = gpc.get_global_rank(), gpc.get_world_size()
base = dict(gradient_accumulation=2, clip_grad_norm=0.1)
runs = dict(ddp={{}}, zero1=dict(zero=dict(stage=1)), zero2=dict(zero=dict(stage=2)),
            zero3=dict(zero=dict(stage=3, shard_modules=["Block"])),
            zero3_bf16=dict(zero=dict(stage=3), fp16=dict(mode=AMP_TYPE.BF16)),
            zero3_fp16=dict(zero=dict(stage=3), fp16=dict(mode=AMP_TYPE.TORCH, init_scale=1024.0)),
            zero2_offload=dict(zero=dict(stage=2, offload_optimizer=True)),
            ddp_compile=dict(compile=dict(backend="aot_eager")),
            zero3_compile=dict(zero=dict(stage=3), compile=dict(backend="aot_eager")))
result = {{}}
for name, extra in runs.items():
    gpc.load_config(dict(base, **extra))
    model = build()
    engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.Adam(model.parameters(), lr=0.01),
                                                    torch.nn.CrossEntropyLoss(), make_batches(5, b=8), verbose=False)
    for x, y in loader:
        half = x.shape[0] // world
        x, y = x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        engine.step()
    state = engine.state_dict()  # collective: full state on every rank
    result[name] = dict(params={{k: v.float().tolist() for k, v in state["model"].items()}},
                        norm=float(engine.grad_norm), strategy=engine.strategy.name,
                        opt_keys=len(state["optimizer"]["state"]))
# fit's test mode checks every parameter is finite: under stages 2/3 a rank's shard (a DTensor, which no collective
# takes: the check raised NotImplementedError)
from colossal_lite.trainer import Trainer
for stage in (2, 3):
    gpc.load_config(dict(zero=dict(stage=stage)))
    model = build()
    engine, loader, test_loader, _ = colossal_lite.initialize(
        model, torch.optim.Adam(model.parameters(), lr=0.01), torch.nn.CrossEntropyLoss(), make_batches(2, b=8),
        make_batches(1, b=8), verbose=False)
    trainer = Trainer(engine)
    trainer.fit(loader, epochs=1, test_dataloader=test_loader, test_mode=True, log_dir=False)
    result[f"test_mode_zero{{stage}}"] = str(trainer.test_mode_result)
with open({out!r} + f".rank{{rank}}", "w") as f:
    json.dump(result, f)
gpc.destroy()
'''


@pytest.fixture(scope="module")
def zero_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero")
    script = tmp / "zero_rank.py"
    script.write_text(RANK_SCRIPT.format(tests=str(Path(__file__).parents[1]), out=str(tmp / "result")))
    run_ranks(script, nproc=2, timeout=240)
    return [json.loads((tmp / f"result.rank{r}").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("name,tol", [("zero1", 1e-6), ("zero2", 1e-6), ("zero3", 1e-6), ("zero2_offload", 1e-6),
                                      ("zero3_bf16", 3e-2), ("zero3_fp16", 1e-2), ("ddp_compile", 1e-5),
                                      ("zero3_compile", 1e-5)])
def test_zero_stage_matches_ddp(zero_results, name, tol):
    for res in zero_results:
        ref, got = res["ddp"], res[name]
        assert ref["params"].keys() == got["params"].keys()
        for k in ref["params"]:
            torch.testing.assert_close(torch.tensor(got["params"][k]), torch.tensor(ref["params"][k]), rtol=tol, atol=tol)
        assert abs(got["norm"] - ref["norm"]) < max(tol, 1e-6) * 10
        # the full optimizer state (Adam moments of every parameter) is recoverable
        assert got["opt_keys"] == ref["opt_keys"] == 8
    assert zero_results[0]["zero1"]["strategy"].startswith("ZeRO stage 1")
    assert zero_results[0]["zero3"]["strategy"].startswith("ZeRO stage 3")


def test_test_mode_runs_under_stages_2_and_3(zero_results):
    for res in zero_results:
        for stage in (2, 3):
            assert res[f"test_mode_zero{stage}"].endswith("loss finite: OK"), res[f"test_mode_zero{stage}"]
