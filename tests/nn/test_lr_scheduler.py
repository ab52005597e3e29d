"""colossal_lite.nn.lr_scheduler: LR sequences against hand-computed formulas, exact state-dict resume
(warm-up/delay schedulers included, before and after the switch), last_epoch, wrapped optimizers, errors."""
import io
import math
import types

import pytest
import torch
from torch.optim import lr_scheduler as torch_sched

from colossal_lite.nn.lr_scheduler import (
    CosineAnnealingLR,
    CosineAnnealingWarmupLR,
    DelayerScheduler,
    ExponentialLR,
    FlatAnnealingLR,
    FlatAnnealingWarmupLR,
    LambdaLR,
    LinearWarmupLR,
    MultiplicativeLR,
    MultiStepLR,
    MultiStepWarmupLR,
    OneCycleLR,
    PolynomialLR,
    PolynomialWarmupLR,
    StepLR,
    WarmupDelayerScheduler,
    WarmupScheduler,
)

# Any UserWarning (e.g. torch's "get_lr() called outside step" or its step-order warnings) is a bug here.
pytestmark = pytest.mark.filterwarnings("error::UserWarning")

BASE_LRS = (0.1, 0.03)
TOTAL = 20
WARMUP = 5


def make_optimizer(lrs=BASE_LRS):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0], momentum=0.9)


def lrs_of(optimizer):
    return [group["lr"] for group in optimizer.param_groups]


def advance(scheduler, optimizer, steps):
    """Step optimizer then scheduler ``steps`` times; the per-group LRs after each step."""
    seen = []
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
        assert scheduler.get_last_lr() == pytest.approx(lrs_of(optimizer), rel=1e-12, abs=1e-15)
        seen.append(lrs_of(optimizer))
    return seen


def lr_sequence(factory, steps=TOTAL, optimizer=None):
    """LRs at steps 0..steps (step 0 = right after construction)."""
    optimizer = make_optimizer() if optimizer is None else optimizer
    scheduler = factory(optimizer)
    return [lrs_of(optimizer)] + advance(scheduler, optimizer, steps)


def expected_sequence(formula, steps=TOTAL):
    return [[formula(t, base) for base in BASE_LRS] for t in range(steps + 1)]


def assert_sequences_equal(actual, expected):
    assert len(actual) == len(expected)
    for t, (got, want) in enumerate(zip(actual, expected)):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), f"step {t}: {got} != {want}"


# ----------------------------------------------------------------------------------------------- formulas
def warmup(t, base, w):
    return (t + 1) / w * base


def cosine(t, base, length, eta_min=0.0):
    return eta_min + (base - eta_min) * (1 + math.cos(math.pi * t / length)) / 2


def f_cosine(t, base):
    return cosine(t, base, TOTAL, eta_min=0.001)


def f_cosine_warmup(t, base):
    return warmup(t, base, WARMUP) if t < WARMUP else cosine(t - WARMUP, base, TOTAL - WARMUP, 0.002)


def f_flat(t, base):
    flat = int(TOTAL * 0.5)  # 10
    return base if t < flat else cosine(t - flat, base, TOTAL - flat)


def f_flat_warmup(t, base):
    flat = int((TOTAL - WARMUP) * 0.4)  # 6
    if t < WARMUP:
        return warmup(t, base, WARMUP)
    if t < WARMUP + flat:
        return base
    return cosine(t - WARMUP - flat, base, TOTAL - WARMUP - flat, 0.001)


def f_linear(t, base):
    if t < WARMUP:
        return (t + 1) / (WARMUP + 1) * base
    return max(TOTAL - t, 0) / (TOTAL - WARMUP) * base


MILESTONES = [3, 5, 8, 8, 14]


def f_multistep(t, base):
    return base * 0.5 ** sum(1 for m in MILESTONES if m <= t)


def f_multistep_warmup(t, base):
    if t < WARMUP:
        return warmup(t, base, WARMUP)
    return base * 0.5 ** sum(1 for m in MILESTONES if WARMUP <= m <= t)  # milestone 3 < warmup is dropped


def poly(t, base, total, end_lr, power):
    return (base - end_lr) * (1 - min(t, total) / total) ** power + end_lr


def f_poly(t, base):
    return poly(t, base, 16, 0.001, 2.0)


def f_poly_warmup(t, base):
    return warmup(t, base, WARMUP) if t < WARMUP else poly(t - WARMUP, base, TOTAL - WARMUP, 0.001, 2.0)


def f_lambda(t, base):
    return base / (1 + t)


def f_multiplicative(t, base):
    return base * math.prod(0.9 if s % 2 else 0.8 for s in range(1, t + 1))


def f_step(t, base):
    return base * 0.5 ** (t // 3)


def f_exponential(t, base):
    return base * 0.9 ** t


def f_generic_warmup(t, base):
    return warmup(t, base, 4) if t < 4 else base * 0.9 ** (t - 4)


def f_generic_delay(t, base):
    return base if t < 6 else base * 0.5 ** ((t - 6) // 4)


def f_generic_warmup_delay(t, base):
    if t < 3:
        return warmup(t, base, 3)
    if t < 7:
        return base
    return base * 0.8 ** (t - 7)


def inverse_step(t):  # a module-level function: torch stores no state for it
    return 1 / (1 + t)


def alternating(t):
    return 0.9 if t % 2 else 0.8


# ----------------------------------------------------------------------------------------------- factories
SCHEDULERS = {
    "cosine": (lambda o: CosineAnnealingLR(o, TOTAL, eta_min=0.001), f_cosine),
    "cosine_warmup": (lambda o: CosineAnnealingWarmupLR(o, TOTAL, warmup_steps=WARMUP, eta_min=0.002),
                      f_cosine_warmup),
    "flat": (lambda o: FlatAnnealingLR(o, TOTAL, pct_start=0.5), f_flat),
    "flat_warmup": (lambda o: FlatAnnealingWarmupLR(o, TOTAL, warmup_steps=WARMUP, pct_start=0.4, eta_min=0.001),
                    f_flat_warmup),
    "linear_warmup": (lambda o: LinearWarmupLR(o, TOTAL, warmup_steps=WARMUP), f_linear),
    "multistep": (lambda o: MultiStepLR(o, TOTAL, milestones=MILESTONES, gamma=0.5), f_multistep),
    "multistep_warmup": (lambda o: MultiStepWarmupLR(o, TOTAL, warmup_steps=WARMUP, milestones=MILESTONES,
                                                     gamma=0.5), f_multistep_warmup),
    "onecycle": (lambda o: OneCycleLR(o, TOTAL, pct_start=0.25), None),
    "poly": (lambda o: PolynomialLR(o, 16, end_lr=0.001, power=2.0), f_poly),
    "poly_warmup": (lambda o: PolynomialWarmupLR(o, TOTAL, warmup_steps=WARMUP, end_lr=0.001, power=2.0),
                    f_poly_warmup),
    "lambda": (lambda o: LambdaLR(o, TOTAL, lr_lambda=inverse_step), f_lambda),
    "multiplicative": (lambda o: MultiplicativeLR(o, TOTAL, lr_lambda=alternating), f_multiplicative),
    "step": (lambda o: StepLR(o, TOTAL, step_size=3, gamma=0.5), f_step),
    "exponential": (lambda o: ExponentialLR(o, TOTAL, gamma=0.9), f_exponential),
    "generic_warmup": (lambda o: WarmupScheduler(o, 4, torch_sched.ExponentialLR(o, gamma=0.9)), f_generic_warmup),
    "generic_delay": (lambda o: DelayerScheduler(o, 6, torch_sched.StepLR(o, step_size=4, gamma=0.5)),
                      f_generic_delay),
    "generic_warmup_delay": (lambda o: WarmupDelayerScheduler(o, 3, 4, ExponentialLR(o, TOTAL, gamma=0.8)),
                             f_generic_warmup_delay),
}
WITH_FORMULA = [name for name, (_, formula) in SCHEDULERS.items() if formula is not None]
# the two-stage ones and where their switch to the inner scheduler happens
SWITCH_STEP = {"cosine_warmup": WARMUP, "flat": 10, "flat_warmup": WARMUP + 6, "multistep_warmup": WARMUP,
               "poly_warmup": WARMUP, "generic_warmup": 4, "generic_delay": 6, "generic_warmup_delay": 7}


@pytest.mark.parametrize("name", WITH_FORMULA)
def test_lr_sequence_matches_formula(name):
    factory, formula = SCHEDULERS[name]
    assert_sequences_equal(lr_sequence(factory), expected_sequence(formula))


def test_onecycle_matches_torch_onecycle():
    reference_opt = make_optimizer()
    reference = torch_sched.OneCycleLR(reference_opt, max_lr=list(BASE_LRS), total_steps=TOTAL, pct_start=0.25)
    expected = [lrs_of(reference_opt)] + advance(reference, reference_opt, TOTAL)
    optimizer = make_optimizer()
    actual = lr_sequence(SCHEDULERS["onecycle"][0], optimizer=optimizer)
    assert_sequences_equal(actual, expected)
    assert max(lr[0] for lr in actual) == pytest.approx(BASE_LRS[0])  # peaks at the group's own LR
    assert optimizer.param_groups[0]["momentum"] == reference_opt.param_groups[0]["momentum"]


@pytest.mark.parametrize("make, reference", [
    (lambda o: CosineAnnealingLR(o, TOTAL, eta_min=0.01), lambda o: torch_sched.CosineAnnealingLR(o, TOTAL, 0.01)),
    (lambda o: MultiStepLR(o, TOTAL, milestones=MILESTONES, gamma=0.5),
     lambda o: torch_sched.MultiStepLR(o, MILESTONES, gamma=0.5)),
    (lambda o: StepLR(o, TOTAL, step_size=3, gamma=0.5), lambda o: torch_sched.StepLR(o, 3, gamma=0.5)),
    (lambda o: ExponentialLR(o, TOTAL, gamma=0.9), lambda o: torch_sched.ExponentialLR(o, 0.9)),
    (lambda o: LambdaLR(o, TOTAL, lr_lambda=inverse_step), lambda o: torch_sched.LambdaLR(o, inverse_step)),
    (lambda o: MultiplicativeLR(o, TOTAL, lr_lambda=alternating),
     lambda o: torch_sched.MultiplicativeLR(o, alternating)),
])
def test_thin_wrappers_match_torch(make, reference):
    assert_sequences_equal(lr_sequence(make), lr_sequence(reference))


@pytest.mark.parametrize("warmed, plain", [
    (lambda o: CosineAnnealingWarmupLR(o, TOTAL, warmup_steps=0, eta_min=0.001),
     lambda o: CosineAnnealingLR(o, TOTAL, eta_min=0.001)),
    (lambda o: PolynomialWarmupLR(o, TOTAL, warmup_steps=0, power=2.0), lambda o: PolynomialLR(o, TOTAL, power=2.0)),
    (lambda o: MultiStepWarmupLR(o, TOTAL, warmup_steps=0, milestones=MILESTONES, gamma=0.5),
     lambda o: MultiStepLR(o, TOTAL, milestones=MILESTONES, gamma=0.5)),
    (lambda o: FlatAnnealingWarmupLR(o, TOTAL, warmup_steps=0, pct_start=0.3),
     lambda o: FlatAnnealingLR(o, TOTAL, pct_start=0.3)),
])
def test_zero_warmup_equals_unwarmed_scheduler(warmed, plain):
    assert_sequences_equal(lr_sequence(warmed), lr_sequence(plain))


def test_linear_warmup_stays_at_zero_after_total_steps():
    seq = lr_sequence(lambda o: LinearWarmupLR(o, 10, warmup_steps=2), steps=15)
    assert [lr[0] for lr in seq[10:]] == [0.0] * 6
    assert seq[9][0] == pytest.approx(BASE_LRS[0] / 8)


# ----------------------------------------------------------------------------------------------- state dict
def roundtrip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)  # plain data only: no optimizer, scheduler or function inside


def resume_points(name):
    switch = SWITCH_STEP.get(name)
    if switch is None:
        return [0, 7, 13]
    return sorted({1, switch - 1, switch, switch + 1, switch + 4})


@pytest.mark.parametrize("with_optimizer_state", [False, True], ids=["scheduler_only", "with_optimizer"])
@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_state_dict_resume_is_exact(name, with_optimizer_state):
    factory, _ = SCHEDULERS[name]
    uninterrupted = lr_sequence(factory)
    for k in resume_points(name):
        optimizer = make_optimizer()
        scheduler = factory(optimizer)
        before = [lrs_of(optimizer)] + advance(scheduler, optimizer, k)
        saved = roundtrip({"scheduler": scheduler.state_dict(), "optimizer": optimizer.state_dict()})

        fresh_optimizer = make_optimizer()
        fresh = factory(fresh_optimizer)
        if with_optimizer_state:
            fresh_optimizer.load_state_dict(saved["optimizer"])
        fresh.load_state_dict(saved["scheduler"])
        assert fresh.last_epoch == k
        assert lrs_of(fresh_optimizer) == pytest.approx(before[-1])
        after = advance(fresh, fresh_optimizer, TOTAL - k)
        assert_sequences_equal(before + after, uninterrupted)


@pytest.mark.parametrize("name", sorted(SWITCH_STEP))
def test_two_stage_state_dict_nests_inner_state(name):
    optimizer = make_optimizer()
    scheduler = SCHEDULERS[name][0](optimizer)
    advance(scheduler, optimizer, SWITCH_STEP[name] + 2)
    state = scheduler.state_dict()
    inner = state["after_scheduler"]
    assert isinstance(inner, dict) and inner["last_epoch"] == 2
    assert state["finished"] is True

    def walk(obj):
        assert not isinstance(obj, (torch.optim.Optimizer, torch_sched.LRScheduler, types.FunctionType))
        if isinstance(obj, dict):
            for value in obj.values():
                walk(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                walk(value)

    walk(state)

    fresh_optimizer = make_optimizer()
    fresh = SCHEDULERS[name][0](fresh_optimizer)
    fresh.load_state_dict(roundtrip(state))
    assert fresh.after_scheduler.last_epoch == 2  # restored on load, not rebuilt later
    assert fresh.after_scheduler.get_last_lr() == scheduler.after_scheduler.get_last_lr()
    assert fresh.finished is True


def test_load_state_dict_does_not_mutate_the_given_dict():
    optimizer = make_optimizer()
    scheduler = CosineAnnealingWarmupLR(optimizer, TOTAL, warmup_steps=WARMUP)
    advance(scheduler, optimizer, 8)
    state = scheduler.state_dict()
    keys = set(state)
    CosineAnnealingWarmupLR(make_optimizer(), TOTAL, warmup_steps=WARMUP).load_state_dict(state)
    assert set(state) == keys


# ----------------------------------------------------------------------------------------------- last_epoch
@pytest.mark.parametrize("name", ["linear_warmup", "poly", "poly_warmup", "cosine_warmup", "flat",
                                  "flat_warmup", "multistep_warmup", "generic_warmup_delay"])
@pytest.mark.parametrize("k", [2, 9])
def test_last_epoch_resumes_like_stepped_scheduler(name, k):
    """Built with last_epoch=k on an optimizer at step k, a scheduler continues like one stepped from scratch."""
    factory, _ = SCHEDULERS[name]
    uninterrupted = lr_sequence(factory)

    optimizer = make_optimizer()
    for group, base, lr in zip(optimizer.param_groups, BASE_LRS, uninterrupted[k]):
        group["initial_lr"], group["lr"] = base, lr
    # the factories take no last_epoch, so rebuild with it where each class accepts it
    resumed = {
        "linear_warmup": lambda o: LinearWarmupLR(o, TOTAL, warmup_steps=WARMUP, last_epoch=k),
        "poly": lambda o: PolynomialLR(o, 16, end_lr=0.001, power=2.0, last_epoch=k),
        "poly_warmup": lambda o: PolynomialWarmupLR(o, TOTAL, warmup_steps=WARMUP, end_lr=0.001, power=2.0,
                                                    last_epoch=k),
        "cosine_warmup": lambda o: CosineAnnealingWarmupLR(o, TOTAL, warmup_steps=WARMUP, eta_min=0.002,
                                                           last_epoch=k),
        "flat": lambda o: FlatAnnealingLR(o, TOTAL, pct_start=0.5, last_epoch=k),
        "flat_warmup": lambda o: FlatAnnealingWarmupLR(o, TOTAL, warmup_steps=WARMUP, pct_start=0.4, eta_min=0.001,
                                                       last_epoch=k),
        "multistep_warmup": lambda o: MultiStepWarmupLR(o, TOTAL, warmup_steps=WARMUP, milestones=MILESTONES,
                                                        gamma=0.5, last_epoch=k),
        "generic_warmup_delay": lambda o: WarmupDelayerScheduler(o, 3, 4, ExponentialLR(o, TOTAL, gamma=0.8),
                                                                 last_epoch=k),
    }[name]
    scheduler = resumed(optimizer)
    assert scheduler.last_epoch == k + 1  # torch convention: construction counts as one step
    actual = [lrs_of(optimizer)] + advance(scheduler, optimizer, TOTAL - k - 1)
    assert_sequences_equal(actual, uninterrupted[k + 1:])


@pytest.mark.parametrize("make, reference", [
    (lambda o, k: CosineAnnealingLR(o, TOTAL, last_epoch=k), lambda o, k: torch_sched.CosineAnnealingLR(o, TOTAL,
                                                                                                      last_epoch=k)),
    (lambda o, k: StepLR(o, TOTAL, step_size=3, gamma=0.5, last_epoch=k),
     lambda o, k: torch_sched.StepLR(o, 3, gamma=0.5, last_epoch=k)),
    (lambda o, k: OneCycleLR(o, TOTAL, last_epoch=k), None),
])
def test_last_epoch_passed_to_torch(make, reference):
    k = 4
    optimizer = make_optimizer()
    if reference is None:  # OneCycleLR keeps its bounds in the param groups: build once, then resume
        make(optimizer, -1)
    else:
        for group in optimizer.param_groups:
            group["initial_lr"] = group["lr"]
    scheduler = make(optimizer, k)
    assert scheduler.last_epoch == k + 1
    if reference is not None:
        reference_opt = make_optimizer()
        for group in reference_opt.param_groups:
            group["initial_lr"] = group["lr"]
        reference(reference_opt, k)
        assert lrs_of(optimizer) == lrs_of(reference_opt)


def test_resume_with_last_epoch_needs_initial_lr():
    with pytest.raises(KeyError, match="initial_lr"):
        CosineAnnealingWarmupLR(make_optimizer(), TOTAL, warmup_steps=WARMUP, last_epoch=3)
    with pytest.raises(KeyError, match="initial_lr"):
        PolynomialLR(make_optimizer(), TOTAL, last_epoch=3)


def test_explicit_epoch_jumps_forward_and_back():
    factory, formula = SCHEDULERS["cosine_warmup"]
    optimizer = make_optimizer()
    scheduler = factory(optimizer)
    optimizer.step()
    for epoch in (12, 3, 9, 5):
        with pytest.warns(UserWarning, match="epoch"):
            scheduler.step(epoch)
        assert lrs_of(optimizer) == pytest.approx([formula(epoch, b) for b in BASE_LRS])
    advance(scheduler, optimizer, 2)
    assert lrs_of(optimizer) == pytest.approx([formula(7, b) for b in BASE_LRS])


# ----------------------------------------------------------------------------------------------- wrappers
class PlainWrapper:
    """An optimizer wrapper that is not a torch Optimizer but shares the param_groups list."""

    def __init__(self, optim):
        self.optim = optim

    @property
    def param_groups(self):
        return self.optim.param_groups

    def step(self):
        self.optim.step()


class LegacyWrapper(torch.optim.Optimizer):
    """A legacy-style wrapper: subclasses Optimizer without calling its __init__ (no ``defaults``)."""

    def __init__(self, optim):
        self.optim = optim

    @property
    def param_groups(self):
        return self.optim.param_groups

    def step(self, closure=None):
        return self.optim.step(closure)


@pytest.mark.parametrize("wrapper", [PlainWrapper, LegacyWrapper])
@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_wrapped_optimizer(name, wrapper):
    factory, _ = SCHEDULERS[name]
    inner = make_optimizer()
    wrapped = wrapper(inner)
    # the generic helpers' factories build a torch inner scheduler, which needs the torch optimizer itself
    scheduler = factory(inner if name.startswith("generic") else wrapped)
    assert scheduler.optimizer is inner
    seq = [lrs_of(wrapped)] + advance(scheduler, wrapped, TOTAL)
    assert_sequences_equal(seq, lr_sequence(factory))


def test_generic_helper_accepts_wrapper_around_inner_optimizer():
    inner = make_optimizer()
    scheduler = WarmupScheduler(PlainWrapper(inner), 4, torch_sched.ExponentialLR(inner, gamma=0.9))
    assert_sequences_equal([lrs_of(inner)] + advance(scheduler, inner, TOTAL), expected_sequence(f_generic_warmup))


def test_non_optimizer_is_rejected():
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        LinearWarmupLR(object(), TOTAL)

    class Groups:
        param_groups = [{"lr": 0.1, "params": []}]

    with pytest.raises(TypeError, match="wraps no torch optimizer"):
        CosineAnnealingLR(Groups(), TOTAL)


# ----------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("build, error, message", [
    (lambda o: CosineAnnealingLR(o, 0), ValueError, "total_steps must be a positive integer"),
    (lambda o: LinearWarmupLR(o, -3), ValueError, r"total_steps must be a positive integer .*got -3"),
    (lambda o: PolynomialLR(o, 10.5), TypeError, "total_steps must be a positive integer"),
    (lambda o: OneCycleLR(o, 0), ValueError, "total_steps must be a positive integer"),
    (lambda o: PolynomialWarmupLR(o, 10, warmup_steps=-1), ValueError, "warmup_steps must be >= 0, got -1"),
    (lambda o: MultiStepWarmupLR(o, 10, warmup_steps=2), ValueError, "milestones cannot be empty"),
    (lambda o: MultiStepWarmupLR(o, 10, warmup_steps=2, milestones=[]), ValueError, "milestones cannot be empty"),
    (lambda o: MultiStepLR(o, 10, milestones=[2, 1.5]), TypeError, "milestones entry must be an integer"),
    # (a probe found a bare "'int' object is not iterable" here, where the page promised this message)
    (lambda o: MultiStepLR(o, 10, milestones=3), TypeError, r"milestones must be a list of integers \(optimizer "
                                                            r"steps\) or time strings \('0.3dur', '500ba'\), got 3"),
    (lambda o: MultiStepWarmupLR(o, 10, warmup_steps=1, milestones=3), TypeError, "milestones must be a list"),
    (lambda o: FlatAnnealingLR(o, 10, pct_start=1.0), ValueError, "pct_start must be < 1"),
    (lambda o: FlatAnnealingLR(o, 10, pct_start=-0.1), ValueError, "pct_start must be >= 0"),
    (lambda o: OneCycleLR(o, 10, pct_start=1.5), ValueError, "pct_start must be < 1"),
    (lambda o: OneCycleLR(o, 10, pct_start=1.0), ValueError, "pct_start must be < 1, got 1.0"),
    (lambda o: StepLR(o, 10, gamma=-0.5), ValueError, "gamma must be >= 0, got -0.5"),
    (lambda o: MultiStepLR(o, 10, milestones=[2], gamma=-1), ValueError, "gamma must be >= 0, got -1"),
    (lambda o: PolynomialLR(o, 10, end_lr=-1.0), ValueError, "end_lr must be >= 0"),
    (lambda o: PolynomialLR(o, 10, power=-2), ValueError, "power must be >= 0"),
    (lambda o: CosineAnnealingLR(o, 10, eta_min=-0.1), ValueError, "eta_min must be >= 0"),
    (lambda o: StepLR(o, 10, step_size=0), ValueError, "step_size must be >= 1"),
    (lambda o: LambdaLR(o, 10), TypeError, "lr_lambda must be a callable"),
    (lambda o: MultiplicativeLR(o, 10, lr_lambda=[inverse_step, 3]), TypeError, "lr_lambda must be a callable"),
    (lambda o: LinearWarmupLR(o, 10, last_epoch=-2), ValueError, "last_epoch must be >= -1"),
    (lambda o: WarmupScheduler(o, -1, torch_sched.StepLR(o, 1)), ValueError, "warmup_epochs must be >= 0"),
    (lambda o: DelayerScheduler(o, 2.5, torch_sched.StepLR(o, 1)), TypeError, "delay_epochs must be an integer"),
    (lambda o: WarmupScheduler(o, 2, "cosine"), TypeError, "after_scheduler must be a torch"),
    (lambda o: WarmupScheduler(o, 2, torch_sched.StepLR(make_optimizer(), 1)), ValueError,
     "after_scheduler must be built on the same optimizer"),
])
def test_constructor_errors(build, error, message):
    with pytest.raises(error, match=message):
        build(make_optimizer())


def test_unused_total_steps_and_extra_kwargs_are_accepted():
    optimizer = make_optimizer()
    with pytest.warns(UserWarning, match=r"MultiStepLR ignores the keyword argument\(s\) unknown_option: check"):
        scheduler = MultiStepLR(optimizer, TOTAL, milestones=None, gamma=0.5, unknown_option=1)
    advance(scheduler, optimizer, 5)
    assert lrs_of(optimizer) == list(BASE_LRS)


def test_a_misplaced_warmup_argument_is_named():
    """``CosineAnnealingLR(..., warmup_steps=5)`` warms nothing up; legacy accepted it without a word."""
    with pytest.warns(UserWarning, match=r"CosineAnnealingLR ignores the keyword argument\(s\) warmup_steps: .*"
                                         r"warmup_steps belongs to the \*WarmupLR classes"):
        CosineAnnealingLR(make_optimizer(), TOTAL, warmup_steps=5)
