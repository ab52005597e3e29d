"""MultiStepLR / MultiStepWarmupLR milestones written as time strings (issue 23): '0.3dur' of total_steps,
'500ba' optimizer steps, '2ep' with steps_per_epoch; the LRs are torch's MultiStepLR with the resolved ints."""
import pytest
import torch
from torch.optim import lr_scheduler as torch_sched

from colossal_lite.nn.lr_scheduler import MultiStepLR, MultiStepWarmupLR
from colossal_lite.trainer.hooks import LRSchedulerHook


def optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)


def lrs(sched, steps):
    out = []
    for _ in range(steps):
        out.append(sched.optimizer.param_groups[0]["lr"])
        sched.optimizer.step()
        sched.step()
    return out


@pytest.mark.parametrize("milestones,steps_per_epoch,resolved", [
    (["0.3dur", "0.6dur"], None, [6, 12]),  # 0.3 and 0.6 of 20 steps
    (["0.25dur", "15ba", 18], None, [5, 15, 18]),
    (["1ep", "0.5dur", "3ep"], 4, [4, 10, 12]),
    (["0.33dur"], None, [7]),  # 6.6 rounds to 7
    (["0.02dur"], None, [1]),  # 0.4 rounds to 0: after the first update at the earliest, as 'dur' intervals
])
def test_time_milestones_resolve_and_follow_torch(milestones, steps_per_epoch, resolved):
    ours = MultiStepLR(optimizer(), total_steps=20, milestones=milestones, gamma=0.5, steps_per_epoch=steps_per_epoch)
    assert sorted(ours.milestones.elements()) == resolved
    theirs = torch_sched.MultiStepLR(optimizer(), milestones=resolved, gamma=0.5)
    assert lrs(ours, 20) == lrs(theirs, 20)


def test_warmup_variant_takes_time_milestones():
    ours = MultiStepWarmupLR(optimizer(), total_steps=20, warmup_steps=2, milestones=["0.3dur", "12ba"], gamma=0.5)
    ints = MultiStepWarmupLR(optimizer(), total_steps=20, warmup_steps=2, milestones=[6, 12], gamma=0.5)
    assert lrs(ours, 20) == lrs(ints, 20)


def test_epoch_milestones_need_steps_per_epoch():
    with pytest.raises(ValueError, match=r"milestones entry '2ep' counts epochs, .* give steps_per_epoch=\.\.\., or "
                                         r"write the milestone in 'ba' \(optimizer steps\) or 'dur'"):
        MultiStepLR(optimizer(), total_steps=20, milestones=["2ep"])
    with pytest.raises(ValueError, match=r"milestones entry '0.3 days': invalid time"):
        MultiStepLR(optimizer(), total_steps=20, milestones=["0.3 days"])
    with pytest.raises(TypeError, match="total_steps must be a positive integer"):
        MultiStepLR(optimizer(), total_steps=None, milestones=["0.5dur"])
    with pytest.raises(TypeError, match="milestones entry must be an integer"):  # ints keep their old checks
        MultiStepLR(optimizer(), total_steps=20, milestones=[2, 1.5])


@pytest.mark.parametrize("make", [
    lambda opt: MultiStepLR(opt, 24, milestones=["2ep", "4ep"], steps_per_epoch=4),
    lambda opt: MultiStepWarmupLR(opt, 24, warmup_steps=2, milestones=["0.5dur"]),
])
def test_time_milestones_stepped_once_per_epoch_are_refused(make):
    """Resolved to optimizer steps ('2ep' of 4 steps: step 8), then stepped once per epoch by
    ``LRSchedulerHook(by_epoch=True)``, they were counted as epochs: the LR never decayed in a 6-epoch run, without a
    word (found by the Composer-features probe)."""
    sched = make(optimizer())
    with pytest.raises(ValueError, match=r"LRSchedulerHook\(by_epoch=True\) steps MultiStep(Warmup)?LR once per epoch, "
                                         r"but its milestones \[.*\] were resolved to optimizer steps.* Fix: pass "
                                         r"by_epoch=False, or give the milestones as epoch numbers"):
        LRSchedulerHook(sched, by_epoch=True)
    LRSchedulerHook(sched, by_epoch=False)  # what the milestones mean
    LRSchedulerHook(MultiStepLR(optimizer(), 6, milestones=[2, 4]), by_epoch=True)  # ints: as the hook counts
