"""An engine loop resumed with ``save_checkpoint`` / ``load_checkpoint`` continues the run it was saved from.

The loop is docs/lr_scheduler.md's: ``gradient_accumulation=2``, the scheduler ``initialize`` returned stepped
after every micro-batch. It is saved at an update boundary, then everything is built anew (launch, model,
optimizer, scheduler, ``initialize``), the file is loaded, and the rest of the data runs. The LR of each update,
the loss scale after each update and the final parameters and buffers must be the uninterrupted run's, bit for
bit: fp32, torch AMP fp16 and naive fp16 (fp16 autocast runs on the CPU too). One micro-batch after the resume
point overflows, so the fp16 runs also skip an update and back the scale off after it.
"""
import pytest
import torch
from engine_helpers import make_batches, make_model

import colossal_lite
from colossal_lite.amp import AMP_TYPE
from colossal_lite.core import global_context as gpc
from colossal_lite.nn.lr_scheduler import CosineAnnealingWarmupLR
from colossal_lite.utils import load_checkpoint, save_checkpoint

LOSS = torch.nn.CrossEntropyLoss()
BATCHES = make_batches(12)  # 6 windows of 2 micro-batches
SAVED_AT = 6                # micro-batches run before the save: update k = 3
POISONED = 8                # fp16: this micro-batch's loss is multiplied by inf (an overflow, a skipped update)
FP16 = {
    "fp32": None,
    "torch_amp": dict(mode=AMP_TYPE.TORCH, init_scale=2.0 ** 10, growth_interval=2),
    "naive": dict(mode=AMP_TYPE.NAIVE, initial_scale=2.0 ** 10, growth_interval=2, hysteresis=1),
}


@pytest.fixture(autouse=True)
def _fresh_context():
    gpc.destroy()
    yield
    gpc.destroy()


def _build(fp16, seed=0):
    """A new process's state: launch, model, optimizer, scheduler, ``initialize``."""
    gpc.destroy()
    config = dict(gradient_accumulation=2, nonfinite_loss="ignore")
    if fp16 is not None:
        config["fp16"] = dict(fp16)
    colossal_lite.launch_from_torch(config=config, seed=1024, verbose=False)
    model = make_model(seed=seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = CosineAnnealingWarmupLR(optimizer, total_steps=6, warmup_steps=2)
    return model, optimizer, scheduler


def _run(engine, scheduler, loader, first_index, log):
    """The page's loop; appends ``(LR the update used, loss scale after it)`` for each real update."""
    for i, (x, y) in enumerate(loader, start=first_index):
        lr = engine.optimizer.param_groups[0]["lr"]
        engine.zero_grad()
        loss = engine.criterion(engine(x), y)
        if i == POISONED and engine.loss_scale is not None:  # fp32 would apply the inf
            loss = loss * float("inf")
        engine.backward(loss)
        if engine.step():
            log.append((lr, engine.loss_scale))
        scheduler.step()


def _uninterrupted(fp16):
    model, optimizer, scheduler = _build(fp16)
    engine, loader, _, scheduler = colossal_lite.initialize(model, optimizer, LOSS, BATCHES, lr_scheduler=scheduler,
                                                            verbose=False)
    log = []
    _run(engine, scheduler, loader, 0, log)
    return log, engine.unwrapped_model.state_dict()


def _saved_run(fp16, file):
    model, optimizer, scheduler = _build(fp16)
    engine, loader, _, scheduler = colossal_lite.initialize(model, optimizer, LOSS, BATCHES[:SAVED_AT],
                                                            lr_scheduler=scheduler, verbose=False)
    log = []
    _run(engine, scheduler, loader, 0, log)
    save_checkpoint(file, 0, model, optimizer, scheduler)
    return log


def _resumed_run(fp16, file, log):
    model, optimizer, scheduler = _build(fp16, seed=7)  # other initial weights: all must come from the file
    engine, loader, _, scheduler = colossal_lite.initialize(model, optimizer, LOSS, BATCHES[SAVED_AT:],
                                                            lr_scheduler=scheduler, verbose=False)
    assert load_checkpoint(file, model, optimizer, scheduler) == 0
    _run(engine, scheduler, loader, SAVED_AT, log)
    return engine.unwrapped_model.state_dict()


def _assert_same_run(log, state, expected_log, expected_state):
    assert [lr for lr, _ in log] == [lr for lr, _ in expected_log], "the LR of each update"
    assert [scale for _, scale in log] == [scale for _, scale in expected_log], "the loss scale after each update"
    assert state.keys() == expected_state.keys()
    for name, tensor in state.items():
        assert torch.equal(tensor, expected_state[name]), name


@pytest.mark.parametrize("precision", sorted(FP16))
def test_engine_loop_resumed_at_an_update_continues_the_uninterrupted_run(tmp_path, precision):
    fp16 = FP16[precision]
    expected_log, expected_state = _uninterrupted(fp16)
    assert len(expected_log) == (5 if fp16 else 6)  # fp16: the poisoned window's update is skipped
    if fp16:
        assert len(set(scale for _, scale in expected_log)) >= 3, "the scale should grow and back off"
    log = _saved_run(fp16, tmp_path / "ck.pt")
    assert log == expected_log[:3]
    state = _resumed_run(fp16, tmp_path / "ck.pt", log)
    _assert_same_run(log, state, expected_log, expected_state)


def _write_file_of_the_older_format(file):
    """What ``save_checkpoint`` wrote before it stored the engine's state: no update count, no loss scale."""
    saved = torch.load(file, weights_only=True)
    del saved["engine"]
    torch.save(saved, file)


def test_a_file_of_the_older_format_still_continues_the_schedule(tmp_path):
    expected_log, expected_state = _uninterrupted(None)
    log = _saved_run(None, tmp_path / "ck.pt")
    _write_file_of_the_older_format(tmp_path / "ck.pt")
    state = _resumed_run(None, tmp_path / "ck.pt", log)
    _assert_same_run(log, state, expected_log, expected_state)


def test_a_file_of_the_older_format_loads_under_fp16_and_says_the_loss_scale_starts_afresh(tmp_path):
    fp16 = FP16["torch_amp"]
    log = _saved_run(fp16, tmp_path / "ck.pt")
    _write_file_of_the_older_format(tmp_path / "ck.pt")
    model, optimizer, scheduler = _build(fp16, seed=7)
    engine, _, _, scheduler = colossal_lite.initialize(model, optimizer, LOSS, lr_scheduler=scheduler, verbose=False)
    with pytest.warns(UserWarning, match=r"ck\.pt holds no loss scale .* starts from its initial value"):
        load_checkpoint(tmp_path / "ck.pt", model, optimizer, scheduler)
    assert engine.num_updates == len(log) == 3  # the count the scheduler had seen: the schedule continues
    assert engine.loss_scale == 2.0 ** 10
