"""Metrics computed on tensors, returned as tensors (no host synchronisation)."""
from .accuracy import Accuracy, calc_acc

__all__ = ["Accuracy", "calc_acc"]
