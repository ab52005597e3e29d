# gradient_handler.py: average gradients with bucketed all-reduces in engine.step() instead of wrapping the model in DDP.
BATCH_SIZE = 128
NUM_EPOCHS = 2
LEARNING_RATE = 0.1

gradient_handler = [dict(type="DataParallelGradientHandler", bucket_size_mb=25)]
