"""Legacy ``colossalai.nn.layer`` (Linear1D_Col, Linear2D, ... the tensor-parallel layers) is not provided:
colossal_lite has no tensor parallelism. Importing this module says what to use instead."""
from .. import _TENSOR_PARALLEL_LAYERS

raise ImportError(f"colossal_lite.nn.layer {_TENSOR_PARALLEL_LAYERS}")
