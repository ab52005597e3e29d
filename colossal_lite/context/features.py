"""Plain-words description of the feature stack a config switches on.

Shared by ``colossal-lite check`` and the summary ``initialize(verbose=True)`` logs.
"""
from __future__ import annotations

from typing import List, Optional

from ..amp.amp_type import AMP_TYPE
from .defaults import NAIVE_AMP_OPTIONS, TORCH_AMP_OPTIONS, setting
from .validation import normalize_amp_mode


def _fmt(options: dict) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in options.items())


def describe_features(config: dict, world_size: Optional[int] = None) -> List[str]:
    """One line per feature: precision, accumulation, clipping, data parallel, ZeRO, non-finite loss, cuDNN."""
    lines = [_precision_line(config)]
    accum = setting(config, "gradient_accumulation")
    if accum == "auto":
        lines.append("gradient accumulation: automatic (split a batch into more micro-batches when it runs out of memory)")
    elif accum and accum > 1:
        how = {"sum": "losses added up", "per-token-mean": "losses weighed by their real-token counts"}.get(
            config.get("grad_reduction"), "loss divided by the window size")
        lines.append(f"gradient accumulation: {accum} micro-batches per optimizer step ({how})")
    else:
        lines.append("gradient accumulation: off (one optimizer step per batch)")
    for key in ("micro_batch_size", "global_batch_size"):
        if key in config:
            lines.append(f"{key.replace('_', ' ')}: {config[key]}")
    clip = setting(config, "clip_grad_norm")
    lines.append(f"gradient clipping: global L2 norm clipped to {clip:g}" if clip else "gradient clipping: off")
    lines.append(_data_parallel_line(config, world_size))
    red = config.get("grad_reduction")
    if red:
        what = {"mean": "mean over micro-batches and ranks",
                "sum": "sum over micro-batches and ranks",
                "per-token-mean": "mean over every real token of the global batch (criterion returns (loss_sum, tokens))"}
        lines.append(f"gradient reduction: {what[red]}")
    nonfinite = setting(config, "nonfinite_loss")
    if nonfinite != "raise":
        what = {"skip": "an optimizer update whose window had an inf/NaN loss is skipped (one host read per update)",
                "ignore": "not checked (an inf/NaN loss is applied like any other)"}
        lines.append(f"non-finite loss: {what[nonfinite]}")
    comp = config.get("compile")
    if comp:
        lines.append(f"compile: torch.compile({'' if comp is True else _fmt(comp)})")
    lines.append(f"cuDNN: benchmark={bool(setting(config, 'cudnn_benchmark'))}, "
                 f"deterministic={bool(setting(config, 'cudnn_deterministic'))}")
    return lines


def _precision_line(config: dict) -> str:
    fp16 = config.get("fp16") or {}
    mode = normalize_amp_mode(fp16.get("mode")) if fp16 else None
    if mode is AMP_TYPE.TORCH:
        opts = {**TORCH_AMP_OPTIONS, **{k: v for k, v in fp16.items() if k != "mode"}}
        return f"precision: fp16 autocast with torch.amp.GradScaler ({_fmt(opts)})"
    if mode is AMP_TYPE.BF16:
        return "precision: bf16 autocast, fp32 weights, no loss scaling"
    if mode is AMP_TYPE.NAIVE:
        opts = {**NAIVE_AMP_OPTIONS, **{k: v for k, v in fp16.items() if k != "mode"}}
        scale = "dynamic loss scale" if opts["dynamic_grad_scale"] else "constant loss scale"
        shown = {k: opts[k] for k in ("initial_scale", "growth_factor", "backoff_factor", "growth_interval", "hysteresis")}
        return f"precision: naive fp16 (fp16 weights, fp32 master weights in the optimizer, {scale}: {_fmt(shown)})"
    return "precision: fp32"


def _data_parallel_line(config: dict, world_size: Optional[int]) -> str:
    where = "" if world_size is None else f" (world size {world_size})"
    zero = config.get("zero")
    if zero:
        stage = zero["stage"]
        what = {1: "optimizer state sharded (torch ZeroRedundancyOptimizer over DDP)",
                2: "gradients and optimizer state sharded (FSDP2, full parameters kept between forward and backward)",
                3: "parameters, gradients and optimizer state sharded (FSDP2)"}[stage]
        extra = ", optimizer offloaded to CPU" if zero.get("offload_optimizer") else ""
        return f"data parallel: ZeRO stage {stage}: {what}{extra}{where}"
    handlers = config.get("gradient_handler")
    if handlers and any(h.get("type") != "DataParallelGradientHandler" for h in handlers):
        names = ", ".join(str(h.get("type")) for h in handlers)
        return f"data parallel: your gradient handlers ({names}) in engine.step(), before clipping; no DDP{where}"
    if handlers is not None:
        return f"data parallel: bucketed gradient all-reduce in engine.step() (DataParallelGradientHandler){where}"
    ddp = config.get("torch_ddp") or {}
    kw = f" with {_fmt(ddp)}" if ddp else ""
    return f"data parallel: torch DistributedDataParallel{kw} when the world size is > 1{where}"
