"""Each config default is written once (context/defaults.py): the precision classes and the feature summary agree."""
import inspect

from colossal_lite.amp.precision import DynamicGradScaler, NaiveAMPPrecision, TorchAMPPrecision
from colossal_lite.context.defaults import DEFAULTS, NAIVE_AMP_OPTIONS, TORCH_AMP_OPTIONS
from colossal_lite.context.features import describe_features
from colossal_lite.context.validation import FEATURE_KEYS


def _signature_defaults(fn):
    return {k: p.default for k, p in inspect.signature(fn).parameters.items() if p.default is not p.empty}


def test_precision_classes_take_the_table_defaults():
    assert TorchAMPPrecision().options == TORCH_AMP_OPTIONS
    assert _signature_defaults(NaiveAMPPrecision.__init__) == NAIVE_AMP_OPTIONS
    scaler = NaiveAMPPrecision().scaler
    assert (scaler.scale, scaler.growth_interval, scaler.hysteresis) == (
        NAIVE_AMP_OPTIONS["initial_scale"], NAIVE_AMP_OPTIONS["growth_interval"], NAIVE_AMP_OPTIONS["hysteresis"])
    assert _signature_defaults(DynamicGradScaler.__init__)["dynamic"] is NAIVE_AMP_OPTIONS["dynamic_grad_scale"]


def test_every_default_is_of_a_checked_key_and_the_summary_reads_it():
    assert set(DEFAULTS) <= set(FEATURE_KEYS)
    lines = describe_features({})
    assert "gradient accumulation: off (one optimizer step per batch)" in lines
    assert "gradient clipping: off" in lines
    assert "cuDNN: benchmark=False, deterministic=False" in lines
