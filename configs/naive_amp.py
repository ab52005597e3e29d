# naive_amp.py: naive fp16 (the legacy AMP_TYPE.NAIVE): fp16 weights and activations, fp32 master weights, dynamic loss scale.
from colossal_lite.amp import AMP_TYPE

BATCH_SIZE = 128
NUM_EPOCHS = 2
LEARNING_RATE = 0.1

fp16 = dict(
    mode=AMP_TYPE.NAIVE,
    initial_scale=2.0**16,
    growth_factor=2.0,
    backoff_factor=0.5,
    growth_interval=1000,  # steps without overflow before the scale grows
    hysteresis=2,  # overflows tolerated before the scale backs off
)
clip_grad_norm = 1.0  # clipping works with naive fp16 too (applied to the unscaled fp32 master gradients)
