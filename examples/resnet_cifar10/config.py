"""The tutorial's config: batch size per process, epochs, and torch mixed precision."""
from colossal_lite.amp import AMP_TYPE

BATCH_SIZE = 128  # images per process per step
NUM_EPOCHS = 200
LR = 0.1  # SGD learning rate at the start of the cosine schedule (stepped once per epoch)
MOMENTUM = 0.9
WEIGHT_DECAY = 5e-4

fp16 = dict(
    mode=AMP_TYPE.TORCH,  # torch autocast in fp16 + GradScaler
)
