from .global_context import global_context

__all__ = ["global_context"]
