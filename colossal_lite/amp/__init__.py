from .amp_type import AMP_TYPE
from .convert import (
    NaiveAMPModel,
    NaiveAMPOptimizer,
    TorchAMPLoss,
    TorchAMPModel,
    TorchAMPOptimizer,
    convert_to_amp,
    convert_to_apex_amp,
    convert_to_naive_amp,
    convert_to_torch_amp,
)

__all__ = ["AMP_TYPE", "convert_to_amp", "convert_to_torch_amp", "convert_to_naive_amp", "convert_to_apex_amp",
           "TorchAMPModel", "TorchAMPOptimizer", "TorchAMPLoss", "NaiveAMPModel", "NaiveAMPOptimizer"]
