"""A warm-up longer than the run (``warmup_steps > total_steps``) is accepted, as legacy Colossal-AI accepted it
(the ViT example's 2-epoch config asks for more warm-up epochs than it runs): the LR follows the warm-up line
written out below, and one warning names both numbers."""
import warnings

import pytest
import torch
from torch import nn

import colossal_lite
from colossal_lite.nn.lr_scheduler import (
    CosineAnnealingWarmupLR,
    FlatAnnealingWarmupLR,
    LinearWarmupLR,
    MultiStepWarmupLR,
    PolynomialWarmupLR,
)
from colossal_lite.trainer import Trainer, hooks

BASE_LRS = (0.1, 0.03)


def make_optimizer():
    groups = [{"params": [nn.Parameter(torch.zeros(2))], "lr": lr} for lr in BASE_LRS]
    return torch.optim.SGD(groups, lr=BASE_LRS[0])


def legacy_linear_warmup(t, base, warmup):
    """legacy LinearWarmupLR's warm-up: (t + 1) / (warmup + 1) * base."""
    return (t + 1) / (warmup + 1) * base


def legacy_warmup(t, base, warmup):
    """legacy WarmupScheduler's warm-up (Cosine/FlatAnnealing/MultiStep/Polynomial...WarmupLR): (t + 1) / warmup * base."""
    return (t + 1) / warmup * base


SCHEDULERS = {
    "LinearWarmupLR": (lambda o, T, w: LinearWarmupLR(o, total_steps=T, warmup_steps=w), legacy_linear_warmup),
    "CosineAnnealingWarmupLR": (lambda o, T, w: CosineAnnealingWarmupLR(o, total_steps=T, warmup_steps=w),
                                legacy_warmup),
    "FlatAnnealingWarmupLR": (lambda o, T, w: FlatAnnealingWarmupLR(o, total_steps=T, warmup_steps=w), legacy_warmup),
    "MultiStepWarmupLR": (lambda o, T, w: MultiStepWarmupLR(o, total_steps=T, warmup_steps=w, milestones=[1, 60]),
                          legacy_warmup),
    "PolynomialWarmupLR": (lambda o, T, w: PolynomialWarmupLR(o, total_steps=T, warmup_steps=w), legacy_warmup),
}


def _run(build, total, warmup, steps):
    """LRs at steps 0..steps (step 0: right after construction), and the warnings issued meanwhile."""
    optimizer = make_optimizer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scheduler = build(optimizer, total, warmup)
        seen = [[g["lr"] for g in optimizer.param_groups]]
        for _ in range(steps):
            optimizer.step()
            scheduler.step()
            seen.append([g["lr"] for g in optimizer.param_groups])
    return seen, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


@pytest.mark.parametrize("name", list(SCHEDULERS))
@pytest.mark.parametrize("total,warmup", [(2, 50), (10, 12)])
def test_warmup_longer_than_the_run_follows_the_warmup_line_and_warns_once(name, total, warmup):
    build, formula = SCHEDULERS[name]
    seen, warned = _run(build, total, warmup, steps=total)
    for t, got in enumerate(seen):
        want = [formula(t, base, warmup) for base in BASE_LRS]
        assert got == pytest.approx(want, rel=1e-12), f"{name} step {t}: {got} != {want}"
    assert len(warned) == 1, warned
    assert f"{name}: warmup_steps ({warmup}) is longer than total_steps ({total})" in warned[0]


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_warmup_within_the_run_does_not_warn(name):
    build, formula = SCHEDULERS[name]
    seen, warned = _run(build, 10, 10, steps=3)
    assert warned == []
    assert seen[2] == pytest.approx([formula(2, base, 10) for base in BASE_LRS], rel=1e-12)


def test_linear_warmup_keeps_its_line_past_the_run_then_stays_at_zero():
    """Stepped past total_steps (a loop that runs longer than it said): the warm-up line until warmup_steps, as
    legacy computed it, then 0 (legacy's decay formula would divide by a negative length and climb)."""
    seen, _ = _run(SCHEDULERS["LinearWarmupLR"][0], 3, 5, steps=8)
    want = [[legacy_linear_warmup(t, b, 5) if t < 5 else 0.0 for b in BASE_LRS] for t in range(9)]
    assert seen == [pytest.approx(w, rel=1e-12, abs=0) for w in want]


class EpochLR(hooks.BaseHook):
    """Appends the optimizer's LR to ``seen`` at each epoch's end, after LRSchedulerHook has stepped."""

    def __init__(self, optimizer, seen):
        super().__init__(priority=1000)
        self.optimizer, self.seen = optimizer, seen

    def after_train_epoch(self, trainer):
        self.seen.append(self.optimizer.param_groups[0]["lr"])


def test_two_epoch_trainer_run_with_a_longer_warmup_like_the_vit_example():
    """The ViT example: LinearWarmupLR(total_steps=NUM_EPOCHS, warmup_steps=WARMUP_EPOCHS) stepped by epoch."""
    num_epochs, warmup_epochs = 2, 5
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"warmup_steps \(5\) is longer than total_steps \(2\)"):
        scheduler = LinearWarmupLR(optimizer, total_steps=num_epochs, warmup_steps=warmup_epochs)
    data = [(torch.randn(4, 4), torch.randint(0, 2, (4,))) for _ in range(3)]
    engine, loader, _, scheduler = colossal_lite.initialize(model, optimizer, nn.CrossEntropyLoss(), data,
                                                            lr_scheduler=scheduler, verbose=False)
    seen = []
    trainer = Trainer(engine)
    trainer.fit(loader, epochs=num_epochs, display_progress=False,
                hooks=[hooks.LRSchedulerHook(scheduler, by_epoch=True), EpochLR(optimizer, seen)])
    # after epoch e the scheduler has stepped e + 1 times: the warm-up line at t = e + 1
    assert seen == pytest.approx([legacy_linear_warmup(e + 1, 0.1, warmup_epochs) for e in range(num_epochs)],
                                 rel=1e-12)


def _vit_like_run_on_a_rank(rank, world_size, port, results):
    colossal_lite.launch(config={}, rank=rank, world_size=world_size, host="127.0.0.1", port=port, backend="gloo",
                         seed=0, verbose=False)
    try:
        model = nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scheduler = LinearWarmupLR(optimizer, total_steps=2, warmup_steps=5)
        data = [(torch.randn(4, 4), torch.randint(0, 2, (4,))) for _ in range(3)]
        engine, loader, _, scheduler = colossal_lite.initialize(model, optimizer, nn.CrossEntropyLoss(), data,
                                                                lr_scheduler=scheduler, verbose=False)
        seen = []
        Trainer(engine).fit(loader, epochs=2, hooks=[hooks.LRSchedulerHook(scheduler, by_epoch=True),
                                                     EpochLR(optimizer, seen)])
        results.put((rank, seen))
    finally:
        colossal_lite.core.global_context.destroy()


def test_a_longer_warmup_on_two_ranks_follows_the_same_line_on_each():
    from colossal_lite.testing import spawn

    results = torch.multiprocessing.get_context("spawn").SimpleQueue()
    spawn(_vit_like_run_on_a_rank, nprocs=2, results=results)
    found = sorted(results.get() for _ in range(2))
    for rank, seen in found:
        assert seen == pytest.approx([legacy_linear_warmup(e + 1, 0.1, 5) for e in range(2)], rel=1e-12), rank
