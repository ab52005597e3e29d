from .accumulation import AccumulationDataLoader, AccumulationWindow
from .engine import Engine, EngineLRScheduler
from .schedule import NonPipelineSchedule

__all__ = ["Engine", "EngineLRScheduler", "NonPipelineSchedule", "AccumulationWindow", "AccumulationDataLoader"]
