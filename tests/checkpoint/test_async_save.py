"""Asynchronous saves (``async_save=True``) and verified loads that read each file once, in one process.

The asynchronous run is compared bit for bit with the synchronous one it replaces: the same folders,
the same tensors in them, the same final parameters and buffers. The state is changed in place
right after a save returns, as training does, and the checkpoint must still hold the state of
the moment it was taken.
"""
import gc
import json
import logging
import os
import signal

import pytest
import torch
from dist_helpers import REPO, doc_python_blocks
from torch import nn
from torch.utils.data import TensorDataset

import colossal_lite
from colossal_lite.checkpoint import CheckpointDamagedError, CheckpointManager, load_file
from colossal_lite.checkpoint.io import save_file
from colossal_lite.checkpoint.reader import read_checkpoint
from colossal_lite.checkpoint.staging import HostStage
from colossal_lite.core import global_context as gpc
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.checkpointing import TrainingPreempted
from colossal_lite.trainer.hooks import BaseHook, LossHook, LRSchedulerHook, SaveCheckpointHook
from colossal_lite.utils import get_dataloader


def _run(folder, async_save, logger=None, epochs=2):
    gpc.destroy()
    colossal_lite.launch_from_torch(config=dict(gradient_accumulation=2), seed=5, verbose=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)  # changes param_groups in place after each save
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
    engine, loader, _, sched = colossal_lite.initialize(model, opt, nn.CrossEntropyLoss(),
                                                        get_dataloader(data, shuffle=True, batch_size=4),
                                                        lr_scheduler=sched, verbose=False)
    trainer = Trainer(engine, logger=logger)
    hooks = [LossHook(), LRSchedulerHook(sched, by_epoch=False),
             SaveCheckpointHook("3ba", folder, async_save=async_save, keep_last_n=3, save_best=("Loss", "min"))]
    history = trainer.fit(loader, epochs=epochs, hooks=hooks)
    gpc.destroy()
    return model, history


def _tensors(tree, prefix=""):
    """Every tensor in a nested state, by its path."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_tensors(v, f"{prefix}/{k}"))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(_tensors(v, f"{prefix}/{i}"))
    return out


@pytest.mark.slow  # two whole runs
def test_async_fit_equals_the_synchronous_fit_bit_for_bit_and_reports_its_times(tmp_path, caplog):
    sync_model, _ = _run(tmp_path / "sync", False)
    logger = logging.getLogger("test_async_save")
    with caplog.at_level(logging.INFO, logger="test_async_save"):
        async_model, history = _run(tmp_path / "async", True, logger)
    for (name, a), b in zip(sync_model.state_dict().items(), async_model.state_dict().values()):
        assert torch.equal(a, b), name  # parameters and BatchNorm buffers
    folders = sorted(os.listdir(tmp_path / "sync"))
    assert folders == sorted(os.listdir(tmp_path / "async"))  # the same checkpoints kept, last/best, no leftover
    assert [n for n in folders if n.startswith("epoch")][-3:] == ["epoch1-step12", "epoch1-step15", "epoch1-step16"]
    for pointer in ("last", "best"):
        assert (tmp_path / "sync" / pointer).read_text() == (tmp_path / "async" / pointer).read_text()
    for name in (n for n in folders if n.startswith("epoch")):
        shared_s, rank_s = read_checkpoint(tmp_path / "sync" / name)
        shared_a, rank_a = read_checkpoint(tmp_path / "async" / name)
        for part_s, part_a in ((shared_s["engine"], shared_a["engine"]), (shared_s["lr_schedulers"],
                                                                             shared_a["lr_schedulers"]),
                               (rank_s["rng"], rank_a["rng"]), (rank_s["data"], rank_a["data"])):
            ts, ta = _tensors(part_s), _tensors(part_a)
            assert ts.keys() == ta.keys() and all(torch.equal(ts[k], ta[k]) for k in ts), name
        assert shared_s["engine"]["optimizer"]["param_groups"] == shared_a["engine"]["optimizer"]["param_groups"]
        assert shared_s["trainer"]["progress"] == shared_a["trainer"]["progress"]
    # each save's times: in the history, the metrics file and the log line
    saves = history["checkpoint/blocking_s"]
    totals = history["checkpoint/total_s"]
    assert len(saves) == len(totals) == 6  # every 3rd of 16 steps, and the final one
    assert all(0 < b <= t for b, t in zip(saves, totals))
    lines = [json.loads(line) for line in (tmp_path / "async" / "metrics.jsonl").read_text().splitlines()]
    assert [r["value"] for r in lines if r["name"] == "checkpoint/blocking_s"] == saves
    assert [r["step"] for r in lines if r["name"] == "checkpoint/total_s"] == [3, 6, 9, 12, 15, 16]
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoint saved:")]
    assert len(logged) == 6 and logged[-1].startswith(f"checkpoint saved: {tmp_path / 'async' / 'epoch1-step16'} "
                                                       f"(training blocked ")
    assert " s; written in " in logged[0] and "; written in " in logged[-1]


def test_a_save_holds_the_state_of_its_moment_and_appears_only_complete(tmp_path):
    m = CheckpointManager(tmp_path / "ck", async_save=True)
    w = torch.randn(512, 512)
    groups = [{"lr": 0.1, "params": [0]}]
    first = m.save("epoch0-step1", {"w": w, "groups": groups}, {"r": torch.arange(3)}, {"loss": 1.0})
    kept = w.clone()
    w.add_(1.0)  # training goes on changing the tensors and the containers in place
    groups[0]["lr"] = 0.5
    assert m.in_flight == first and not first.exists() and not (tmp_path / "ck" / "last").exists()
    assert [n for n in os.listdir(tmp_path / "ck") if n.startswith(".tmp-epoch0-step1-")]
    second = m.save("epoch0-step2", {"w": w, "groups": groups})  # one in flight at most: it waits for the first
    assert first.is_dir() and (tmp_path / "ck" / "last").read_text().strip() == "epoch0-step1"
    assert m.in_flight == second and m.in_flight_waited > 0
    m.wait()
    assert m.in_flight is None and (tmp_path / "ck" / "last").read_text().strip() == "epoch0-step2"
    shared, rank = m.load(first)
    assert torch.equal(shared["w"], kept) and shared["groups"] == [{"lr": 0.1, "params": [0]}]
    assert torch.equal(rank["r"], torch.arange(3))
    shared, _ = m.load("last")
    assert torch.equal(shared["w"], w) and shared["groups"][0]["lr"] == 0.5
    assert [(t.path, t.step) for t in m.finished_saves] == [(first, 1), (second, 2)]
    assert all(0 < t.blocking <= t.total for t in m.finished_saves)
    assert m.finished_saves[1].waited > 0 and m.finished_saves[0].waited == 0


def test_the_host_copy_refills_its_buffers_and_rebuilds_every_container():
    stage = HostStage()
    state = {"w": torch.randn(8, 8), "t": torch.arange(6).view(2, 3).t(), "groups": [{"lr": 0.1}], "n": 3}
    first = stage.copy(state)
    buffer = first["w"].untyped_storage().data_ptr()
    assert first["groups"] is not state["groups"] and first["groups"][0] is not state["groups"][0]
    assert first["t"].stride() == state["t"].stride() and torch.equal(first["t"], state["t"])  # strides kept
    state["w"].add_(1.0)
    second = stage.copy(state)  # the same shapes: the same host buffer, refilled
    assert second["w"].untyped_storage().data_ptr() == buffer and torch.equal(second["w"], state["w"])
    assert second["w"].untyped_storage().data_ptr() != state["w"].untyped_storage().data_ptr()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_tensors_are_copied_into_pinned_memory_and_saved_as_they_were(tmp_path):
    w = torch.randn(1024, 1024, device="cuda")
    copy = HostStage().copy({"w": w})
    assert copy["w"].device.type == "cpu" and copy["w"].is_pinned() and torch.equal(copy["w"], w.cpu())
    m = CheckpointManager(tmp_path / "ck", async_save=True)
    kept = w.cpu()
    m.save("epoch0-step1", {"w": w})
    w.add_(1.0)  # on the device, right after the save returned
    m.wait()
    assert torch.equal(m.load("last")[0]["w"], kept)


def test_tied_tensors_stay_one_tensor_and_module_metadata_is_kept(tmp_path):
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))
    model[1].weight = model[0].weight  # tied weights: one tensor stored twice in the state dict
    state = model.state_dict(keep_vars=True)
    m = CheckpointManager(tmp_path / "ck", async_save=True)
    m.save("epoch0-step1", {"model": state})
    m.wait()
    loaded = m.load("last")[0]["model"]
    assert loaded["0.weight"].untyped_storage().data_ptr() == loaded["1.weight"].untyped_storage().data_ptr()
    assert torch.equal(loaded["0.weight"], model[0].weight.detach())
    assert loaded._metadata == model.state_dict()._metadata


def test_a_verified_load_maps_the_file_and_refuses_damage_before_unpickling(tmp_path):
    path = tmp_path / "state.pt"
    state = {"w": torch.randn(256, 256), "step": 3}
    checksum = save_file(state, path)
    loaded = load_file(path, checksum)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3
    loaded["w"].add_(1.0)  # a copy-on-write view of the file: changing it leaves the file as it was
    assert torch.equal(load_file(path, checksum)["w"], state["w"])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointDamagedError, match=f"checkpoint file {path} is damaged: its checksum is crc32:"):
        load_file(path, checksum)


def test_async_save_on_a_legacy_file_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"SaveCheckpointHook\('ck.pt', async_save=True\): a path ending in .pt is one "
                                         r"legacy file, written by rank 0 at each interval; async_save writes "
                                         r"checkpoint folders: give a folder instead"):
        SaveCheckpointHook(1, "ck.pt", async_save=True)


# -- the end of fit: preemption and errors wait for the save in flight ----------------------------------
class _At(BaseHook):
    """At micro-batch ``at``: raise ``signum`` in this process (a real signal), or raise ``error``."""

    def __init__(self, at, signum=None, error=None):
        super().__init__()
        self.at, self.signum, self.error = at, signum, error

    def after_backward(self, trainer):
        if trainer.state.iteration + 1 == self.at:
            if self.error is not None:
                raise self.error
            signal.raise_signal(self.signum)


def _small_fit(ck, async_save, resume=None, extra=()):
    gpc.destroy()
    colossal_lite.launch_from_torch(config=dict(gradient_accumulation=2), seed=5, verbose=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g))
    engine, loader, _, _ = colossal_lite.initialize(model, opt, nn.CrossEntropyLoss(),
                                                    get_dataloader(data, shuffle=True, batch_size=4), verbose=False)
    try:
        Trainer(engine).fit(loader, epochs=2, resume_from=resume,
                            hooks=[LossHook(), SaveCheckpointHook("3ba", ck, async_save=async_save), *extra])
    finally:
        gpc.destroy()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow  # three fits
def test_sigterm_with_a_save_in_flight_completes_both_and_resumes_exactly(tmp_path):
    want = _small_fit(tmp_path / "reference", False)
    with pytest.raises(TrainingPreempted) as info:  # micro-batch 13: the save of step 6 may still be in flight
        _small_fit(tmp_path / "ck", True, extra=[_At(13, signal.SIGTERM)])
    assert info.value.code == 75 and info.value.checkpoint == tmp_path / "ck" / "epoch1-step7"
    names = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert names == ["epoch0-step3", "epoch1-step6", "epoch1-step7", "last", "metrics.jsonl"]  # complete, no .tmp
    assert (tmp_path / "ck" / "last").read_text().strip() == "epoch1-step7"
    assert all((tmp_path / "ck" / n / "meta.json").is_file() for n in names[:3])
    got = _small_fit(tmp_path / "ck", True, resume="auto")
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_an_error_in_training_lets_the_save_in_flight_finish_and_is_raised_as_it_was(tmp_path):
    with pytest.raises(RuntimeError, match="^a bug in a hook$"):  # micro-batch 8: step 4, the save of step 3 began
        _small_fit(tmp_path / "ck", True, extra=[_At(8, error=RuntimeError("a bug in a hook"))])
    names = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert names == ["epoch0-step3", "last", "metrics.jsonl"]  # in one process it is completed; nothing half-written
    shared, _ = CheckpointManager(tmp_path / "ck").load("last")
    assert shared["trainer"]["progress"]["step"] == 3


def test_the_pages_engine_loop_snippet_prints_what_the_page_says(tmp_path, monkeypatch, capsys):
    page = REPO / "docs" / "checkpoints.md"
    code = doc_python_blocks("docs/checkpoints.md", "Without the Trainer: `CheckpointManager(..., async_save=True)`")
    monkeypatch.chdir(tmp_path)
    exec(compile(code[0], str(page), "exec"), {"__name__": "__snippet__"})
    printed = capsys.readouterr().out.strip()
    assert printed == "[2, 4, 6] ['epoch0-step4', 'epoch0-step6']"
    assert f"It prints `{printed}`" in page.read_text()


def test_no_host_copy_of_the_state_outlives_the_fit(tmp_path):
    """The host buffers an asynchronous save copies the state into are reused from save to save within a fit;
    once the fit returned they were still held through the hook (a host copy of the weights and the optimizer's
    state for as long as the trainer or the hook lives: found by the memory probe)."""
    gpc.destroy()
    colossal_lite.launch_from_torch(config={}, seed=5, verbose=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 64, generator=g), torch.randint(0, 3, (32,), generator=g))
    engine, loader, _, _ = colossal_lite.initialize(model, opt, nn.CrossEntropyLoss(),
                                                    get_dataloader(data, batch_size=8), verbose=False)
    hook = SaveCheckpointHook("2ba", tmp_path, async_save=True)
    trainer = Trainer(engine)
    trainer.fit(loader, epochs=1, hooks=[LossHook(), hook])
    big = 64 * 512  # the first layer's weight: a staged copy of it (or of its Adam moments) has as many elements
    training = {t.untyped_storage().data_ptr() for p in model.parameters() for t in (p, p.grad) if t is not None}
    training |= {v.untyped_storage().data_ptr() for s in opt.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor)}
    others = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.numel() >= big
              and o.untyped_storage().data_ptr() not in training]
    assert others == [], [tuple(o.shape) for o in others]
    gpc.destroy()
