"""The default of each config key and each precision option, written once.

The config validator (the options it accepts, the values its fixes suggest), the feature summary of
``colossal-lite check`` and ``initialize``, ``initialize`` itself, ``launch`` and the precision classes
read them from here; ``docs/config.md`` lists the same values for readers.
"""
from __future__ import annotations

from typing import Any, Dict

# fp16 = dict(mode=AMP_TYPE.TORCH, ...): torch.amp.GradScaler's arguments
TORCH_AMP_OPTIONS: Dict[str, Any] = dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                                         growth_interval=2000, enabled=True)
# fp16 = dict(mode=AMP_TYPE.NAIVE, ...): the legacy dynamic loss scaler's arguments
NAIVE_AMP_OPTIONS: Dict[str, Any] = dict(
    initial_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=1000, hysteresis=2,
    min_scale=None, max_scale=None, dynamic_grad_scale=True, verbose=False,
    log_num_zeros_in_grad=False,  # True: rank 0 logs how many gradient elements are zero at each update
)
# fp16 = dict(mode=AMP_TYPE.BF16): no options (bf16 needs no loss scaling)
BF16_OPTIONS: Dict[str, Any] = {}
# zero = dict(stage=..., ...)
ZERO_OPTIONS: Dict[str, Any] = dict(stage=None, offload_optimizer=False, shard_modules=None, reshard_after_forward=None)
# gradient_handler = [dict(type='DataParallelGradientHandler', bucket_size_mb=...)]
GRADIENT_BUCKET_MB = 25.0

# Top-level keys: the value a config that leaves the key out gets.
DEFAULTS: Dict[str, Any] = dict(
    fp16=None,  # fp32
    clip_grad_norm=0.0,  # off
    gradient_accumulation=1,  # one optimizer step per batch
    grad_reduction="mean",
    nonfinite_loss="raise",
    cudnn_benchmark=False,
    cudnn_deterministic=False,
    dist_timeout=300,  # seconds the process-group start waits for missing peers
    compile=False,
)


def setting(config, key: str) -> Any:
    """``config[key]``, or the key's default when the config leaves it out."""
    return config.get(key, DEFAULTS[key])
