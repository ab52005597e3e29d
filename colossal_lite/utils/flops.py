"""The FLOPs of a training micro-step, counted once without running the model for real, and a device's peak.

``count_step_flops`` runs the model's forward, the criterion and the backward on meta tensors (shapes only,
no memory, no arithmetic) under ``torch.utils.flop_counter.FlopCounterMode``, so the count is the
arithmetic of the model as written (matrix products, convolutions, attention), whatever its class. The same
pass counts the operators a step dispatches, which tells many small kernels from a few large ones.

``peak_flops`` gives the dense peak of a device in FLOP/s for the precision a run computes in: from
``PEAK_TFLOPS`` (GPUs by name), from the user, or on a CPU measured by a short matrix product, once per process.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from ..core.tree import map_leaves

__all__ = ["StepFlops", "count_step_flops", "PEAK_TFLOPS", "peak_flops", "lookup_peak_tflops", "measure_cpu_peak",
           "compute_kind"]

#: Dense (not sparse) peak TFLOP/s of common accelerators by the kind of arithmetic a run uses: the vendors'
#: data-sheet figures for the dense tensor-core rate. The first name that is part of the device's name wins,
#: so the longer, more specific names come first.
PEAK_TFLOPS: Tuple[Tuple[str, Dict[str, float]], ...] = (
    ("H200 NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    ("H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("GH200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    ("H100 PCIe", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H800", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("B200", {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 80.0}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("A800", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("A10G", {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 31.2}),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    ("RTX 4090", {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    ("RTX A6000", {"bf16": 154.8, "fp16": 154.8, "tf32": 77.4, "fp32": 38.7}),
    ("V100", {"fp16": 125.0, "fp32": 15.7, "tf32": 15.7}),
    ("T4", {"fp16": 65.0, "fp32": 8.1, "tf32": 8.1}),
    ("MI300X", {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
)


@dataclass
class StepFlops:
    """What one micro-batch's forward, loss and backward compute: ``flops`` (FLOP), ``ops`` (operators other
    than views) and ``samples`` (the micro-batch's rows the count was taken on)."""

    flops: int
    ops: int
    samples: int

    @property
    def flops_per_sample(self) -> float:
        return self.flops / max(self.samples, 1)


class _OpCounter(TorchDispatchMode):
    """Counts the operators dispatched (views excluded: they launch no kernel)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def _meta(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    from torch.distributed.tensor import DTensor

    # a parameter sharded by FSDP2 is a DTensor: its copy has the full shape, the one the forward computes with
    meta = torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, DTensor) else \
        torch.empty_like(t, device="meta")
    return meta.requires_grad_(t.requires_grad and t.is_floating_point())


#: A module's hooks around its forward and backward (``nn.Module``'s own attributes).
_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
                 "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks")


@contextlib.contextmanager
def _module_hooks_off(model: torch.nn.Module):
    """``model``'s modules without their forward and backward hooks for the duration, then with them again."""
    saved = [(module, {name: getattr(module, name) for name in _MODULE_HOOKS}) for module in model.modules()]
    try:
        for module, hooks in saved:
            for name, table in hooks.items():
                setattr(module, name, type(table)())
        yield
    finally:
        for module, hooks in saved:
            for name, table in hooks.items():
                setattr(module, name, table)


def count_step_flops(model: torch.nn.Module, data: Any, label: Any, criterion: Optional[Callable],
                     samples: int, call: Callable = None) -> StepFlops:
    """Count ``model``'s forward on ``data``, ``criterion(output, label)`` and the backward to the parameters,
    on meta copies of the parameters, buffers and batch (the model's own tensors are not touched).
    ``call(fn, data)`` spreads the batch into the call (default: ``fn(data)``). Raises what the model raises
    when it cannot run on meta tensors (a model that reads a value, e.g. ``.item()``).

    A model sharded by FSDP2 (ZeRO stages 2 and 3) is counted at its full shapes with its module hooks set aside:
    FSDP2's hooks gather and reshard the live parameters around each unit's forward, which on meta copies would
    leave the live model in a state its next forward fails on (a user's own module hooks are not run either)."""
    from torch.distributed.fsdp import FSDPModule

    sharded = any(isinstance(module, FSDPModule) for module in model.modules())
    params = {name: _meta(p) for name, p in model.named_parameters()}
    state = dict(params, **{name: torch.empty_like(b, device="meta") for name, b in model.named_buffers()})
    data, label = map_leaves(_meta, data), map_leaves(_meta, label)
    call = call or (lambda fn, x: fn(x))
    counter, ops = FlopCounterMode(display=False), _OpCounter()
    with _module_hooks_off(model) if sharded else contextlib.nullcontext(), counter, ops:
        output = call(lambda *a, **k: functional_call(model, state, a, k), data)
        loss = criterion(output, label) if criterion is not None else output
        if isinstance(loss, tuple):  # (loss_sum, num_tokens) of a per-token criterion
            loss = loss[0]
        wanted = [p for p in params.values() if p.requires_grad]
        if wanted and loss.requires_grad:
            torch.autograd.grad(loss.sum() if loss.ndim else loss, wanted, allow_unused=True)
    return StepFlops(flops=int(counter.get_total_flops()), ops=ops.ops, samples=int(samples))


def compute_kind(precision_name: str) -> str:
    """``'bf16'``, ``'fp16'``, ``'tf32'`` or ``'fp32'``: the arithmetic a precision mode's matrix products use
    (fp32 runs in tf32 where torch is allowed to)."""
    if precision_name == "bf16":
        return "bf16"
    if precision_name in ("torch_amp", "naive_amp", "fp16"):
        return "fp16"
    return "tf32" if torch.get_float32_matmul_precision() != "highest" else "fp32"


def lookup_peak_tflops(device_name: str, kind: str) -> Optional[float]:
    """The dense peak TFLOP/s of the device called ``device_name`` for ``kind``; None when not in the table."""
    for name, peaks in PEAK_TFLOPS:
        if name.lower() in device_name.lower():
            return peaks.get(kind)
    return None


def measure_cpu_peak(seconds: float = 0.2, size: int = 512) -> float:
    """FLOP/s of the best of repeated ``size``-square float32 matrix products over about ``seconds``: the rate
    this CPU reaches on the arithmetic that dominates training, taken as its peak."""
    numbers = torch.Generator().manual_seed(0)  # (the global generator untouched: training's draws stay its own)
    a, b = torch.randn(size, size, generator=numbers), torch.randn(size, size, generator=numbers)
    torch.mm(a, b)  # the first product allocates and warms the library up
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2.0 * size ** 3 / max(time.perf_counter() - start, 1e-9))
    return best


_CPU_PEAK: Dict[str, float] = {}


def _cpu_peak() -> float:
    """``measure_cpu_peak()``, measured once per process: the CPU does not change between fits."""
    if "cpu" not in _CPU_PEAK:
        _CPU_PEAK["cpu"] = measure_cpu_peak()
    return _CPU_PEAK["cpu"]


def peak_flops(device: torch.device, kind: str, override_tflops: Optional[float] = None,
               measure_cpu: bool = True) -> Tuple[Optional[float], str]:
    """-> (peak FLOP/s or None, where it came from, in words for the report)."""
    if override_tflops is not None:
        return float(override_tflops) * 1e12, f"{override_tflops:g} TFLOP/s given by the user"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tflops = lookup_peak_tflops(name, kind)
        if tflops is None:
            return None, f"no MFU: {name} ({kind}) is not in the peak table; give peak_tflops="
        return tflops * 1e12, f"{tflops:g} TFLOP/s dense {kind}, {name}"
    if device.type == "cpu" and measure_cpu:
        peak = _cpu_peak()
        return peak, f"{peak / 1e9:.1f} GFLOP/s measured by a float32 matrix product on this CPU"
    return None, f"no MFU: no peak known for a {device.type} device; give peak_tflops="
