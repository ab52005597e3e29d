from .config import Config, ConfigException
from .parallel_mode import ParallelMode

__all__ = ["Config", "ConfigException", "ParallelMode"]
