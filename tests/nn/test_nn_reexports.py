"""Legacy ``colossalai.nn`` re-exported its LR schedulers and metrics: ``from colossalai.nn import LinearWarmupLR``."""
import pytest

import colossal_lite.nn
import colossal_lite.nn.lr_scheduler as lr_scheduler
import colossal_lite.nn.metric as metric


def test_every_scheduler_and_metric_is_importable_from_nn():
    names = [*lr_scheduler.__all__, *metric.__all__]
    assert len(names) == 19
    namespace = {}
    exec(f"from colossal_lite.nn import {', '.join(names)}", namespace)
    for name in lr_scheduler.__all__:
        assert namespace[name] is getattr(lr_scheduler, name)
    for name in metric.__all__:
        assert namespace[name] is getattr(metric, name)
    assert set(names) <= set(colossal_lite.nn.__all__) and set(names) <= set(dir(colossal_lite.nn))
    assert colossal_lite.nn.lr_scheduler is lr_scheduler and colossal_lite.nn.metric is metric


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'colossal_lite.nn' has no attribute 'LinearWarmup'"):
        _ = colossal_lite.nn.LinearWarmup
