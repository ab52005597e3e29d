"""The legacy "AMP modularity" flow: ``convert_to_amp`` and its per-mode forms, for a plain PyTorch loop.

    model, optimizer, criterion = convert_to_amp(model, optimizer, criterion, AMP_TYPE.TORCH)
    optimizer.zero_grad(); out = model(x); loss = criterion(out, y); optimizer.backward(loss); optimizer.step()

The wrappers hold one precision object of ``precision.py`` (the same classes the Engine uses) and call it at
the legacy wrappers' methods, so the update is the Engine's update: there is one AMP, not two.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch import nn

from ..context.config import ConfigException
from ..context.validation import normalize_amp_mode
from .amp_type import AMP_TYPE
from .precision import BF16Precision, FP32Precision, NaiveAMPPrecision, TorchAMPPrecision

_APEX_REFUSAL = ("AMP_TYPE.APEX needs NVIDIA apex, which colossal_lite does not support; use AMP_TYPE.TORCH "
                 "(torch autocast + GradScaler, the same mixed precision) or AMP_TYPE.NAIVE (fp16 weights with fp32 "
                 "master weights, apex O3's scheme)")


class AMPOptimizer(torch.optim.Optimizer):
    """The legacy optimizer wrapper (``ColossalaiOptimizer`` and its AMP forms): ``backward``, ``step``,
    ``zero_grad``, ``clip_grad_norm(model, max_norm)``, the wrapped optimizer as ``.optim``.

    It is a ``torch.optim.Optimizer`` whose ``param_groups``/``state``/``defaults`` are the wrapped optimizer's,
    so an LR scheduler can be built on it. ``state_dict`` holds the loss scaler too; ``load_state_dict``
    also takes a plain optimizer state dict.
    """

    def __init__(self, optim: torch.optim.Optimizer, precision: FP32Precision, model: nn.Module,
                 clip_grad_norm: float = 0.0):
        # Optimizer.__init__ is not called: the groups and state stay the wrapped optimizer's own
        self.optim = optim
        self.precision = precision
        self._model = model
        self._clip = float(clip_grad_norm or 0.0)

    param_groups = property(lambda self: self.optim.param_groups,
                            lambda self, groups: setattr(self.optim, "param_groups", groups))
    state = property(lambda self: self.optim.state)
    defaults = property(lambda self: self.optim.defaults)

    def add_param_group(self, param_group: dict) -> None:
        self.optim.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.precision.zero_grad(self._model, self.optim, set_to_none=set_to_none)

    def backward(self, loss: torch.Tensor) -> None:
        self.precision.backward(loss)

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        self.precision.backward_by_grad(tensor, grad)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> Optional[torch.Tensor]:
        """Clip the true-valued gradients (unscaled first) to ``max_norm``; 0 does nothing. The norm configured as
        ``clip_grad_norm`` in the AMP config is applied at ``step`` (as legacy naive AMP did), not twice."""
        if max_norm <= 0 or max_norm == self._clip:
            return None
        return self._clip_now(max_norm)

    def _clip_now(self, max_norm: float) -> torch.Tensor:
        self.precision.unscale_(self.optim)
        return torch.nn.utils.clip_grad_norm_(self.precision.master_params(self._model, self.optim), max_norm)

    def step(self, *args, **kwargs):
        """Unscale, skip the update on an fp16 overflow (and back the loss scale off), else step."""
        if args or kwargs:
            raise TypeError("the AMP optimizer's step() takes no closure: call backward(loss) first, then step()")
        norm = self._clip_now(self._clip) if self._clip > 0 else None
        return self._step_result(self.precision.step(self.optim), norm)

    def _step_result(self, applied, norm):
        """What ``step`` returns, given the precision's step result and the clipped norm: nothing, as torch's."""
        return None

    @property
    def loss_scale(self) -> Optional[float]:
        return self.precision.loss_scale

    def state_dict(self) -> dict:
        return {"optimizer": self.optim.state_dict(), "amp": self.precision.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if "amp" in state_dict and "optimizer" in state_dict:
            self.optim.load_state_dict(state_dict["optimizer"])
            self.precision.load_state_dict(state_dict["amp"])
        else:  # a plain optimizer's state (e.g. saved before AMP was turned on)
            self.optim.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optim!r})"


class TorchAMPOptimizer(AMPOptimizer):
    """Legacy ``TorchAMPOptimizer``: torch's GradScaler (``.scaler``) around the optimizer."""

    @property
    def scaler(self):
        return self.precision.scaler


class NaiveAMPOptimizer(AMPOptimizer):
    """Legacy ``NaiveAMPOptimizer``: fp32 master weights in the optimizer, the dynamic loss scaler
    (``.grad_scaler``); the fp16 model weights are refreshed from the masters after each update."""

    @property
    def grad_scaler(self):
        return self.precision.scaler

    def _step_result(self, applied, norm):
        """``(True, grad_norm)`` when the update was applied and ``(False, None)`` when an overflow skipped it, as
        legacy's ``FP16Optimizer.step`` returned (``grad_norm``: the norm clipped to the AMP config's
        ``clip_grad_norm``, None without one)."""
        return (True, norm) if applied else (False, None)


class TorchAMPModel(nn.Module):
    """Legacy ``TorchAMPModel``: the model's forward under autocast (``.model`` is the wrapped model)."""

    def __init__(self, model: nn.Module, precision: FP32Precision):
        super().__init__()
        self.model = model
        self._precision = precision

    def forward(self, *args, **kwargs):
        with self._precision.autocast():
            return self.model(*args, **kwargs)


class TorchAMPLoss(nn.Module):
    """Legacy ``TorchAMPLoss``: the criterion under autocast (``.loss`` is the wrapped criterion)."""

    def __init__(self, loss: nn.Module, precision: FP32Precision):
        super().__init__()
        self.loss = loss
        self._precision = precision

    def forward(self, *args, **kwargs):
        with self._precision.autocast():
            return self.loss(*args, **kwargs)


class NaiveAMPModel(nn.Module):
    """Legacy ``NaiveAMPModel``: fp16 weights; floating inputs cast to fp16 and outputs back to fp32 (by the
    naive precision's hooks on the wrapped ``.model``). Buffers are not averaged across ranks here (legacy's
    ``sync_buffer``): in a multi-process loop, wrap the model in DDP or use the Engine."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)


def _options(precision_cls, amp_config, mode_name: str) -> dict:
    """``amp_config`` as keyword arguments of the precision class, unknown keys refused with the known ones."""
    options = dict(amp_config or {})
    options.pop("mode", None)
    accepted = [n for n in inspect.signature(precision_cls.__init__).parameters if n != "self"]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ConfigException(f"{mode_name} amp_config does not take {', '.join(map(repr, unknown))}; "
                              f"its options are: {', '.join(accepted)}")
    return options


def convert_to_torch_amp(model: nn.Module, optimizer: torch.optim.Optimizer, criterion: Optional[nn.Module] = None,
                         amp_config=None):
    """torch autocast (fp16) + ``torch.amp.GradScaler``: ``(TorchAMPModel, TorchAMPOptimizer, TorchAMPLoss)``.

    ``amp_config``: the GradScaler's ``init_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
    ``enabled``. The criterion stays None when none is given."""
    precision = TorchAMPPrecision(**_options(TorchAMPPrecision, amp_config, "AMP_TYPE.TORCH"))
    return _torch_style(model, optimizer, criterion, precision)


def _torch_style(model, optimizer, criterion, precision):
    model, optimizer = precision.setup(model, optimizer)
    loss = TorchAMPLoss(criterion, precision) if criterion is not None else None
    return TorchAMPModel(model, precision), TorchAMPOptimizer(optimizer, precision, model), loss


def convert_to_bf16_amp(model: nn.Module, optimizer: torch.optim.Optimizer, criterion: Optional[nn.Module] = None,
                        amp_config=None):
    """bf16 autocast over fp32 weights (no loss scaling), in the torch-mode wrappers."""
    _options(BF16Precision, amp_config, "AMP_TYPE.BF16")
    return _torch_style(model, optimizer, criterion, BF16Precision())


def convert_to_naive_amp(model: nn.Module, optimizer: torch.optim.Optimizer, amp_config=None):
    """fp16 weights, fp32 master weights, dynamic loss scale: ``(NaiveAMPModel, NaiveAMPOptimizer)``.

    ``amp_config``: the loss scaler's ``initial_scale``, ``growth_factor``, ``backoff_factor``,
    ``growth_interval``, ``hysteresis``, ``min_scale``, ``max_scale``, ``dynamic_grad_scale``, ``verbose``, and
    ``clip_grad_norm`` (applied to the true-valued fp32 gradients at each ``step``)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        # DDP made its gradient buckets for the fp32 parameters; cast to fp16 under it, the ranks' gradients
        # would no longer meet, and the ranks would drift apart without an error
        raise ValueError("convert_to_naive_amp got a DistributedDataParallel model: convert the plain model first, "
                         "then wrap the returned model in DDP (as initialize does)")
    options = dict(amp_config or {})
    clip = options.pop("clip_grad_norm", 0.0)
    precision = NaiveAMPPrecision(**_options(NaiveAMPPrecision, options, "AMP_TYPE.NAIVE"))
    model, optimizer = precision.setup(model, optimizer)
    return NaiveAMPModel(model), NaiveAMPOptimizer(optimizer, precision, model, clip_grad_norm=clip)


def convert_to_apex_amp(model: nn.Module, optimizer: torch.optim.Optimizer, amp_config=None):
    """Refused: NVIDIA apex is out of scope."""
    raise ConfigException(_APEX_REFUSAL)


def convert_to_amp(model: nn.Module, optimizer: torch.optim.Optimizer, criterion: Optional[nn.Module], mode,
                   amp_config=None):
    """``(model, optimizer, criterion)`` converted to ``mode`` (``AMP_TYPE.TORCH``, ``NAIVE`` or ``BF16``; the
    criterion is wrapped only in the autocast modes, as legacy did). ``AMP_TYPE.APEX`` is refused."""
    amp_mode = normalize_amp_mode(mode)
    if amp_mode is AMP_TYPE.APEX:
        raise ConfigException(_APEX_REFUSAL)
    if amp_mode is AMP_TYPE.TORCH:
        return convert_to_torch_amp(model, optimizer, criterion, amp_config)
    if amp_mode is AMP_TYPE.BF16:
        return convert_to_bf16_amp(model, optimizer, criterion, amp_config)
    if amp_mode is AMP_TYPE.NAIVE:
        model, optimizer = convert_to_naive_amp(model, optimizer, amp_config)
        return model, optimizer, criterion
    raise ConfigException(f"convert_to_amp needs a mode (AMP_TYPE.TORCH, AMP_TYPE.NAIVE or AMP_TYPE.BF16), got {mode!r}")
