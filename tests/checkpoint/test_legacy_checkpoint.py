"""Legacy ``save_checkpoint``/``load_checkpoint``: optimizer and scheduler really round-trip, DDP either way.

The two-rank case (rank 0 writes, every rank reads) runs in test_checkpoint_manager.py's torchrun test.
"""
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from colossal_lite.checkpoint import CheckpointWriteError, UnsafeCheckpointError, UnsupportedValueError, load_file
from colossal_lite.engine.engine import Engine, EngineLRScheduler
from colossal_lite.nn.lr_scheduler import CosineAnnealingWarmupLR
from colossal_lite.utils.checkpointing import load_checkpoint, save_checkpoint


def _parts(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = CosineAnnealingWarmupLR(opt, total_steps=20, warmup_steps=3)
    return model, opt, sched


def _train(model, opt, sched, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()


def test_resume_from_a_legacy_checkpoint_equals_the_uninterrupted_run(tmp_path):
    model, opt, sched = _parts()
    _train(model, opt, sched, 4, seed=1)
    save_checkpoint(tmp_path / "ck.pt", 2, model, opt, sched)
    _train(model, opt, sched, 4, seed=2)  # the uninterrupted run

    model2, opt2, sched2 = _parts(seed=123)  # different initial weights: everything must come from the file
    assert load_checkpoint(tmp_path / "ck.pt", model2, opt2, sched2) == 2
    assert sched2.last_epoch == 4 and opt2.state[next(model2.parameters())]["step"] == 4
    _train(model2, opt2, sched2, 4, seed=2)
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    assert sched.get_last_lr() == sched2.get_last_lr()


def test_model_only_load_like_legacy_and_old_files_without_optimizer(tmp_path):
    model, opt, sched = _parts()
    torch.save({"epoch": 5, "model": model.state_dict()}, tmp_path / "old.pt")  # what legacy Colossal-AI wrote
    model2, opt2, sched2 = _parts(seed=1)
    with pytest.warns(UserWarning, match="old.pt holds no optimizer state .*left as it is"):
        assert load_checkpoint(tmp_path / "old.pt", model2, opt2) == 5
    assert torch.equal(model2[0].weight, model[0].weight)
    torch.save({"model": model.state_dict()}, tmp_path / "noepoch.pt")
    assert load_checkpoint(tmp_path / "noepoch.pt", model2) == -1


def test_ddp_wrapped_and_plain_models_load_either_way(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model, opt, _ = _parts()
        wrapped = nn.parallel.DistributedDataParallel(model)
        save_checkpoint(tmp_path / "from_ddp.pt", 1, wrapped, opt)
        keys = list(load_file(tmp_path / "from_ddp.pt")["model"])
        assert keys and not any(k.startswith("module.") for k in keys)

        plain, _, _ = _parts(seed=5)
        load_checkpoint(tmp_path / "from_ddp.pt", plain)
        assert torch.equal(plain[0].weight, model[0].weight)

        save_checkpoint(tmp_path / "from_plain.pt", 1, plain)
        target = nn.parallel.DistributedDataParallel(_parts(seed=6)[0])
        load_checkpoint(tmp_path / "from_plain.pt", target)
        assert torch.equal(target.module[0].weight, model[0].weight)

        torch.save({"epoch": 0, "model": wrapped.state_dict()}, tmp_path / "prefixed.pt")  # legacy engine.model save
        fresh, _, _ = _parts(seed=7)
        load_checkpoint(tmp_path / "prefixed.pt", fresh)
        assert torch.equal(fresh[3].bias, model[3].bias)
    finally:
        dist.destroy_process_group()


def test_extra_values_are_stored_and_checked(tmp_path):
    model, opt, sched = _parts()
    save_checkpoint(tmp_path / "ck.pt", 3, model, best_acc=0.9, history=[1, 2], mask=torch.ones(2))
    state = torch.load(tmp_path / "ck.pt", weights_only=True)  # a plain dict anyone can read safely
    assert state["best_acc"] == 0.9 and state["history"] == [1, 2] and torch.equal(state["mask"], torch.ones(2))
    assert state["colossal_lite"]["version"] == __import__("colossal_lite").__version__
    with pytest.raises(ValueError, match=r"cannot use the names \['colossal_lite'\]"):
        save_checkpoint(tmp_path / "x.pt", 0, model, colossal_lite=1)
    with pytest.raises(UnsupportedValueError, match=r"\['fn'\].*is not a tensor or a plain Python value"):
        save_checkpoint(tmp_path / "x.pt", 0, model, fn=object())
    assert not (tmp_path / "x.pt").exists()


def test_engine_wrapped_scheduler_state_loads_into_a_bare_scheduler(tmp_path):
    model, opt, sched = _parts()
    engine = Engine(model, opt)
    wrapped = EngineLRScheduler(sched, engine)
    _train(model, opt, wrapped, 3, seed=1)
    save_checkpoint(tmp_path / "ck.pt", 0, model, opt, wrapped)
    model2, opt2, sched2 = _parts()
    load_checkpoint(tmp_path / "ck.pt", model2, opt2, sched2)
    assert sched2.last_epoch == sched.last_epoch == 3 and sched2.get_last_lr() == sched.get_last_lr()


def test_mismatched_model_lists_keys_and_names_the_file(tmp_path):
    model, opt, _ = _parts()
    save_checkpoint(tmp_path / "ck.pt", 0, model, opt)
    other = nn.Sequential(nn.Linear(4, 9), nn.BatchNorm1d(9), nn.ReLU(), nn.Linear(9, 2), nn.Linear(2, 2))
    with pytest.raises(RuntimeError) as e:
        load_checkpoint(tmp_path / "ck.pt", other)
    msg = str(e.value)
    assert f"cannot load {tmp_path / 'ck.pt'} into the model" in msg
    assert "missing keys (2): 4.bias, 4.weight" in msg
    assert "shape mismatches" in msg and "0.weight: checkpoint (8, 4) vs model (9, 4)" in msg
    small, small_opt, _ = _parts()
    small_opt = torch.optim.Adam(small[0].parameters())
    with pytest.raises(ValueError, match="cannot load the optimizer state of .*ck.pt into this optimizer"):
        load_checkpoint(tmp_path / "ck.pt", small, small_opt)


def test_tampered_file_is_refused_and_a_failed_write_keeps_the_old_file(tmp_path):
    model, opt, _ = _parts()
    marker = tmp_path / "marker"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"epoch": 1, "model": model.state_dict(), "x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(UnsafeCheckpointError, match="refused to load .*evil.pt"):
        load_checkpoint(tmp_path / "evil.pt", model)
    assert not marker.exists()

    save_checkpoint(tmp_path / "ck.pt", 1, model, opt)
    (tmp_path / "ck.pt.d").mkdir()
    os.replace(tmp_path / "ck.pt.d", tmp_path / "busy.pt")  # a folder where the file should go
    with pytest.raises(CheckpointWriteError, match="could not write checkpoint .*busy.pt"):
        save_checkpoint(tmp_path / "busy.pt", 2, model, opt)
    assert load_checkpoint(tmp_path / "ck.pt", model, opt) == 1
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
