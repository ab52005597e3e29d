"""Hyper-parameters of the Hugging Face text example, read by ``launch_from_torch(config=...)``.

UPPERCASE names are the script's own settings (``gpc.config.BATCH_SIZE``); lowercase
names are colossal_lite features that ``initialize`` composes into the engine.
"""
from colossal_lite.amp import AMP_TYPE

BATCH_SIZE = 8  # text windows per micro-batch per process
NUM_EPOCHS = 8  # passes over the text (--epochs overrides)
SEQ_LEN = 32  # characters per window (the model's n_positions)
STRIDE = 4  # characters between the starts of two windows
LR = 3e-3  # AdamW learning rate
EMBED = 64  # GPT-2 width (n_embd)
LAYERS = 2  # GPT-2 blocks (n_layer)
HEADS = 4  # attention heads (n_head)

fp16 = dict(mode=AMP_TYPE.BF16)  # bf16 autocast: no loss scaling needed
gradient_accumulation = 2  # micro-batches per optimizer update
clip_grad_norm = 1.0  # global L2 norm of the gradients, applied at every update
zero = dict(stage=2)  # optimizer state and gradients sharded over the processes (FSDP2)
