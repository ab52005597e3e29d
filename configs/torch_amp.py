# torch_amp.py: fp16 mixed precision with torch autocast and torch.amp.GradScaler (the legacy AMP_TYPE.TORCH).
from colossal_lite.amp import AMP_TYPE

BATCH_SIZE = 128
NUM_EPOCHS = 2
LEARNING_RATE = 0.1

fp16 = dict(
    mode=AMP_TYPE.TORCH,
    init_scale=2.0**16,  # first loss scale
    growth_factor=2.0,  # scale *= 2 after growth_interval steps without inf/nan
    backoff_factor=0.5,  # scale *= 0.5 (and the step is skipped) when inf/nan gradients appear
    growth_interval=2000,
)
