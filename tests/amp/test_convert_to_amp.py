"""colossal_lite.amp.convert_to_amp: the legacy "AMP modularity" flow in a plain PyTorch loop, on CPU."""
import copy
import math

import pytest
import torch
from engine_helpers import make_batches, make_model
from torch import nn

import colossal_lite
from colossal_lite.amp import (
    AMP_TYPE,
    NaiveAMPModel,
    NaiveAMPOptimizer,
    TorchAMPLoss,
    TorchAMPModel,
    TorchAMPOptimizer,
    convert_to_amp,
    convert_to_apex_amp,
    convert_to_naive_amp,
    convert_to_torch_amp,
)
from colossal_lite.context import ConfigException
from colossal_lite.core import global_context as gpc


def cpu_autocast_supports(dtype) -> bool:
    """Whether torch's CPU autocast computes a matmul in ``dtype`` (fp16 on the CPU came after bf16)."""
    try:
        with torch.autocast("cpu", dtype=dtype):
            return (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == dtype
    except RuntimeError:
        return False


AUTOCAST_MODES = [pytest.param(AMP_TYPE.TORCH, torch.float16, marks=pytest.mark.skipif(
                      not cpu_autocast_supports(torch.float16), reason="this torch has no fp16 CPU autocast")),
                  pytest.param(AMP_TYPE.BF16, torch.bfloat16, marks=pytest.mark.skipif(
                      not cpu_autocast_supports(torch.bfloat16), reason="this torch has no bf16 CPU autocast"))]


def plain_loop(model, optimizer, criterion, batches, epochs=1):
    """The loop of the legacy documentation page, exactly."""
    losses = []
    for _ in range(epochs):
        for x, y in batches:
            optimizer.zero_grad()
            out = model(x)
            loss = criterion(out, y)
            optimizer.backward(loss)
            optimizer.step()
            losses.append(float(loss.detach()))
    return losses


def epoch_losses(losses, n):
    return [sum(losses[i:i + n]) / n for i in range(0, len(losses), n)]


@pytest.mark.parametrize("mode,dtype", AUTOCAST_MODES)
def test_autocast_modes_wrap_model_optimizer_and_criterion_and_train(mode, dtype):
    model, criterion = make_model(), nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    amp_model, amp_opt, amp_loss = convert_to_amp(model, optimizer, criterion, mode)
    assert isinstance(amp_model, TorchAMPModel) and amp_model.model is model
    assert isinstance(amp_opt, TorchAMPOptimizer) and amp_opt.optim is optimizer
    assert isinstance(amp_loss, TorchAMPLoss) and amp_loss.loss is criterion
    assert isinstance(amp_opt, torch.optim.Optimizer) and amp_opt.param_groups is optimizer.param_groups
    x, y = make_batches(1)[0]
    assert amp_model(x).dtype == dtype  # the forward runs under autocast
    assert next(model.parameters()).dtype == torch.float32  # over fp32 weights
    batches = make_batches(4)
    losses = epoch_losses(plain_loop(amp_model, amp_opt, amp_loss, batches, epochs=6), 4)
    assert losses[-1] < losses[0] - 0.05, losses
    if mode is AMP_TYPE.TORCH:
        assert amp_opt.scaler.get_scale() == 2.0 ** 16 and amp_opt.loss_scale == 2.0 ** 16


@pytest.mark.skipif(not cpu_autocast_supports(torch.float16), reason="this torch has no fp16 CPU autocast")
def test_torch_amp_scaler_options_overflow_clip_scheduler_and_state():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp_model, amp_opt, amp_loss = convert_to_torch_amp(model, optimizer, nn.CrossEntropyLoss(),
                                                        dict(init_scale=1024.0, growth_interval=3))
    sched = torch.optim.lr_scheduler.StepLR(amp_opt, step_size=1, gamma=0.5)  # built on the wrapper
    x, y = make_batches(1)[0]
    # an overflowing step is skipped and the scale backs off
    before = [p.detach().clone() for p in model.parameters()]
    amp_opt.zero_grad()
    amp_opt.backward(amp_loss(amp_model(x), y) * float("inf"))
    amp_opt.step()
    sched.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert amp_opt.loss_scale == 512.0
    # clip_grad_norm(model, max_norm) unscales first: the true gradients are clipped, then the step applies them
    amp_opt.zero_grad()
    amp_opt.backward(amp_loss(amp_model(x), y) * 100)
    norm = amp_opt.clip_grad_norm(amp_model, 0.5)
    assert norm > 0.5
    total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    torch.testing.assert_close(total, torch.tensor(0.5), rtol=1e-4, atol=1e-4)
    amp_opt.step()
    sched.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.025)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # state: the scaler travels with the optimizer state; a plain optimizer state dict loads too
    state = copy.deepcopy(amp_opt.state_dict())
    _, fresh_opt, _ = convert_to_torch_amp(make_model(), torch.optim.SGD(make_model().parameters(), lr=0.1))
    fresh_opt.load_state_dict(state)
    assert fresh_opt.loss_scale == 512.0
    fresh_opt.load_state_dict(optimizer.state_dict())


def test_naive_amp_trains_with_fp16_weights_and_fp32_outputs():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    criterion = nn.CrossEntropyLoss()
    amp_model, amp_opt, amp_loss = convert_to_amp(model, optimizer, criterion, AMP_TYPE.NAIVE,
                                                   amp_config=dict(initial_scale=2.0 ** 10))
    assert isinstance(amp_model, NaiveAMPModel) and isinstance(amp_opt, NaiveAMPOptimizer)
    assert amp_loss is criterion  # legacy wraps the criterion only in torch mode
    assert next(model.parameters()).dtype == torch.float16
    assert all(p.dtype == torch.float32 for g in optimizer.param_groups for p in g["params"])  # masters
    x, y = make_batches(1)[0]
    assert amp_model(x).dtype == torch.float32
    losses = epoch_losses(plain_loop(amp_model, amp_opt, amp_loss, make_batches(4), epochs=6), 4)
    assert losses[-1] < losses[0] - 0.05, losses
    assert amp_opt.loss_scale == 2.0 ** 10 and amp_opt.grad_scaler.scale == 2.0 ** 10


@pytest.fixture
def launched():
    def _launch(config):
        gpc.destroy()
        colossal_lite.launch_from_torch(config=config, seed=1, verbose=False)

    yield _launch
    gpc.destroy()


@pytest.mark.parametrize("legacy_form", [False, True], ids=["top-level-clip", "clip-in-fp16"])
@pytest.mark.parametrize("clip", [0.0, 0.3])
def test_naive_amp_matches_the_engine_step_for_step(launched, clip, legacy_form):
    """The same fp16 config through initialize + the Engine loop and through convert_to_amp + a plain loop.
    ``legacy_form``: the clipping norm inside the fp16 dict, as legacy naive fp16 took it (refused before; found
    by a probe): read as the top-level key."""
    fp16 = dict(mode=AMP_TYPE.NAIVE, initial_scale=2.0 ** 12, growth_interval=3)
    batches = make_batches(5)
    launched(dict(fp16={**fp16, "clip_grad_norm": clip}) if legacy_form else dict(fp16=fp16, clip_grad_norm=clip))
    if legacy_form:
        assert "clip_grad_norm" not in gpc.config.fp16 and gpc.config.get("clip_grad_norm") == (clip or None)
    engine_model = make_model()
    engine, _, _, _ = colossal_lite.initialize(engine_model, torch.optim.Adam(engine_model.parameters(), lr=0.01),
                                               nn.CrossEntropyLoss(), verbose=False)
    model = make_model()
    amp_model, amp_opt, criterion = convert_to_amp(model, torch.optim.Adam(model.parameters(), lr=0.01),
                                                   nn.CrossEntropyLoss(), AMP_TYPE.NAIVE,
                                                   amp_config={**fp16, "clip_grad_norm": clip})
    for x, y in batches * 2:
        engine.zero_grad()
        engine_loss = engine.criterion(engine(x), y)
        engine.backward(engine_loss)
        updated = engine.step()
        amp_opt.zero_grad()
        loss = criterion(amp_model(x), y)
        amp_opt.backward(loss)
        amp_opt.clip_grad_norm(amp_model, clip)  # what the legacy Engine called: no second clip
        applied, norm = amp_opt.step()  # legacy FP16Optimizer's (applied, grad_norm): it returned None here
        assert applied is updated and (norm is None) == (not clip or not applied)
        assert torch.equal(loss, engine_loss)
        for p, q in zip(model.parameters(), engine_model.parameters()):
            assert torch.equal(p, q)
    assert amp_opt.loss_scale == engine.precision.loss_scale > 2.0 ** 12  # it grew, the same way


def test_naive_clipping_in_the_fp16_dict_and_at_the_top_level_must_agree():
    from colossal_lite.context import ConfigException
    from colossal_lite.launch import load_config
    same = load_config(dict(fp16=dict(mode=AMP_TYPE.NAIVE, clip_grad_norm=1.0), clip_grad_norm=1.0))
    assert same.clip_grad_norm == 1.0 and dict(same.fp16) == {"mode": AMP_TYPE.NAIVE}
    with pytest.raises(ConfigException, match=r"config key 'fp16.clip_grad_norm': is 0.5 while the top-level "
                                              r"clip_grad_norm is 1.0. Fix: keep one: the top-level clip_grad_norm"):
        load_config(dict(fp16=dict(mode=AMP_TYPE.NAIVE, clip_grad_norm=0.5), clip_grad_norm=1.0))
    with pytest.raises(ConfigException, match=r"config key 'fp16.clip_grad_norm': expected a number >= 0"):
        load_config(dict(fp16=dict(mode=AMP_TYPE.NAIVE, clip_grad_norm=-1)))
    with pytest.raises(ConfigException, match=r"config key 'fp16.clip_grad_norm': is a top-level config key, not an "
                                              r"option of mode TORCH.*Fix: move it to the top level"):
        load_config(dict(fp16=dict(mode=AMP_TYPE.TORCH, clip_grad_norm=1.0)))  # (legacy's GradScaler took none)


def test_naive_loss_scale_backs_off_at_every_overflow_after_the_hysteresis_as_legacy_did():
    """Legacy's DynamicGradScaler counts overflows and resets the count only when the scale grows: after
    ``hysteresis`` overflows every further one backs off. Ours reset the count at each back-off, so a run of
    overflows halved the scale every second step (10 overflows from 2**32: 2**27, not 2**23; found by a probe)."""
    from colossal_lite.amp.precision import DynamicGradScaler
    scaler = DynamicGradScaler(initial_scale=2.0 ** 32, growth_interval=3, hysteresis=2)
    seen = []
    for _ in range(10):
        scaler.update(True)
        seen.append(math.log2(scaler.scale))
    assert seen == [32, 31, 30, 29, 28, 27, 26, 25, 24, 23]
    for _ in range(3):  # the scale grows: the tolerance is back
        scaler.update(False)
    assert math.log2(scaler.scale) == 24
    scaler.update(True)
    assert math.log2(scaler.scale) == 24  # tolerated
    scaler.update(True)
    assert math.log2(scaler.scale) == 23
    state = scaler.state_dict()
    again = DynamicGradScaler(initial_scale=1.0, growth_interval=3, hysteresis=2)
    again.load_state_dict(state)
    again.update(True)  # the resumed scaler backs off at once, as the uninterrupted one would
    assert math.log2(again.scale) == 22


def test_apex_is_refused_and_unknown_options_name_the_known_ones():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigException, match="NVIDIA apex.*AMP_TYPE.TORCH"):
        convert_to_apex_amp(model, optimizer)
    with pytest.raises(ConfigException, match="NVIDIA apex"):
        convert_to_amp(model, optimizer, None, AMP_TYPE.APEX)
    with pytest.raises(ConfigException, match="does not take 'init_scale'.*initial_scale"):
        convert_to_naive_amp(model, optimizer, dict(init_scale=2.0 ** 10))
    with pytest.raises(ConfigException, match="unknown precision mode"):
        convert_to_amp(model, optimizer, None, "fp8")


def _two_rank_naive_amp(rank, world_size, port, results):
    """Each rank trains on its half of every batch through convert_to_naive_amp, its model wrapped in DDP."""
    colossal_lite.launch(config={}, rank=rank, world_size=world_size, host="127.0.0.1", port=port, backend="gloo",
                         seed=3, verbose=False)
    try:
        model = make_model()
        torch.manual_seed(0)
        ref = copy.deepcopy(model)
        amp_model, amp_opt = convert_to_naive_amp(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                  amp_config=dict(initial_scale=2.0 ** 8))
        amp_model = nn.parallel.DistributedDataParallel(amp_model)  # as legacy initialize did: AMP, then DDP
        losses = []
        for x, y in make_batches(4):
            half = slice(rank * len(x) // 2, (rank + 1) * len(x) // 2)
            amp_opt.zero_grad()
            loss = nn.functional.cross_entropy(amp_model(x[half]), y[half])
            amp_opt.backward(loss)
            amp_opt.step()
            losses.append(float(loss.detach()))
        flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
        gathered = [torch.zeros_like(flat) for _ in range(world_size)]
        torch.distributed.all_gather(gathered, flat)
        moved = max(float((p.detach().float() - q.detach().float()).abs().max())
                    for p, q in zip(model.parameters(), ref.parameters()))
        try:
            convert_to_naive_amp(nn.parallel.DistributedDataParallel(make_model()), torch.optim.SGD(
                ref.parameters(), lr=0.1))
            refused = ""
        except ValueError as err:
            refused = str(err)
        results.put((rank, bool(torch.equal(gathered[0], gathered[1])), moved, losses, refused))
    finally:
        gpc.destroy()


def test_naive_amp_in_a_plain_loop_on_two_ranks_keeps_the_ranks_equal():
    """The legacy flow with DDP: gradients meet across ranks through the AMP optimizer's backward and step."""
    from colossal_lite.testing import spawn

    results = torch.multiprocessing.get_context("spawn").SimpleQueue()
    spawn(_two_rank_naive_amp, nprocs=2, results=results)
    found = sorted(results.get() for _ in range(2))
    for rank, equal, moved, losses, refused in found:
        assert equal, f"rank {rank}: the ranks' parameters differ after training"
        assert moved > 0 and all(loss == loss for loss in losses)
        assert "convert the plain model first, then wrap the returned model in DDP" in refused  # not silent drift
    assert found[0][3] != found[1][3]  # the ranks saw different halves of the data
