# fp32.py: the plain baseline. No feature keys at all: fp32, no accumulation, no clipping, DDP when world size > 1.
BATCH_SIZE = 128  # samples per process per optimizer step
NUM_EPOCHS = 2
LEARNING_RATE = 0.1
WEIGHT_DECAY = 5e-4
