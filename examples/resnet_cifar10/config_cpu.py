"""The tutorial's config for machines without CUDA: the same settings in fp32.

torch's fp16 autocast does run on CPU, but convolutions then take reference kernels that
are about a hundred times slower than fp32 ones, so ``train_engine.py`` picks this file by
default when CUDA is not available.
"""
from config import BATCH_SIZE, LR, MOMENTUM, NUM_EPOCHS, WEIGHT_DECAY  # noqa: F401

fp16 = dict(mode=None)  # fp32
