"""``MixUp`` as a hook: mix the inputs after the batch is loaded, and the targets or the loss to match."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...engine.schedule import call_criterion
from ...functional.mixup import mixup_batch
from ._base_hook import BaseHook

__all__ = ["MixUp"]


class MixUp(BaseHook):
    """MixUp (training only), the same draw as ``colossal_lite.functional.mixup_batch(data, label, alpha)``.

    ``after_batch_loaded``: ``state.data`` becomes ``(1 - m) * x + m * x[perm]`` with ``m ~ Beta(alpha, alpha)``.
    Then either

    - ``interpolate_loss=False`` (default): the target is mixed instead — ``after_forward`` replaces
      ``state.label`` by ``(1 - m) * onehot(y) + m * onehot(y[perm])`` (class indices) or ``(1 - m) * y + m * y[perm]``
      (float targets), so the criterion must accept soft targets (``torch.nn.CrossEntropyLoss`` does); or
    - ``interpolate_loss=True``: ``after_loss`` replaces ``state.loss`` by
      ``(1 - m) * loss + m * criterion(output, y[perm])``, i.e. ``functional.mixup_loss``; any criterion works.

    For cross-entropy both give the same loss. Hooks after the loss (metrics) see the original labels.
    """

    def __init__(self, alpha: float = 0.2, interpolate_loss: bool = False, priority: int = 10):
        super().__init__(priority)
        if not alpha > 0:
            raise ValueError(f"MixUp(alpha={alpha!r}): alpha must be > 0 (it parametrises Beta(alpha, alpha))")
        self.alpha = float(alpha)
        self.interpolate_loss = bool(interpolate_loss)
        self.mixing = None  # the last draw, a fraction in [0, 1]
        self._label = None
        self._label_perm = None

    def after_hook_is_attached(self, trainer):
        if trainer.engine.model_loss is not None:
            raise ValueError("MixUp mixes the targets a criterion compares the output with (or two criterion "
                             "losses), but this engine has no criterion: its model computes its own loss, which "
                             "MixUp cannot mix. Pass a criterion to initialize(), or leave MixUp out")

    def after_batch_loaded(self, trainer):
        st = trainer.state
        if not isinstance(st.data, torch.Tensor) or not isinstance(st.label, torch.Tensor):
            raise TypeError(f"MixUp needs the batch's data and label to be tensors, got {type(st.data).__name__} and "
                            f"{type(st.label).__name__}; use data_process_func to return (tensor, tensor)")
        st.data, self._label_perm, self.mixing = mixup_batch(st.data, st.label, alpha=self.alpha)
        self._label = st.label

    def after_forward(self, trainer):
        if self.interpolate_loss:
            return
        st = trainer.state
        m, y, y_perm = self.mixing, self._label, self._label_perm
        if y.is_floating_point():
            st.label = (1.0 - m) * y + m * y_perm
        else:
            output = st.output[0] if isinstance(st.output, (list, tuple)) else st.output
            num_classes = output.shape[-1]
            dtype = output.dtype if output.is_floating_point() else torch.float32
            st.label = ((1.0 - m) * F.one_hot(y, num_classes).to(dtype) + m * F.one_hot(y_perm, num_classes).to(dtype))

    def after_loss(self, trainer):
        st = trainer.state
        if self.interpolate_loss:
            other = call_criterion(trainer.engine.criterion, st.output, self._label_perm)
            st.loss = (1.0 - self.mixing) * st.loss + self.mixing * other
        else:
            st.label = self._label
        self._label = self._label_perm = None
