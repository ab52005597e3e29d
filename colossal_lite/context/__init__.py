from .config import Config, ConfigException
from .parallel_mode import ParallelMode
from .validation import ForeignConfigKeyWarning

__all__ = ["Config", "ConfigException", "ForeignConfigKeyWarning", "ParallelMode"]
