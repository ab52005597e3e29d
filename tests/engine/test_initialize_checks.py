"""initialize() refuses the ordinary mistakes that would otherwise train silently wrong.

A launcher started N processes but no process group joins them; the loader's batch size is not the
config's micro_batch_size; the criterion is a class; and the nonfinite_loss key reaches the Engine.
"""
import re
from pathlib import Path

import pytest
import torch
from dist_helpers import run_python, run_ranks
from engine_helpers import make_model

import colossal_lite
from colossal_lite.context import Config
from colossal_lite.context.features import describe_features
from colossal_lite.core import global_context as gpc
from colossal_lite.utils import get_dataloader

NO_LAUNCH = r'''
import sys, os, torch
import colossal_lite
model = torch.nn.Linear(4, 2)
try:
    engine, loader, *_ = colossal_lite.initialize(model, lambda p: torch.optim.SGD(p, lr=0.1),
                                                  torch.nn.CrossEntropyLoss(), verbose=False)
    engine.zero_grad()
    engine.backward(engine.criterion(engine(torch.randn(8, 4)), torch.zeros(8, dtype=torch.long)))
    engine.step()
    result = f"trained one step, world size {colossal_lite.core.global_context.get_world_size()}"
except RuntimeError as e:
    result = f"error: {e}"
with open(sys.argv[1] + "." + os.environ.get("RANK", "plain"), "w") as f:
    f.write(result)
'''


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def test_forgetting_launch_under_torchrun_fails_on_every_rank_and_a_plain_run_still_works(tmp_path):
    script = tmp_path / "no_launch.py"
    script.write_text(NO_LAUNCH)
    out = tmp_path / "result"
    run_ranks(script, [out], nproc=2, timeout=60)
    for rank in (0, 1):
        msg = Path(f"{out}.{rank}").read_text()
        assert msg.startswith("error: initialize: this process is one of 2 started together (WORLD_SIZE=2)"), msg
        assert "each process would train its own copy of the model" in msg, msg
        assert "Fix: call colossal_lite.launch_from_torch(config=...) before colossal_lite.initialize(...)" in msg, msg
    run_python(script, [out], timeout=60)
    assert Path(f"{out}.plain").read_text() == "trained one step, world size 1"


@pytest.mark.parametrize("env,launcher", [
    (dict(SLURM_PROCID="1", SLURM_NTASKS="4"), "launch_from_slurm(config=..., host=..., port=...)"),
    (dict(SLURM_PROCID="0", SLURM_NPROCS="2"), "launch_from_slurm(config=..., host=..., port=...)"),
    (dict(OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK="0"), "launch_from_openmpi(config=..., host=..., port=...)"),
])
def test_slurm_and_openmpi_environments_name_their_launch_call(monkeypatch, env, launcher):
    gpc.destroy()
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(RuntimeError) as e:
        colossal_lite.initialize(make_model(), _sgd, verbose=False)
    size_var = next(k for k in env if k.endswith(("NTASKS", "NPROCS", "SIZE")))
    assert f"one of {env[size_var]} started together ({size_var}={env[size_var]})" in str(e.value)
    assert f"Fix: call colossal_lite.{launcher} before colossal_lite.initialize(...)" in str(e.value)


def test_a_one_process_environment_or_a_launched_group_is_fine(monkeypatch, launched):
    gpc.destroy()
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    colossal_lite.initialize(make_model(), _sgd, verbose=False)  # one task: nothing to join
    monkeypatch.setenv("SLURM_NTASKS", "2")
    launched()  # the process group exists: the user chose how to launch
    colossal_lite.initialize(make_model(), _sgd, verbose=False)


def test_criterion_passed_as_a_class_is_refused(launched):
    launched()
    with pytest.raises(TypeError, match=re.escape("got the class CrossEntropyLoss, not a loss function; "
                                                  "pass an instance: CrossEntropyLoss()")):
        colossal_lite.initialize(make_model(), _sgd, torch.nn.CrossEntropyLoss, verbose=False)


def test_classes_given_for_instances_and_a_scheduler_of_another_optimizer_are_refused(launched):
    """Found by a probe: a model class that needs arguments failed with torch's bare TypeError; an optimizer class
    trained silently at its default learning rate; a scheduler built on another optimizer left the LR unchanged
    all run (torch's only word a warning about the order of step calls)."""
    launched()
    with pytest.raises(TypeError, match=re.escape("initialize(model=...): got the class Linear, and building it with "
                                                  "no arguments failed (")):
        colossal_lite.initialize(torch.nn.Linear, _sgd, verbose=False)
    model = make_model()
    with pytest.raises(TypeError, match=re.escape("initialize(optimizer=...): got the class SGD, not an optimizer; "
                                                  "pass SGD(model.parameters(), lr=...) or a function that builds one "
                                                  "from the parameters: lambda params: SGD(params, lr=...)")):
        colossal_lite.initialize(model, torch.optim.SGD, verbose=False)
    other = torch.optim.SGD(make_model().parameters(), lr=0.1)
    with pytest.raises(ValueError, match=re.escape("initialize(lr_scheduler=...): the StepLR was built on another "
                                                   "optimizer than the one given to initialize")):
        colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), verbose=False,
                                 lr_scheduler=torch.optim.lr_scheduler.StepLR(other, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # the scheduler on the optimizer given: accepted
    *_, sched = colossal_lite.initialize(model, opt, verbose=False, lr_scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))
    assert sched is not None


def _dataset(n=256):
    return torch.utils.data.TensorDataset(torch.randn(n, 6), torch.randint(0, 4, (n,)))


@pytest.mark.parametrize("make_loader", [
    lambda ds: torch.utils.data.DataLoader(ds, batch_size=32),
    lambda ds: torch.utils.data.DataLoader(
        ds, batch_sampler=torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(ds), 32, False)),
    lambda ds: get_dataloader(ds, batch_size=32),
], ids=["batch_size", "batch_sampler", "get_dataloader"])
def test_loader_batch_that_is_not_micro_batch_size_is_refused_with_the_arithmetic(launched, make_loader):
    launched(dict(micro_batch_size=16, global_batch_size=64))
    with pytest.raises(ValueError) as e:
        colossal_lite.initialize(make_model(), _sgd, torch.nn.CrossEntropyLoss(), make_loader(_dataset()), verbose=False)
    msg = str(e.value)
    assert "the train loader's batch size is 32, but the config (<dict config>) has micro_batch_size = 16" in msg, msg
    assert "micro_batch_size x data-parallel size x gradient_accumulation = 16 x 1 x 4 = 64 (global batch)" in msg, msg
    assert "this loader gives 32 x 1 x 4 = 128 samples per optimizer step" in msg, msg
    assert "Fix: build the loader with batch_size=16" in msg and "or write micro_batch_size = 32" in msg, msg


def test_batch_mismatch_names_the_config_line(launched, tmp_path):
    path = tmp_path / "cfg.py"
    path.write_text("BATCH = 8\nmicro_batch_size = 4\ngradient_accumulation = 'auto'\n")
    launched(str(path))
    loader = torch.utils.data.DataLoader(_dataset(), batch_size=8)
    with pytest.raises(ValueError) as e:
        colossal_lite.initialize(make_model(), _sgd, torch.nn.CrossEntropyLoss(), loader, verbose=False)
    assert f"the config ({path.resolve()}:2) has micro_batch_size = 4" in str(e.value)
    assert "micro_batch_size x data-parallel size = 4 x 1 = 4 (global batch)" in str(e.value)


def test_get_dataloader_takes_micro_batch_size_and_initialize_accepts_it(launched):
    launched(dict(micro_batch_size=16, global_batch_size=64))
    loader = get_dataloader(_dataset())
    assert loader.batch_size == 16
    engine, train_loader, *_ = colossal_lite.initialize(make_model(), _sgd, torch.nn.CrossEntropyLoss(), loader,
                                                        verbose=False)
    assert len(next(iter(train_loader))[0]) == 16 and engine.window.size == 4


@pytest.mark.parametrize("accumulation,engine_batch", [(2, 8), (None, 4), (4, None)])
def test_an_engine_with_its_own_accumulation_names_the_global_batch_it_trains_on(launched, tmp_path, capfd,
                                                                                 accumulation, engine_batch):
    """An engine's own gradient_accumulation under a config whose global_batch_size implies another was taken
    without a word, while the launch log states the config's batch (found by a probe)."""
    path = tmp_path / "cfg.py"
    path.write_text("micro_batch_size = 4\nglobal_batch_size = 16\n")
    launched(str(path))
    loader = get_dataloader(_dataset())
    engine, *_ = colossal_lite.initialize(make_model(), _sgd, torch.nn.CrossEntropyLoss(), loader, verbose=False,
                                          config=dict(gradient_accumulation=accumulation))
    assert engine.window.size == (accumulation or 1)
    out = capfd.readouterr()
    warnings = [line for line in (out.out + out.err).splitlines() if "global batch" in line]
    if engine_batch is None:  # 4 x 1 x 4 = 16: the configured batch, nothing to say
        assert warnings == []
        return
    assert len(warnings) == 1, warnings
    assert (f"initialize(config=dict(gradient_accumulation={accumulation!r})): this engine's global batch is "
            f"micro_batch_size x data-parallel size x gradient_accumulation = 4 x 1 x {accumulation or 1} = "
            f"{engine_batch} samples per optimizer step, not the config's global_batch_size = 16 "
            f"({path.resolve()}:2)") in warnings[0], warnings


def test_nonfinite_loss_reaches_the_engine_and_the_summary(launched):
    launched()
    engine, *_ = colossal_lite.initialize(make_model(), _sgd, verbose=False)
    assert engine.nonfinite_loss == "raise"
    assert not any("non-finite" in line for line in describe_features(Config()))
    launched(dict(nonfinite_loss="skip"))
    engine, *_ = colossal_lite.initialize(make_model(), _sgd, verbose=False)
    assert engine.nonfinite_loss == "skip"
    assert "non-finite loss: an optimizer update whose window had an inf/NaN loss is skipped (one host read per update)" \
        in describe_features(gpc.config)
    assert "non-finite loss: not checked (an inf/NaN loss is applied like any other)" in \
        describe_features(Config(dict(nonfinite_loss="ignore")))


UNDIVIDED = r'''
import sys
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
import colossal_lite
from colossal_lite.core import global_context as gpc
from colossal_lite.utils import get_dataloader

colossal_lite.launch_from_torch(config={}, verbose=False)
data = TensorDataset(torch.randn(16, 6), torch.randint(0, 3, (16,)))
loaders = dict(plain=DataLoader(data, batch_size=4, shuffle=True), divided=get_dataloader(data, batch_size=4),
               distributed=DataLoader(data, batch_size=4, sampler=DistributedSampler(data)), batches=[data[:4]])
for name, loader in loaders.items():
    print(f"rank{gpc.get_global_rank()} {name}\n", end="", flush=True)  # one write: the ranks' lines never mix
    model = torch.nn.Linear(6, 3)
    colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.CrossEntropyLoss(), loader,
                             verbose=False)
gpc.destroy()
'''


def test_a_plain_loader_on_several_ranks_is_said_to_give_each_rank_the_whole_dataset(tmp_path):
    """Torch's default sampler gives every rank every sample (the same order under the launch's seed): N ranks
    train on the same batches and nothing fails. Said once, on rank 0; a divided loader, a DistributedSampler or a
    list of batches (each rank its own) hear nothing (found by a probe porting pytorch/examples' mnist)."""
    script = tmp_path / "undivided.py"
    script.write_text(UNDIVIDED)
    out = run_ranks(script, nproc=2, timeout=120)
    text = out.stdout + out.stderr
    said = [line for line in text.splitlines() if "each of the 2 ranks iterates the whole dataset" in line]
    assert len(said) == 1 and "torch's RandomSampler" in said[0] and "get_dataloader" in said[0], text
    order = [line for line in text.splitlines() if line.startswith("rank0 ") or "whole dataset" in line]
    assert order.index(said[0]) == order.index("rank0 plain") + 1, text  # after the plain loader, none later
