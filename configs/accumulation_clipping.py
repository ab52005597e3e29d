# accumulation_clipping.py: gradient accumulation over 4 micro-batches, then global L2-norm clipping to 1.0.
BATCH_SIZE = 32  # micro-batch size; one optimizer step sees 4 * 32 samples per process
NUM_EPOCHS = 2
LEARNING_RATE = 0.1

gradient_accumulation = 4  # micro-batches per optimizer step (the loss is divided by 4)
clip_grad_norm = 1.0  # max global L2 norm of all gradients; 0 turns clipping off
