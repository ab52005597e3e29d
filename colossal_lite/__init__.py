"""colossal_lite: the legacy Colossal-AI engine + trainer workflow on plain PyTorch.

Importing this package is cheap: torchvision, rich and psutil are imported only when used.
"""
from ._version import __version__
from .initialize import (
                         get_default_parser,
                         initialize,
                         launch,
                         launch_from_openmpi,
                         launch_from_slurm,
                         launch_from_torch,
)

__all__ = ["__version__", "launch", "launch_from_torch", "launch_from_slurm", "launch_from_openmpi", "initialize",
           "get_default_parser"]
