"""Engine features against the hand-written PyTorch they replace."""
import pytest
import torch
from engine_helpers import make_batches, make_model

import colossal_lite
from colossal_lite.amp import AMP_TYPE

LOSS = torch.nn.CrossEntropyLoss()


def engine_loop(config, batches, epochs=1, lr=0.1, launch=None, opt_cls=torch.optim.SGD, scheduler=None):
    launch(config)
    model = make_model()
    opt = opt_cls(model.parameters(), lr=lr)
    sched = scheduler(opt) if scheduler else None
    engine, loader, _, sched = colossal_lite.initialize(model, opt, LOSS, batches, lr_scheduler=sched, verbose=False)
    updates = []
    for _ in range(epochs):
        for x, y in loader:
            engine.zero_grad()
            out = engine(x)
            loss = engine.criterion(out, y)
            engine.backward(loss)
            updates.append(engine.step())
            if sched is not None:
                sched.step()
    return engine, updates, sched


def hand_accumulation(batches, n, epochs=1, lr=0.1, clip=0.0):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    norms = []
    for _ in range(epochs):
        for i in range(0, len(batches), n):
            window = batches[i:i + n]
            x = torch.cat([b[0] for b in window])
            y = torch.cat([b[1] for b in window])
            opt.zero_grad()
            LOSS(model(x), y).backward()
            if clip:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
            opt.step()
    return model, norms


@pytest.mark.parametrize("n,num_batches", [(1, 4), (3, 9), (3, 7), (4, 5)])
def test_accumulation_equals_one_big_batch(launched, n, num_batches):
    batches = make_batches(num_batches)
    engine, updates, _ = engine_loop(dict(gradient_accumulation=n), batches, epochs=2, launch=launched)
    ref, _ = hand_accumulation(batches, n, epochs=2)
    for p, q in zip(engine.model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    windows_per_epoch = -(-num_batches // n)
    assert sum(updates) == 2 * windows_per_epoch
    # the last (possibly partial) window of each epoch is applied at its last micro-batch
    assert updates[num_batches - 1] is True
    assert engine.window.micro_step == 0


def test_partial_window_with_unsized_loader(launched):
    """A loader without len: the epoch end is found by reading ahead; the last window of r < N is a mean over r, bit
    for bit the hand loop's loss / r (7 batches in windows of 3: r = 1, and a factor 3 / 1 would not be exact)."""
    batches = make_batches(7)

    class Unsized:
        def __iter__(self):
            return iter(batches)

    launched(dict(gradient_accumulation=3))
    model = make_model()
    engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), LOSS, Unsized(),
                                                    verbose=False)
    for _ in range(2):
        for x, y in loader:
            engine.zero_grad()
            engine.backward(engine.criterion(engine(x), y))
            engine.step()
    ref = make_model()  # the hand loop: each micro-batch's loss divided by its window's real size
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        for start in range(0, len(batches), 3):
            window = batches[start:start + 3]
            opt.zero_grad()
            for x, y in window:
                (LOSS(ref(x), y) / len(window)).backward()
            opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):  # read ahead: the last window's size is known, so exact
        assert torch.equal(p, q)


def test_clipping_equals_hand_written(launched):
    batches = make_batches(6)
    engine, _, _ = engine_loop(dict(gradient_accumulation=2, clip_grad_norm=0.05), batches, launch=launched)
    ref, norms = hand_accumulation(batches, 2, clip=0.05)
    for p, q in zip(engine.model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert isinstance(engine.grad_norm, torch.Tensor)
    torch.testing.assert_close(engine.grad_norm, norms[-1])
    assert norms[-1] > 0.05  # the clip really acted


def test_scheduler_advances_once_per_update(launched):
    batches = make_batches(5)
    engine, updates, sched = engine_loop(
        dict(gradient_accumulation=2), batches, launch=launched,
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    assert sum(updates) == 3
    assert sched.get_last_lr()[0] == pytest.approx(0.1 * 0.5 ** 3)
    assert sched.last_epoch == 3


def test_scheduler_step_passes_its_arguments_through(launched):
    """ReduceLROnPlateau.step(metric): the engine's wrapper hands the metric on, once per update."""
    launched(dict(gradient_accumulation=2))
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
    engine, _, _, sched = colossal_lite.initialize(model, opt, LOSS, lr_scheduler=plateau, verbose=False)
    batches = make_batches(4)
    for i in (0, 2):
        for j, (x, y) in enumerate(batches[i:i + 2]):  # legacy counting: a micro-batch ends at each step()
            engine.zero_grad()
            engine.backward(engine.criterion(engine(x), y))
            assert engine.step() == (j == 1)
        sched.step(1.0)  # the first sets the best; the second is no better: the LR halves
        sched.step(0.1)  # no update since the last step: ignored
    assert plateau.best == 1.0
    assert sched.get_last_lr()[0] == pytest.approx(0.05)


def test_torch_amp_equals_hand_written_autocast_and_scaler(launched):
    batches = make_batches(4)
    engine, _, _ = engine_loop(dict(fp16=dict(mode=AMP_TYPE.TORCH, init_scale=1024.0), clip_grad_norm=1.0),
                               batches, launch=launched)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for x, y in batches:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = LOSS(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
    for p, q in zip(engine.model.parameters(), model.parameters()):
        torch.testing.assert_close(p, q)
    assert engine.loss_scale == scaler.get_scale()


def test_bf16_equals_hand_written_autocast(launched):
    batches = make_batches(4)
    engine, _, _ = engine_loop(dict(fp16=dict(mode=AMP_TYPE.BF16)), batches, launch=launched)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
            loss = LOSS(out, y)
        assert out.dtype == torch.bfloat16
        loss.backward()
        opt.step()
    for p, q in zip(engine.model.parameters(), model.parameters()):
        torch.testing.assert_close(p, q)


def test_naive_amp_equals_hand_written_master_weights(launched):
    batches = make_batches(4)
    engine, _, _ = engine_loop(dict(fp16=dict(mode=AMP_TYPE.NAIVE, initial_scale=256.0)), batches, launch=launched)
    assert all(p.dtype == torch.float16 for p in engine.model.parameters())
    # hand-written: fp16 model, fp32 master copies stepped by the optimizer, loss scaled by 256
    model = make_model().half()
    masters = [p.detach().clone().float().requires_grad_() for p in model.parameters()]
    opt = torch.optim.SGD(masters, lr=0.1)
    for x, y in batches:
        model.zero_grad()
        out = model(x.half()).float()
        (LOSS(out, y) * 256.0).backward()
        for p, m in zip(model.parameters(), masters):
            m.grad = p.grad.float() / 256.0
        opt.step()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                p.copy_(m)
    for p, q in zip(engine.model.parameters(), model.parameters()):
        torch.testing.assert_close(p, q)
    out = engine(batches[0][0])
    assert out.dtype == torch.float32  # outputs come back in fp32


@pytest.mark.parametrize("mode,options", [(AMP_TYPE.TORCH, dict(init_scale=1024.0)),
                                          (AMP_TYPE.NAIVE, dict(initial_scale=1024.0, hysteresis=1))])
def test_fp16_overflow_is_skipped_and_recovered(launched, mode, options):
    launched(dict(fp16=dict(mode=mode, **options), clip_grad_norm=1.0))
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    engine, _, _, sched = colossal_lite.initialize(model, opt, LOSS, lr_scheduler=sched, verbose=False)
    x, y = make_batches(1)[0]
    before = [p.detach().clone() for p in model.parameters()]
    engine.zero_grad()
    engine.backward(engine.criterion(engine(x), y) * torch.tensor(float("inf")))
    assert engine.step() is False  # overflow: the step is skipped
    sched.step()
    assert sched.get_last_lr()[0] == pytest.approx(0.1)  # and the scheduler did not move
    assert engine.loss_scale == pytest.approx(512.0)  # the scale backed off
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    engine.zero_grad()
    engine.backward(engine.criterion(engine(x), y))
    assert engine.step() is True
    sched.step()
    assert sched.get_last_lr()[0] == pytest.approx(0.05)
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n,num_batches", [(2, 4), (3, 5), (7, 7)])
def test_accumulated_gradients_are_bitwise_those_of_dividing_the_loss(launched, dtype, n, num_batches):
    """fp32 backward starts from 1/n instead of dividing the loss: every micro-step's gradients are exactly those
    of the hand-written ``(loss / n).backward()``, including a last partial window (5 batches, n=3: 3 then 2)."""
    batches = [(x.to(dtype), y) for x, y in make_batches(num_batches)]
    launched(dict(gradient_accumulation=n))
    model = make_model().to(dtype)
    engine, loader, _, _ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), LOSS, batches,
                                                    verbose=False)
    ref = make_model().to(dtype)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i, (x, y) in enumerate(loader):
        window_start = i - i % n
        divisor = min(n, num_batches - window_start)
        if i % n == 0:
            ref_opt.zero_grad()
        (LOSS(ref(x), y) / divisor).backward()
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        for p, q in zip(model.parameters(), ref.parameters()):
            assert p.grad.dtype == dtype
            assert torch.equal(p.grad, q.grad), f"micro-step {i}: gradients differ from (loss / {divisor}).backward()"
        engine.step()
        if i % n == n - 1 or i == num_batches - 1:
            ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_a_loss_with_more_than_one_number_still_gets_the_clear_backward_error(launched):
    launched(dict(gradient_accumulation=2))
    model = make_model()
    engine, *_ = colossal_lite.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    x, _ = make_batches(1)[0]
    with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar outputs"):
        engine.backward(engine(x))
