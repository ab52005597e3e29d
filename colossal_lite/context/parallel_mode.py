"""Names of process groups, kept for legacy Colossal-AI scripts.

colossal_lite only does data parallelism, so every mode a script may pass
(``GLOBAL``, ``DATA`` and the model-parallel names) maps to the one data-parallel world.
"""
from enum import Enum


class ParallelMode(Enum):
    GLOBAL = "global"
    DATA = "data"
    MODEL = "model"
    PIPELINE = "pipe"
    TENSOR = "tensor"
    SEQUENCE = "sequence"
    SEQUENCE_DP = "sequence_dp"
    PARALLEL_1D = "1d"
    PARALLEL_2D_ROW = "2d_row"
    PARALLEL_2D_COL = "2d_col"
    PARALLEL_3D_INPUT = "3d_input"
    PARALLEL_3D_WEIGHT = "3d_weight"
    PARALLEL_3D_OUTPUT = "3d_output"
    PARALLEL_3D_INPUT_X_WEIGHT = "3d_input_x_weight"
    PARALLEL_3D_OUTPUT_X_WEIGHT = "3d_output_x_weight"
    PARALLEL_2P5D_ROW = "2p5d_row"
    PARALLEL_2P5D_COL = "2p5d_col"
    PARALLEL_2P5D_DEP = "2p5d_dep"
    PARALLEL_2P5D_XZ = "2p5d_xz"


# Modes whose group is the whole data-parallel world; the others are size-1 groups.
DATA_MODES = frozenset({ParallelMode.GLOBAL, ParallelMode.DATA, ParallelMode.SEQUENCE_DP})
