"""``initialize``: decide every feature once and return the Engine.

Also re-exports the launch functions (the legacy ``colossalai.initialize`` module held both).
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Tuple, Union

import torch
from torch import nn

from .amp.precision import build_precision
from .context.features import describe_features
from .core.global_context import global_context as gpc
from .engine.accumulation import AccumulationDataLoader, AccumulationWindow
from .engine.engine import Engine, EngineLRScheduler
from .engine.schedule import NonPipelineSchedule
from .engine.strategy import AllReduceStrategy, DDPStrategy, SingleProcess, broadcast_module
from .launch import get_default_parser, launch, launch_from_openmpi, launch_from_slurm, launch_from_torch
from .logging import get_dist_logger


def _build_model(model) -> nn.Module:
    if isinstance(model, nn.Module):
        return model
    if callable(model):
        built = model()
        if not isinstance(built, nn.Module):
            raise TypeError(f"initialize(model=...): the callable returned {type(built).__name__}, not a torch.nn.Module")
        return built
    raise TypeError(f"initialize(model=...) must be a torch.nn.Module or a callable that builds one, got {type(model).__name__}")


def _build_optimizer(optimizer, model: nn.Module) -> torch.optim.Optimizer:
    if isinstance(optimizer, torch.optim.Optimizer):
        model_params = {id(p) for p in model.parameters()}
        foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in model_params]
        if foreign:
            raise ValueError(f"initialize(optimizer=...): {len(foreign)} of the optimizer's parameters are not parameters "
                             f"of the model (was the optimizer built for another model, or before the model was rebuilt?). "
                             f"Build it from model.parameters(), or pass a callable like "
                             f"lambda params: torch.optim.SGD(params, lr=0.1)")
        return optimizer
    if callable(optimizer):
        built = optimizer(model.parameters())
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(f"initialize(optimizer=...): the callable returned {type(built).__name__}, not a torch.optim.Optimizer")
        return built
    raise TypeError(f"initialize(optimizer=...) must be a torch.optim.Optimizer or a callable taking the parameters, "
                    f"got {type(optimizer).__name__}")


def _build_strategy(config, world_size: int, precision):
    zero = config.get("zero")
    if zero:
        from .engine.zero import FSDPStrategy, ZeroStage1Strategy

        if zero["stage"] == 1:
            return ZeroStage1Strategy(**dict(config.get("torch_ddp") or {}))
        return FSDPStrategy(stage=zero["stage"], shard_modules=zero.get("shard_modules"),
                            offload_optimizer=bool(zero.get("offload_optimizer", False)),
                            reshard_after_forward=zero.get("reshard_after_forward"),
                            param_dtype=getattr(precision, "compute_dtype", None))
    handlers = config.get("gradient_handler")
    if world_size <= 1:
        return SingleProcess()
    if handlers is not None:
        if not handlers:
            return SingleProcess()  # an explicit empty list: the user syncs gradients themselves
        bucket = handlers[0].get("bucket_size_mb", 25.0)
        return AllReduceStrategy(bucket_size_mb=bucket)
    return DDPStrategy(**dict(config.get("torch_ddp") or {}))


def initialize(model: Union[nn.Module, Callable[[], nn.Module]],
               optimizer: Union[torch.optim.Optimizer, Callable],
               criterion: Optional[Callable] = None,
               train_dataloader: Optional[Iterable] = None,
               test_dataloader: Optional[Iterable] = None,
               lr_scheduler=None,
               ophooks=None,
               verbose: bool = True,
               data_process_func: Optional[Callable] = None) -> Tuple[Engine, Optional[Iterable], Optional[Iterable], object]:
    """Compose the features ``gpc.config`` asks for; returns ``(engine, train_dataloader, test_dataloader, lr_scheduler)``.

    ``model`` may be a module or a callable that builds one; ``optimizer`` an optimizer or a
    callable taking the parameters. Works before ``launch`` too (as one process, fp32).
    """
    if ophooks:
        raise ValueError("initialize(ophooks=...): op-hooks (Gemini) are not supported by colossal_lite; remove the argument")
    config = gpc.config if gpc.config is not None else {}
    logger = get_dist_logger()
    model = _build_model(model)
    if criterion is not None and not callable(criterion):
        raise TypeError(f"initialize(criterion=...) must be callable (e.g. torch.nn.CrossEntropyLoss()), got {type(criterion).__name__}")

    torch.backends.cudnn.benchmark = bool(config.get("cudnn_benchmark", False))
    torch.backends.cudnn.deterministic = bool(config.get("cudnn_deterministic", False))

    device = gpc.device
    model = model.to(device)
    optimizer = _build_optimizer(optimizer, model)
    world_size = gpc.get_world_size()
    broadcast_module(model)  # every rank starts from rank 0's parameters

    precision = build_precision(config.get("fp16"))
    strategy = _build_strategy(config, world_size, precision)
    precision.sharded_gradients = getattr(strategy, "shards_gradients", False)
    model, optimizer = precision.setup(model, optimizer)
    model, optimizer = strategy.setup(model, optimizer)
    compile_cfg = config.get("compile")
    if compile_cfg:
        model = torch.compile(model, **({} if compile_cfg is True else dict(compile_cfg)))

    accumulation = config.get("gradient_accumulation", 1) or 1
    auto = accumulation == "auto"
    window = AccumulationWindow(1 if auto else accumulation)
    engine = Engine(model=model, optimizer=optimizer, criterion=criterion, precision=precision, strategy=strategy,
                    window=window, clip_grad_norm=config.get("clip_grad_norm", 0.0),
                    schedule=NonPipelineSchedule(data_process_func), device=device,
                    grad_reduction=config.get("grad_reduction", "mean"), compiled=bool(compile_cfg))
    gpc._engines.add(engine)
    if auto:
        from .engine.auto_batch import AutoMicroBatcher

        engine.auto_batcher = AutoMicroBatcher(logger)
    if train_dataloader is not None:
        train_dataloader = AccumulationDataLoader(train_dataloader, window)
    if lr_scheduler is not None:
        lr_scheduler = EngineLRScheduler(lr_scheduler, engine)
    if verbose:
        summary = "\n".join(f"  - {line}" for line in describe_features(config, world_size))
        logger.info(f"colossal_lite engine ready on {device}, world size {world_size}:\n{summary}", ranks=[0])
        if world_size > 1 and isinstance(strategy, SingleProcess) and type(strategy) is SingleProcess:
            logger.warning("gradient_handler=[] was given: gradients are not all-reduced across ranks", ranks=[0])
    return engine, train_dataloader, test_dataloader, lr_scheduler


__all__ = ["initialize", "launch", "launch_from_torch", "launch_from_slurm", "launch_from_openmpi", "get_default_parser"]
