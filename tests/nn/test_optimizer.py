"""colossal_lite.nn.optimizer: the legacy optimizers, each a real torch optimizer with the legacy signature."""
import json
import math
from pathlib import Path

import pytest
import torch
from dist_helpers import run_ranks
from engine_helpers import make_batches, make_model
from torch import nn

import colossal_lite
import colossal_lite.nn as cl_nn
from colossal_lite.core import global_context as gpc
from colossal_lite.engine.zero import _constructor_defaults
from colossal_lite.nn.optimizer import CPUAdam, FusedAdam, FusedLAMB, FusedSGD, HybridAdam, Lamb, Lars
from colossal_lite.trainer import Trainer
from colossal_lite.trainer.hooks import LossHook, SaveCheckpointHook

ALL = [Lamb, Lars, FusedSGD, FusedAdam, FusedLAMB, HybridAdam, CPUAdam]


def two_params(p=(3.0, 4.0), g=(0.6, 0.8)):
    """One tensor of 2 parameters with a given gradient."""
    w = torch.tensor(p, dtype=torch.float64, requires_grad=True)
    w.grad = torch.tensor(g, dtype=torch.float64)
    return w


def norm(v):
    return math.sqrt(sum(x * x for x in v))


def test_exported_from_nn_and_optimizer_and_real_torch_optimizers():
    for cls in ALL:
        assert getattr(cl_nn, cls.__name__) is cls
        assert issubclass(cls, torch.optim.Optimizer)


# ---------------------------------------------------------------- LAMB, written out by hand for 2 parameters
def lamb_by_hand(p, g, lr, b1, b2, eps, wd, t, m, v, bias_correction, adam=False, max_ratio=None):
    """One LAMB step (You et al. 2019, Algorithm 2) on plain floats; returns (p, m, v)."""
    m = [b1 * mi + (1 - b1) * gi for mi, gi in zip(m, g)]
    v = [b2 * vi + (1 - b2) * gi * gi for vi, gi in zip(v, g)]
    c1, c2 = (1 - b1 ** t, 1 - b2 ** t) if bias_correction else (1.0, 1.0)
    r = [(mi / c1) / (math.sqrt(vi / c2) + eps) for mi, vi in zip(m, v)]
    u = [ri + wd * pi for ri, pi in zip(r, p)]
    ratio = 1.0 if adam else norm(p) / norm(u)
    if max_ratio is not None:
        ratio = min(ratio, max_ratio)
    return [pi - lr * ratio * ui for pi, ui in zip(p, u)], m, v


@pytest.mark.parametrize("options", [dict(), dict(bias_correction=True), dict(adam=True),
                                     dict(max_trust_ratio=0.5)])
def test_lamb_two_steps_equal_the_formulas(options):
    lr, betas, eps, wd = 0.1, (0.9, 0.999), 1e-6, 0.01
    w = two_params()
    opt = Lamb([w], lr=lr, betas=betas, eps=eps, weight_decay=wd, **options)
    p, m, v = [3.0, 4.0], [0.0, 0.0], [0.0, 0.0]
    for t, g in ((1, [0.6, 0.8]), (2, [-0.2, 0.5])):
        w.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        p, m, v = lamb_by_hand(p, g, lr, *betas, eps, wd, t, m, v, options.get("bias_correction", False),
                               options.get("adam", False), options.get("max_trust_ratio"))
        torch.testing.assert_close(w.detach(), torch.tensor(p, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    if "max_trust_ratio" in options:  # the clamp acted: ||p|| / ||u|| is about 5 / 1.4 here
        assert norm([3.0, 4.0]) / norm([1.0, 1.0]) > 0.5


def test_lamb_legacy_signature_and_defaults():
    w = two_params()
    opt = Lamb([w], 1e-3, (0.9, 0.999), 1e-6, 0, True)  # positional, as legacy programs call it
    assert opt.adam is True
    assert opt.defaults["bias_correction"] is False  # legacy (paper v3): no debiasing
    with pytest.raises(ValueError, match="beta"):
        Lamb([w], betas=(1.0, 0.999))


def test_fused_lamb_clips_by_global_norm_and_adapts_only_decayed_tensors():
    """FusedLAMB: gradients divided by ||g|| / max_grad_norm when above it; no weight decay: ratio 1 (Adam)."""
    lr, betas, eps = 0.1, (0.9, 0.999), 1e-6
    w = two_params(g=(3.0, 4.0))  # global norm 5
    opt = FusedLAMB([w], lr=lr, betas=betas, eps=eps, weight_decay=0.0, max_grad_norm=1.0)
    opt.step()
    g = [3.0 / 5, 4.0 / 5]
    p, _, _ = lamb_by_hand([3.0, 4.0], g, lr, *betas, eps, 0.0, 1, [0, 0], [0, 0], True, adam=True)
    torch.testing.assert_close(w.detach(), torch.tensor(p, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    # with weight decay the trust ratio applies (use_nvlamb=False adapts decayed tensors only)
    w2 = two_params(g=(0.3, 0.4))  # below max_grad_norm: unclipped
    FusedLAMB([w2], lr=lr, betas=betas, eps=eps, weight_decay=0.01).step()
    p, _, _ = lamb_by_hand([3.0, 4.0], [0.3, 0.4], lr, *betas, eps, 0.01, 1, [0, 0], [0, 0], True)
    torch.testing.assert_close(w2.detach(), torch.tensor(p, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedLAMB([w], amsgrad=True)


# ---------------------------------------------------------------- LARS, written out by hand for 2 parameters
def test_lars_two_steps_with_momentum_equal_the_formulas():
    lr, momentum, eeta, wd, eps = 0.5, 0.9, 0.02, 0.1, 1e-3
    w = two_params()
    opt = Lars([w], lr=lr, momentum=momentum, eeta=eeta, weight_decay=wd, epsilon=eps)
    p, buf = [3.0, 4.0], None
    for g in ([0.6, 0.8], [-0.3, 0.4]):
        w.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        # You et al. 2017: local LR = eeta * ||w|| / (||g|| + wd * ||w||); d = g + wd * w; v = m * v + d
        ratio = eeta * norm(p) / (norm(g) + wd * norm(p) + eps)
        d = [gi + wd * pi for gi, pi in zip(g, p)]
        buf = d if buf is None else [momentum * bi + di for bi, di in zip(buf, d)]
        p = [pi - lr * ratio * bi for pi, bi in zip(p, buf)]
        torch.testing.assert_close(w.detach(), torch.tensor(p, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_lars_ratio_is_one_for_zero_weights_and_for_groups_without_lars():
    zero = two_params(p=(0.0, 0.0))
    plain = two_params()
    Lars([dict(params=[zero]), dict(params=[plain], lars=False)], lr=0.5, eeta=0.02).step()
    torch.testing.assert_close(zero.detach(), torch.tensor([-0.3, -0.4], dtype=torch.float64))
    torch.testing.assert_close(plain.detach(), torch.tensor([2.7, 3.6], dtype=torch.float64))
    with pytest.raises(ValueError, match="eeta"):
        Lars([zero], eeta=0)


# ---------------------------------------------------------------- the torch-backed ones
def run(cls, steps=3, **kw):
    model = make_model()
    opt = cls(model.parameters(), **kw)
    for x, y in make_batches(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()], opt


@pytest.mark.parametrize("cls,kw,ref,ref_kw", [
    (FusedAdam, dict(weight_decay=0.1), torch.optim.AdamW, dict(weight_decay=0.1)),  # adamw_mode=True default
    (FusedAdam, dict(weight_decay=0.1, adamw_mode=False), torch.optim.Adam, dict(weight_decay=0.1)),
    (HybridAdam, dict(weight_decay=0.1), torch.optim.AdamW, dict(weight_decay=0.1)),
    (CPUAdam, dict(weight_decay=0.1, adamw_mode=False, betas=(0.8, 0.99)), torch.optim.Adam,
     dict(weight_decay=0.1, betas=(0.8, 0.99))),
    (FusedSGD, dict(momentum=0.9, weight_decay=0.1, nesterov=True), torch.optim.SGD,
     dict(momentum=0.9, weight_decay=0.1, nesterov=True)),
])
def test_torch_backed_optimizers_are_torchs_update(cls, kw, ref, ref_kw):
    got, opt = run(cls, lr=0.05, **kw)
    want, _ = run(ref, lr=0.05, **ref_kw)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert isinstance(opt, ref if ref is not torch.optim.AdamW else torch.optim.Adam)


def test_fused_sgd_weight_decay_after_momentum():
    """apex's wd_after_momentum: v = m * v + g; p -= lr * (v + wd * p)."""
    w = two_params()
    opt = FusedSGD([w], lr=0.5, momentum=0.9, weight_decay=0.1, wd_after_momentum=True)
    p, buf = [3.0, 4.0], None
    for g in ([0.6, 0.8], [-0.3, 0.4]):
        w.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        buf = list(g) if buf is None else [0.9 * b + gi for b, gi in zip(buf, g)]
        p = [pi - 0.5 * (bi + 0.1 * pi) for pi, bi in zip(p, buf)]
        torch.testing.assert_close(w.detach(), torch.tensor(p, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert opt.param_groups[0]["weight_decay"] == 0.1  # the group's value is back after the step


def test_legacy_positional_orders_and_refusals():
    w = two_params()
    fused = FusedAdam([w], 1e-3, True, (0.9, 0.999), 1e-8, False, 0.1)  # (.., eps, adamw_mode, weight_decay)
    assert fused.param_groups[0]["adamw_mode"] is False and fused.param_groups[0]["weight_decay"] == 0.1
    cpu = CPUAdam([w], 1e-3, True, (0.9, 0.999), 1e-8, 0.1, False)  # (.., eps, weight_decay, adamw_mode)
    assert cpu.param_groups[0]["adamw_mode"] is False and cpu.param_groups[0]["weight_decay"] == 0.1
    with pytest.raises(ValueError, match=r"bias_correction=False\) is not supported"):
        HybridAdam([w], bias_correction=False)
    with pytest.raises(ValueError, match="to NVMe is not supported"):
        CPUAdam([w], nvme_offload_fraction=0.5)
    with pytest.raises(TypeError, match="needs a learning rate"):
        FusedSGD([w])
    # set_grad_none decides what zero_grad() does
    FusedAdam([w], set_grad_none=False).zero_grad()
    assert w.grad is not None and not w.grad.any()


def test_step_hooks_run_once_per_step():
    """A subclass that runs torch's step itself must not run the step hooks twice (they count updates)."""
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # torch wraps Adam.step once an Adam exists
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    for cls, kw in ((FusedAdam, dict(weight_decay=0.1)), (FusedSGD, dict(lr=0.1, wd_after_momentum=True)),
                    (Lamb, {}), (Lars, {})):
        w = two_params()
        opt = cls([w], **kw)
        calls = []
        opt.register_step_post_hook(lambda *a, calls=calls: calls.append(1))
        opt.step()
        opt.step()
        assert len(calls) == 2, cls


@pytest.mark.parametrize("cls,kw", [(FusedAdam, dict(adamw_mode=False, weight_decay=0.1, set_grad_none=False)),
                                    (FusedSGD, dict(lr=0.1, wd_after_momentum=True)),
                                    (FusedLAMB, dict(use_nvlamb=True, max_grad_norm=2.0)),
                                    (Lamb, dict(adam=True, bias_correction=True)), (Lars, dict(eeta=0.01))])
def test_rebuilt_from_defaults_as_zero_does(cls, kw):
    """ZeRO builds the shard's optimizer as type(opt)(params, **defaults): the legacy options survive."""
    opt = cls([two_params()], **kw)
    again = type(opt)([two_params()], **_constructor_defaults(opt))
    for key, value in kw.items():
        assert again.defaults[key] == value, key
    assert again.param_groups[0].keys() == opt.param_groups[0].keys()


# ---------------------------------------------------------------- through initialize + Trainer.fit, resumed
def fit(cls, kw, ckpt, epochs=3, max_steps=None, resume=None):
    """Train through initialize + Trainer.fit with a checkpoint every epoch; returns (params, steps run here)."""
    gpc.destroy()
    colossal_lite.launch_from_torch(config={}, seed=2, verbose=False)
    model = make_model()
    opt = cls(model.parameters(), **kw)
    steps = []
    opt.register_step_post_hook(lambda *a: steps.append(1))
    engine, loader, _, _ = colossal_lite.initialize(model, opt, nn.CrossEntropyLoss(), make_batches(4),
                                                    verbose=False)
    Trainer(engine).fit(loader, epochs=epochs, max_steps=max_steps, resume_from=resume,
                        hooks=[LossHook(), SaveCheckpointHook(1, str(ckpt))])
    gpc.destroy()
    return [p.detach().clone() for p in model.parameters()], len(steps)


@pytest.mark.parametrize("cls,kw", [(Lamb, dict(lr=0.02, weight_decay=0.01)),
                                    (Lars, dict(lr=0.5, momentum=0.9, eeta=0.02, weight_decay=1e-4)),
                                    (FusedLAMB, dict(lr=0.02)), (FusedAdam, dict(lr=0.01, weight_decay=0.01)),
                                    (FusedSGD, dict(lr=0.1, momentum=0.9))])
@pytest.mark.slow  # takes seconds without starting a process
def test_trains_and_resumes_exactly_from_a_checkpoint(tmp_path, cls, kw):
    x, y = make_batches(4)[0]
    before = nn.functional.cross_entropy(make_model()(x), y)
    ref, steps = fit(cls, kw, tmp_path / "ref")
    assert steps == 12  # 3 epochs of 4 batches
    model = make_model()
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref):
            p.copy_(q)
    assert nn.functional.cross_entropy(model(x), y) < before  # it trains
    _, steps = fit(cls, kw, tmp_path / "cut", max_steps=6)  # stops inside epoch 1
    assert steps == 6
    resumed, steps = fit(cls, kw, tmp_path / "cut", resume="last")
    assert steps == 6  # the other half, from the checkpoint's optimizer state
    for a, b in zip(resumed, ref):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- ZeRO on 2 ranks (gloo)
ZERO_SCRIPT = r'''
import json, sys
import torch
sys.path.insert(0, {tests!r})
import colossal_lite
from colossal_lite.core import global_context as gpc
from colossal_lite.nn.optimizer import FusedAdam, Lamb, Lars
from engine_helpers import make_batches, make_model

colossal_lite.launch_from_torch(config={{}}, verbose=False)
rank, world = gpc.get_global_rank(), gpc.get_world_size()
optims = dict(fused_adam=(FusedAdam, dict(lr=0.01, adamw_mode=False, weight_decay=0.1)),
              lamb=(Lamb, dict(lr=0.01, weight_decay=0.01)), lars=(Lars, dict(lr=0.5, momentum=0.9, eeta=0.02)))
result = {{}}
for name, (cls, kw) in optims.items():
    for mode, extra in (("ddp", {{}}), ("zero1", dict(zero=dict(stage=1)))):
        gpc.load_config(extra)
        model = make_model()
        engine, loader, _, _ = colossal_lite.initialize(model, cls(model.parameters(), **kw),
                                                        torch.nn.CrossEntropyLoss(), make_batches(4, b=8),
                                                        verbose=False)
        for x, y in loader:
            x, y = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]
            engine.zero_grad()
            engine.backward(engine.criterion(engine(x), y))
            engine.step()
        result[name + "/" + mode] = dict(params=[p.tolist() for p in model.parameters()],
                                         optimizer=type(engine.optimizer).__name__)
with open({out!r} + f".rank{{rank}}", "w") as f:
    json.dump(result, f)
gpc.destroy()
'''


def test_zero_stage_1_shards_the_legacy_optimizers_on_two_ranks(tmp_path):
    script = tmp_path / "zero_rank.py"
    script.write_text(ZERO_SCRIPT.format(tests=str(Path(__file__).parents[1]), out=str(tmp_path / "result")))
    run_ranks(script, nproc=2, timeout=240)
    results = [json.loads((tmp_path / f"result.rank{r}").read_text()) for r in (0, 1)]
    assert results[0] == results[1]  # the ranks agree
    for name in ("fused_adam", "lamb", "lars"):
        assert results[0][name + "/zero1"]["optimizer"] == "ZeroRedundancyOptimizer"
        for a, b in zip(results[0][name + "/ddp"]["params"], results[0][name + "/zero1"]["params"]):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-6, atol=1e-6)


def test_the_legacy_colossalai_optimizer_wrapper_trains_as_the_optimizer_it_wraps():
    """Legacy scripts wrap by hand: ColossalaiOptimizer(optim) with .optim, backward, clip_grad_norm(model, norm)
    (ImportError before; found by a probe). It trains bit for bit as the hand loop with torch's clipping."""
    from colossal_lite.nn.optimizer import ColossalaiOptimizer

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        return model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(4)]
    hand, hand_opt = build()
    hand_sched = torch.optim.lr_scheduler.StepLR(hand_opt, 1, 0.5)
    model, inner = build()
    opt = ColossalaiOptimizer(inner)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)  # built on the wrapper: its groups are the wrapped one's
    assert opt.optim is inner and opt.param_groups is inner.param_groups and opt.defaults == inner.defaults
    for x, y in batches:
        hand_opt.zero_grad()
        torch.nn.functional.cross_entropy(hand(x), y).backward()
        torch.nn.utils.clip_grad_norm_(hand.parameters(), 0.1)
        hand_opt.step()
        hand_sched.step()
        opt.zero_grad()
        opt.backward(torch.nn.functional.cross_entropy(model(x), y))
        norm = opt.clip_grad_norm(model, 0.1)
        assert norm is not None and norm > 0.1  # (the clipping did something)
        opt.step()
        sched.step()
    for a, b in zip(hand.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert opt.param_groups[0]["lr"] == hand_opt.param_groups[0]["lr"] == 0.5 ** 5
    assert opt.state_dict()["state"].keys() == hand_opt.state_dict()["state"].keys()
    assert opt.clip_grad_norm(model, 0.0) is None
    with pytest.raises(TypeError, match="wraps a torch.optim.Optimizer, got Sequential"):
        ColossalaiOptimizer(model)
