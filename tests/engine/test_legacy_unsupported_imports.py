"""Imports of legacy features colossal_lite does not have fail with an ImportError that names what to do instead,
and the legacy schedule base class (``BaseSchedule``, ``load_batch(data_iter, to_gpu=True)``) is there."""
import importlib
import re

import pytest
import torch

from colossal_lite.core import global_context as gpc
from colossal_lite.engine.gradient_handler import build_gradient_handler
from colossal_lite.engine.schedule import BaseSchedule, NonPipelineSchedule


@pytest.mark.parametrize("statement,fix", [
    ("from colossal_lite.engine.schedule import PipelineSchedule", "use NonPipelineSchedule"),
    ("from colossal_lite.engine.schedule import InterleavedPipelineSchedule", "use NonPipelineSchedule"),
    ("from colossal_lite.nn.layer import Linear1D_Col", "use torch.nn layers (torch.nn.Linear"),
    ("from colossal_lite.nn import Linear1D_Col", "use torch.nn layers (torch.nn.Linear"),
    ("from colossal_lite.nn import LayerNorm2p5D", "use torch.nn layers (torch.nn.Linear"),
    ("from colossal_lite.zero.init_ctx import ZeroInitContext", "write zero = dict(stage=1|2|3) in config.py"),
    ("from colossal_lite.zero import ZeroInitContext", "write zero = dict(stage=1|2|3) in config.py"),
    ("from colossal_lite.pipeline import PipelinableContext", "build the whole model as a torch.nn.Module"),
    ("from colossal_lite.global_variables import tensor_parallel_env", "remove the import"),
    ("from colossal_lite.engine.gradient_accumulation import accumulate_gradient",
     "write gradient_accumulation = N in config.py"),
    ("from colossal_lite.builder import build_hooks", "build from the registry instead"),
])
def test_an_unsupported_legacy_import_names_the_alternative(statement, fix):
    with pytest.raises(ImportError) as err:
        exec(statement, {})
    assert type(err.value) is ImportError  # not ModuleNotFoundError: the module is known, the feature is not here
    assert "not supported by colossal_lite" in str(err.value) or "is not provided" in str(err.value)
    assert fix in str(err.value), str(err.value)


def test_a_missing_name_of_those_modules_is_still_an_attribute_error():
    schedule = importlib.import_module("colossal_lite.engine.schedule")
    assert not hasattr(schedule, "NoSuchSchedule")
    assert not hasattr(importlib.import_module("colossal_lite.builder"), "no_such_name")


def test_builder_keeps_the_legacy_build_gradient_handler():
    from colossal_lite.builder import build_gradient_handler as legacy
    assert legacy is build_gradient_handler


def test_base_schedule_is_the_legacy_base_of_non_pipeline_schedule():
    assert issubclass(NonPipelineSchedule, BaseSchedule)
    with pytest.raises(TypeError, match="abstract"):
        BaseSchedule()

    class FirstItemOnly(BaseSchedule):  # a user's own schedule, as legacy allowed
        def forward_backward_step(self, engine, data_iter, forward_only=False, return_loss=True,
                                  return_output_label=True):
            return self.load_batch(data_iter)[0], None, None

    schedule = FirstItemOnly()
    assert schedule.pre_processing(object()) is None  # legacy's hook before training; nothing to prepare here
    out, _, _ = schedule.forward_backward_step(None, iter([(torch.ones(5, 2), torch.zeros(5))]))
    assert torch.equal(out, torch.ones(5, 2)) and schedule.batch_size == 5


def test_load_batch_takes_legacy_to_gpu_and_a_device():
    schedule = NonPipelineSchedule()
    batch = (torch.arange(6.0).reshape(3, 2), torch.tensor([0, 1, 0]))
    loaded = schedule.load_batch(iter([batch]))  # legacy: to_gpu=True, the process's device
    assert loaded[0].device == gpc.device and torch.equal(loaded[0].cpu(), batch[0])
    assert schedule.current_batch is loaded and schedule.batch_size == 3
    kept = schedule.load_batch(iter([batch]), to_gpu=False)
    assert kept[0] is batch[0]  # not moved, not copied
    on_cpu = schedule.load_batch(iter([batch]), torch.device("cpu"))
    assert on_cpu[0].device == torch.device("cpu")
    with pytest.raises(RuntimeError, match=re.escape("needs an iterator over batches, got None")):
        schedule.load_batch(None)
