"""Gradient handlers, the legacy ``colossalai.engine.gradient_handler``: code that makes the ranks' gradients
agree (or otherwise treats them) once per optimizer update, before clipping.

A config's ``gradient_handler = [dict(type='Name', **options)]`` names classes registered in
``colossal_lite.registry.GRADIENT_HANDLER``; each is built as ``Name(model=..., optimizer=..., **options)``
and replaces torch DDP. A list of only ``DataParallelGradientHandler`` keeps its fast form
(``AllReduceStrategy``); any other list runs through ``HandlerStrategy``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from ..context.defaults import GRADIENT_BUCKET_MB
from ..core.dist import world_size
from ..registry import GRADIENT_HANDLER
from .strategy import AllReduceStrategy


class BaseGradientHandler(ABC):
    """A handler holds the model and optimizer it was built with; ``handle_gradient`` is called on every rank
    once per optimizer update, after the window's last backward and before clipping."""

    def __init__(self, model, optimizer):
        self._model = model
        self._optimizer = optimizer

    @abstractmethod
    def handle_gradient(self):
        """Treat the gradients of ``self._model``'s parameters (in place)."""


@GRADIENT_HANDLER.register_module
class DataParallelGradientHandler(BaseGradientHandler):
    """Average the gradients over all ranks with bucketed all-reduces (a no-op in a single process)."""

    def __init__(self, model, optimizer, bucket_size_mb: float = GRADIENT_BUCKET_MB):
        super().__init__(model, optimizer)
        self._all_reduce = AllReduceStrategy(bucket_size_mb=bucket_size_mb)

    def handle_gradient(self):
        if world_size() > 1:
            self._all_reduce.reduce_gradients(self._model)


def build_gradient_handler(config: dict, model, optimizer) -> BaseGradientHandler:
    """The legacy builder: ``GRADIENT_HANDLER.get_module(config['type'])(model=, optimizer=, **rest)``."""
    return GRADIENT_HANDLER.build(config, model=model, optimizer=optimizer)


__all__ = ["BaseGradientHandler", "DataParallelGradientHandler", "build_gradient_handler"]
