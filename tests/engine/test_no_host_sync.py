"""The per-step engine path makes no host-device synchronisation (fp32, accumulation, clipping, scheduler)."""
import torch
from engine_helpers import make_batches, make_model
from sync_counter import count_syncs

import colossal_lite


def test_engine_steps_make_no_sync_calls(launched):
    launched(dict(gradient_accumulation=2, clip_grad_norm=1.0))
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    engine, loader, _, sched = colossal_lite.initialize(model, opt, torch.nn.CrossEntropyLoss(), make_batches(9),
                                                        lr_scheduler=sched, verbose=False)
    with count_syncs() as calls:
        for _ in range(2):
            for x, y in loader:
                engine.zero_grad()
                engine.backward(engine.criterion(engine(x), y))
                engine.step()
                sched.step()
            it = iter(loader)
            for _ in range(4):  # the schedule path too (two whole windows)
                engine.zero_grad()
                engine.execute_schedule(it)
                engine.step()
    assert all(not v for v in calls.values()), calls
    assert engine.num_updates > 0


def test_counter_sees_a_sync_from_the_package():
    """The instrument itself works: a colossal_lite function that calls .item() is counted."""
    from colossal_lite.engine import strategy

    with count_syncs() as calls:
        code = compile("def f(t):\n    return t.item()\n", strategy.__file__, "exec")
        ns = {}
        exec(code, ns)
        ns["f"](torch.tensor(1.0))
    assert len(calls["item"]) == 1
