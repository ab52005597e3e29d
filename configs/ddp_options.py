# ddp_options.py: keyword arguments passed to torch DistributedDataParallel (used when the world size is > 1).
BATCH_SIZE = 128
NUM_EPOCHS = 2
LEARNING_RATE = 0.1

torch_ddp = dict(
    find_unused_parameters=True,  # needed when some parameters get no gradient in a step
    gradient_as_bucket_view=True,  # gradients are views into DDP's buckets: one copy of them instead of two
    bucket_cap_mb=25,
)
