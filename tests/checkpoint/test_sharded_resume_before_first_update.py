"""ZeRO stage 2/3 on 2 ranks: a Trainer checkpoint taken before the optimizer applied its first update (fp16 steps
skipped by overflow; a nonfinite loss skipped under ``nonfinite_loss='skip'``) resumes, and the resumed run ends
with the model and optimizer state of the run that never stopped, bit for bit.

Such a checkpoint holds no per-parameter optimizer state (Adam has none before its first step), while a fresh
process's state dict has some (torch's ``get_state_dict`` creates it for an optimizer with no gradients): the resume
failed with DCP's "Missing key in checkpoint state_dict: optimizer.state...". One launch runs both cases, and a
fine-tuning run from one of the checkpoints (``finetune=True``), whose Adam must count only its own steps, and a
run whose state is read before its first update (as a checkpoint at step 0 reads it), which must go on unchanged.
"""
from pathlib import Path

import torch
from dist_helpers import run_ranks

SCRIPT = r'''
import sys
import torch
sys.path.insert(0, {tests!r})
import colossal_lite
from colossal_lite.amp import AMP_TYPE
from colossal_lite.cli import main as cli_main
from colossal_lite.core import global_context as gpc
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import LoadCheckpointHook, SaveCheckpointHook
from colossal_lite.utils import barrier, get_dataloader
from engine_helpers import make_model

out = sys.argv[1]
colossal_lite.launch_from_torch(config={{}}, verbose=False)
rank = gpc.get_global_rank()
CASES = {{  # the first step of each is skipped, so the checkpoint at step 1 precedes every update
    "stage2_fp16_overflow": dict(zero=dict(stage=2), fp16=dict(mode=AMP_TYPE.TORCH, init_scale=2.0 ** 20)),
    "stage3_bf16_skip": dict(zero=dict(stage=3), fp16=dict(mode=AMP_TYPE.BF16), nonfinite_loss="skip"),
    # ... and one whose first update is applied, of a model with a parameter the forward never uses (it never
    # gets a gradient, so it has no optimizer state: "Missing key" too, found by the checkpoint probe)
    "stage2_unused_parameter": dict(zero=dict(stage=2)),
}}

class WithUnused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net, self.unused = make_model(), torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.net(x)

def fit(config, steps, save_to=None, resume=None, finetune=False, read_first=False, unused=False):
    gpc.load_config(config)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(48, 6, generator=g), torch.randint(0, 4, (48,), generator=g)
    if config.get("nonfinite_loss") == "skip":
        x[0, 0] = float("nan")  # in the first batch of rank 0: a nonfinite loss there
    model = WithUnused() if unused else make_model()
    engine, loader, *_ = colossal_lite.initialize(
        model, torch.optim.Adam(model.parameters(), lr=0.01), torch.nn.CrossEntropyLoss(),
        get_dataloader(torch.utils.data.TensorDataset(x, y), batch_size=4), verbose=False)
    if read_first:  # what a checkpoint reads (sharded, and whole on every rank) before any update
        engine.sharded_state_dict(as_it_is=True)
        engine.state_dict()
    hooks = [SaveCheckpointHook(1, save_to, save_by_iter=True)] if save_to else []
    if finetune:
        hooks = [LoadCheckpointHook(resume, finetune=True)]
        resume = None
    Trainer(engine).fit(loader, max_steps=steps, hooks=hooks, resume_from=resume, log_dir=False)
    state = engine.state_dict()  # full tensors on every rank (a collective)
    return {{"model": state["model"], "optimizer": state["optimizer"], "num_updates": engine.num_updates}}

results = {{}}
for name, config in CASES.items():
    ckpt, unused = f"{{out}}/{{name}}", "unused" in name
    whole = fit(config, 6, unused=unused)
    first = fit(config, 1, save_to=ckpt, unused=unused)
    barrier()
    resumed = fit(config, 6, resume=ckpt + "/last", unused=unused)
    results[name] = dict(whole=whole, first_updates=first["num_updates"], resumed=resumed)
    if unused:  # its merged file, resumed on the same ZeRO ranks (whole tensors, loaded by name)
        if rank == 0:
            assert cli_main(["ckpt", "merge", ckpt + "/last", ckpt + "-merged.pt"]) == 0
        barrier()
        results[name + "_merged"] = dict(whole=whole, first_updates=1,
                                         resumed=fit(config, 6, resume=ckpt + "-merged.pt", unused=True))
# fine-tuning from such a checkpoint's weights: the optimizer starts from nothing, as a fresh run's does
tuned = fit(dict(zero=dict(stage=2)), 2, resume=f"{{out}}/stage2_fp16_overflow/last", finetune=True)
results["finetune_steps"] = {{k: float(v["step"]) for k, v in tuned["optimizer"]["state"].items()}}
# the optimizer's state read before the first update, as a checkpoint at step 0 reads it: training goes on as if
# it had not been read
results["read_first"] = dict(whole=fit(dict(zero=dict(stage=3)), 3), read=fit(dict(zero=dict(stage=3)), 3, read_first=True))
torch.save(results, f"{{out}}/rank{{rank}}.pt")
gpc.destroy()
'''


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, f"{prefix}{key}.")
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from _leaves(value, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree


def test_sharded_checkpoint_before_the_first_update_resumes_as_the_run_that_never_stopped(tmp_path):
    script = tmp_path / "resume_before_first_update.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parents[1])))
    run_ranks(script, [tmp_path], nproc=2, timeout=240)
    for rank in (0, 1):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        # torch's whole state dict stepped the fresh optimizer at learning rate 0 to make its state, so a fine-tuning
        # run's Adam counted one step more than it took
        steps = results.pop("finetune_steps")
        assert steps and set(steps.values()) == {2.0}, steps
        # and torch's state-dict read stepped an optimizer without state or gradients (Adam's count and the
        # engine's one ahead: the run went on differently)
        read = results.pop("read_first")
        whole, after_read = dict(_leaves(read["whole"])), dict(_leaves(read["read"]))
        assert whole["num_updates"] == 3 and whole.keys() == after_read.keys(), sorted(whole.keys() ^ after_read.keys())
        for key, value in whole.items():
            same = torch.equal(value, after_read[key]) if isinstance(value, torch.Tensor) else value == after_read[key]
            assert same, (rank, key)
        assert set(results) == {"stage2_fp16_overflow", "stage3_bf16_skip", "stage2_unused_parameter",
                                "stage2_unused_parameter_merged"}
        for name, result in results.items():
            assert result["first_updates"] == ("unused" in name), name  # the checkpoint precedes every update
            whole, resumed = dict(_leaves(result["whole"])), dict(_leaves(result["resumed"]))
            assert whole["num_updates"] > 0, name
            assert any(key.startswith("optimizer.state.") for key in whole), name  # Adam's state, compared below
            assert whole.keys() == resumed.keys(), (name, rank, sorted(whole.keys() ^ resumed.keys()))
            for key, value in whole.items():
                same = torch.equal(value, resumed[key]) if isinstance(value, torch.Tensor) else value == resumed[key]
                assert same, (name, rank, key)
