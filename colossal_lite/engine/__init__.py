from .accumulation import AccumulationDataLoader, AccumulationWindow
from .engine import Engine, EngineLRScheduler
from .gradient_handler import BaseGradientHandler, DataParallelGradientHandler
from .model_loss import ModelLoss
from .schedule import NonPipelineSchedule

__all__ = ["Engine", "EngineLRScheduler", "NonPipelineSchedule", "AccumulationWindow", "AccumulationDataLoader",
           "BaseGradientHandler", "DataParallelGradientHandler", "ModelLoss"]
