"""Stateless training helpers."""
from .mixup import mixup_batch, mixup_loss

__all__ = ["mixup_batch", "mixup_loss"]
