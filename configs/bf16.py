# bf16.py: bf16 autocast over fp32 weights; bf16 has fp32's exponent range, so there is no loss scaling.
from colossal_lite.amp import AMP_TYPE

BATCH_SIZE = 128
NUM_EPOCHS = 2
LEARNING_RATE = 0.1

fp16 = dict(mode=AMP_TYPE.BF16)  # the key is called fp16 for legacy reasons; mode picks the precision
