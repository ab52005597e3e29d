"""Hyper-parameters of the digits example, read by ``launch_from_torch(config=...)``.

UPPERCASE names are the script's own settings (``gpc.config.BATCH_SIZE``); lowercase
names are colossal_lite features that ``initialize`` composes into the engine.
"""
BATCH_SIZE = 32  # samples per process per step
NUM_EPOCHS = 20
LR = 0.05  # SGD learning rate at the start of the cosine schedule
MOMENTUM = 0.9
WEIGHT_DECAY = 1e-4
HIDDEN = 128  # width of the two hidden layers

clip_grad_norm = 1.0  # global L2 norm of the gradients, applied at every update
