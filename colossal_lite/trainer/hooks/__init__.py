"""Hooks for ``Trainer.fit`` / ``Trainer.evaluate`` (the legacy ``colossalai.trainer.hooks``)."""
from ...registry import HOOKS
from ._base_hook import BaseHook
from ._checkpoint_hook import LoadCheckpointHook, SaveCheckpointHook
from ._early_stopping import EarlyStoppingHook
from ._ema import EMAHook
from ._log_hook import LogByEpochHook, LogMemoryByEpochHook, LogMetricByEpochHook, LogTimingByEpochHook, TensorboardHook
from ._metric_hook import (
    AccuracyHook,
    AccuracyMetric,
    LearningRateMetric,
    LogMetricByStepHook,
    LossHook,
    LossMetric,
    LRSchedulerHook,
    Metric,
    MetricHook,
    ThroughputHook,
    ThroughputMetric,
)
from ._mixup import MixUp
from ._profiler import ProfilerHook
from ._speed import SpeedReportHook

__all__ = [
    "BaseHook", "MetricHook", "LossHook", "AccuracyHook", "LRSchedulerHook", "LogMetricByStepHook",
    "LogMetricByEpochHook", "TensorboardHook", "LogTimingByEpochHook", "LogMemoryByEpochHook", "ThroughputHook",
    "EarlyStoppingHook", "EMAHook", "MixUp", "LogByEpochHook", "SaveCheckpointHook", "LoadCheckpointHook",
    "Metric", "LossMetric", "AccuracyMetric", "LearningRateMetric", "ThroughputMetric", "ProfilerHook",
    "SpeedReportHook",
]

# legacy registered every built-in hook, so a config or builder can name one: HOOKS.get_module('LossHook')
for _hook in (LossHook, AccuracyHook, LRSchedulerHook, LogMetricByStepHook, LogMetricByEpochHook, TensorboardHook,
              LogTimingByEpochHook, LogMemoryByEpochHook, ThroughputHook, EarlyStoppingHook, EMAHook, MixUp,
              SaveCheckpointHook, LoadCheckpointHook, ProfilerHook, SpeedReportHook):
    HOOKS.register_module(_hook)
del _hook
