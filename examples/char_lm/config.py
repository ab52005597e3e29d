"""Hyper-parameters of the character-level language model example, read by ``launch_from_torch(config=...)``.

UPPERCASE names are the script's own settings (``gpc.config.BATCH_SIZE``); lowercase
names are colossal_lite features that ``initialize`` composes into the engine.
"""
BATCH_SIZE = 4  # lines (sentences) per micro-batch per process
NUM_EPOCHS = 20  # passes over data.txt (--epochs overrides)
LR = 0.02  # Adam learning rate at the start of the cosine schedule (stepped once per epoch)
EMBED = 32  # width of the character embedding
HIDDEN = 128  # width of the GRU state
SAMPLE_PROMPT = "The "  # greedy sample printed at the end starts with this
SAMPLE_CHARS = 80  # at most this many generated characters

grad_reduction = "per-token-mean"  # every real character of the global batch weighs the same
gradient_accumulation = 2  # micro-batches per optimizer update
clip_grad_norm = 1.0  # global L2 norm of the gradients, applied at every update
