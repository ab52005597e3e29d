from .amp_type import AMP_TYPE

__all__ = ["AMP_TYPE"]
