from enum import Enum


class AMP_TYPE(Enum):
    """Mixed-precision modes selectable with ``fp16=dict(mode=AMP_TYPE.X)``."""

    APEX = "apex"  # rejected with a ConfigException: NVIDIA apex is not supported
    TORCH = "torch"  # torch autocast fp16 + torch.amp.GradScaler
    NAIVE = "naive"  # fp16 weights, fp32 master weights in the optimizer, dynamic loss scale
    BF16 = "bf16"  # torch autocast bf16, no loss scaling
