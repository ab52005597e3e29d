"""``initialize``: decide every feature once and return the Engine.

Also re-exports the launch functions (the legacy ``colossalai.initialize`` module held both).
"""
from __future__ import annotations

import difflib
import os
import warnings
from typing import Callable, Iterable, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

from .amp.precision import build_precision
from .context.config import Config, ConfigException
from .context.defaults import GRADIENT_BUCKET_MB, setting
from .context.features import describe_features
from .context.validation import FEATURE_KEYS, ForeignConfigKeyWarning, validate_config
from .core.global_context import global_context as gpc
from .engine.accumulation import AccumulationDataLoader, AccumulationWindow
from .engine.auto_batch import AutoMicroBatcher
from .engine.engine import Engine, EngineLRScheduler, torch_optimizer
from .engine.gradient_handler import DataParallelGradientHandler
from .engine.loss_guard import build_loss_guard
from .engine.reduction import build_reduction
from .engine.schedule import NonPipelineSchedule
from .engine.strategy import AllReduceStrategy, DDPStrategy, HandlerStrategy, SingleProcess, broadcast_module
from .engine.zero import FSDPStrategy, ZeroStage1Strategy
from .launch import get_default_parser, launch, launch_from_openmpi, launch_from_slurm, launch_from_torch
from .logging import get_dist_logger

# Multi-process launchers, the variable each sets to the number of processes it started, and the call that
# joins them into a process group. The first launcher whose variable is set decides (torchrun inside a
# SLURM allocation is torchrun).
_LAUNCHERS = (
    (("WORLD_SIZE",), "WORLD_SIZE", "launch_from_torch(config=...)"),
    (("SLURM_PROCID", "SLURM_NTASKS"), "SLURM_NTASKS", "launch_from_slurm(config=..., host=..., port=...)"),
    (("SLURM_PROCID", "SLURM_NPROCS"), "SLURM_NPROCS", "launch_from_slurm(config=..., host=..., port=...)"),
    (("OMPI_COMM_WORLD_SIZE",), "OMPI_COMM_WORLD_SIZE", "launch_from_openmpi(config=..., host=..., port=...)"),
)


def _check_launched():
    """Refuse to build one engine per process when a launcher started several but no process group joins them:
    each would train its own copy of the model on all the data, with no gradient sync and no error."""
    if dist.is_available() and dist.is_initialized():
        return
    for needed, size_var, call in _LAUNCHERS:
        if not all(v in os.environ for v in needed):
            continue
        try:
            size = int(os.environ[size_var])
        except ValueError:
            return
        if size > 1:
            raise RuntimeError(
                f"initialize: this process is one of {size} started together ({size_var}={size}), but no process group "
                f"exists, so each process would train its own copy of the model on all the data with no gradient sync. "
                f"Fix: call colossal_lite.{call} before colossal_lite.initialize(...) (or, to run this process alone "
                f"on purpose, colossal_lite.launch(config=..., rank=0, world_size=1, host=None, port=None))")
        return


# The config keys that describe one engine, so that ``initialize(..., config=...)`` may set them for it alone
# (a GAN's discriminator with its own accumulation); the other feature keys belong to the whole process.
ENGINE_KEYS = ("fp16", "clip_grad_norm", "gradient_accumulation", "grad_reduction", "nonfinite_loss", "zero",
               "torch_ddp", "gradient_handler", "compile")


def _engine_config(launch_config, overrides):
    """The config this engine is built from: the launch config with ``overrides`` (``initialize(config=...)``)
    laid over it, checked as a whole (a combination may be refused)."""
    if overrides is None:
        return launch_config
    if not isinstance(overrides, dict):
        raise TypeError(f"initialize(config=...) must be a dict of this engine's features, e.g. "
                        f"config=dict(gradient_accumulation=2), got {type(overrides).__name__}")
    for key in overrides:
        if key in ENGINE_KEYS:
            continue
        if key in FEATURE_KEYS:
            raise ValueError(f"initialize(config=...): '{key}' is a setting of the whole process, not of one engine; "
                             f"set it in the config given to launch (launch_from_torch(config=...))")
        meant = difflib.get_close_matches(str(key), ENGINE_KEYS, n=1, cutoff=0.8)
        hint = f"did you mean '{meant[0]}'? " if meant else ""
        raise ValueError(f"initialize(config=...): '{key}' is not an engine feature; {hint}an engine's own features "
                         f"are {', '.join(ENGINE_KEYS)}")
    # None takes the launch config's setting away for this engine (it gets the default), e.g. zero=None
    merged = Config({key: value for key, value in {**dict(launch_config), **overrides}.items() if value is not None})
    try:
        with warnings.catch_warnings():
            # a foreign name can only be the launch config's (the overrides are engine keys): it was said there
            warnings.simplefilter("ignore", ForeignConfigKeyWarning)
            validate_config(merged)
    except ConfigException as err:
        raise ConfigException(f"initialize(config=...): {err}") from None
    return merged


def _warn_of_another_global_batch(logger, launch_config, config, overrides, world_size: int) -> None:
    """An engine given its own gradient_accumulation trains on another global batch than the config's
    ``global_batch_size``, which the launch log states: say so, since it may be meant (a GAN's discriminator)."""
    if not overrides or "gradient_accumulation" not in overrides:
        return
    micro, glob = config.get("micro_batch_size"), config.get("global_batch_size")
    accum = setting(config, "gradient_accumulation") or 1
    if micro is None or glob is None or accum == "auto" or micro * world_size * accum == glob:
        return
    where = launch_config._where("global_batch_size") if isinstance(launch_config, Config) else "<dict config>"
    logger.warning(
        f"initialize(config=dict(gradient_accumulation={overrides['gradient_accumulation']!r})): this engine's "
        f"global batch is micro_batch_size x data-parallel size x gradient_accumulation = {micro} x {world_size} x "
        f"{accum} = {micro * world_size * accum} samples per optimizer step, not the config's global_batch_size = "
        f"{glob} ({where}), which the other engines keep. Leave gradient_accumulation out of initialize(config=...) "
        f"to train on the configured batch, or ignore this if the engine is meant to differ", ranks=[0])


def _warn_of_undivided_train_data(logger, loader, world_size: int) -> None:
    """A ``DataLoader`` over a map-style dataset with torch's default sampler gives every rank the whole dataset
    (in the same order under the launch's seed): N ranks then train on the same batches, N times the compute of
    one, and nothing fails. Said once, since a program may mean it (ranks that draw their own data)."""
    if world_size < 2 or not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return
    if type(loader.sampler) not in (SequentialSampler, RandomSampler):
        return
    logger.warning(
        f"initialize(train_dataloader=...): the loader's sampler is torch's {type(loader.sampler).__name__}, so each "
        f"of the {world_size} ranks iterates the whole dataset: they train on the same samples. Build it with "
        f"colossal_lite.utils.get_dataloader(dataset, shuffle=..., batch_size=...) (each rank its share, resumable "
        f"inside an epoch) or a torch.utils.data.DistributedSampler", ranks=[0])


def _check_criterion(criterion):
    if criterion is None:
        return
    if isinstance(criterion, type):  # a class is callable too, but calling it builds a loss instead of computing one
        raise TypeError(f"initialize(criterion=...): got the class {criterion.__name__}, not a loss function; "
                        f"pass an instance: {criterion.__name__}()")
    if not callable(criterion):
        raise TypeError(f"initialize(criterion=...) must be callable (e.g. torch.nn.CrossEntropyLoss()), "
                        f"got {type(criterion).__name__}")


def _loader_batch_size(loader) -> Optional[int]:
    """Samples per batch of a loader that says so (``DataLoader.batch_size``, or its batch sampler's)."""
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def _check_micro_batch_size(config, loader, world_size: int):
    """The config's batch arithmetic must describe the loader that really feeds the engine."""
    micro = config.get("micro_batch_size")
    real = _loader_batch_size(loader) if micro is not None else None
    if real is None or real == micro:
        return
    accum = setting(config, "gradient_accumulation") or 1
    where = config._where("micro_batch_size") if isinstance(config, Config) else "<dict config>"
    # 'auto' starts each batch whole, so a step is one loader batch per rank until memory runs out
    steps = [] if accum == "auto" else [accum]
    configured = " x ".join(map(str, [micro, world_size, *steps]))
    really = " x ".join(map(str, [real, world_size, *steps]))
    per_step = 1 if accum == "auto" else accum
    glob = micro * world_size * per_step  # the launch made global_batch_size agree with it (not checked with 'auto')
    names = "micro_batch_size x data-parallel size" + ("" if accum == "auto" else " x gradient_accumulation")
    raise ValueError(
        f"initialize(train_dataloader=...): the train loader's batch size is {real}, but the config ({where}) has "
        f"micro_batch_size = {micro}: {names} = {configured} = {glob} (global batch), while this loader gives "
        f"{really} = {real * world_size * per_step} samples per optimizer step. Fix: build the loader with "
        f"batch_size={micro} (colossal_lite.utils.get_dataloader takes micro_batch_size when no batch_size is given), "
        f"or write micro_batch_size = {real} in the config")


def _build_model(model) -> nn.Module:
    if isinstance(model, nn.Module):
        return model
    if isinstance(model, type) and issubclass(model, nn.Module):
        try:
            return model()
        except TypeError as error:
            raise TypeError(f"initialize(model=...): got the class {model.__name__}, and building it with no arguments "
                            f"failed ({error}); pass a model: {model.__name__}(...)") from None
    if callable(model):
        built = model()
        if not isinstance(built, nn.Module):
            raise TypeError(f"initialize(model=...): the callable returned {type(built).__name__}, not a torch.nn.Module")
        return built
    raise TypeError(f"initialize(model=...) must be a torch.nn.Module or a callable that builds one, got {type(model).__name__}")


def _build_optimizer(optimizer, model: nn.Module) -> torch.optim.Optimizer:
    optimizer = torch_optimizer(optimizer, "initialize(optimizer=...)")
    if isinstance(optimizer, torch.optim.Optimizer):
        model_params = {id(p) for p in model.parameters()}
        foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in model_params]
        if foreign:
            raise ValueError(f"initialize(optimizer=...): {len(foreign)} of the optimizer's parameters are not parameters "
                             f"of the model (was the optimizer built for another model, or before the model was rebuilt?). "
                             f"Build it from model.parameters(), or pass a callable like "
                             f"lambda params: torch.optim.SGD(params, lr=0.1)")
        return optimizer
    if isinstance(optimizer, type):  # a class is callable too, but it would train at its default learning rate
        raise TypeError(f"initialize(optimizer=...): got the class {optimizer.__name__}, not an optimizer; pass "
                        f"{optimizer.__name__}(model.parameters(), lr=...) or a function that builds one from the "
                        f"parameters: lambda params: {optimizer.__name__}(params, lr=...)")
    if callable(optimizer):
        built = optimizer(model.parameters())
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(f"initialize(optimizer=...): the callable returned {type(built).__name__}, not a torch.optim.Optimizer")
        return built
    raise TypeError(f"initialize(optimizer=...) must be a torch.optim.Optimizer or a callable taking the parameters, "
                    f"got {type(optimizer).__name__}")


def _check_scheduler(lr_scheduler, optimizer) -> None:
    """A scheduler built on another optimizer would set learning rates that this engine never reads."""
    target = getattr(lr_scheduler, "optimizer", None)
    if isinstance(target, torch.optim.Optimizer) and target.param_groups is not optimizer.param_groups:
        name = type(lr_scheduler).__name__
        raise ValueError(f"initialize(lr_scheduler=...): the {name} was built on another optimizer than the one given "
                         f"to initialize, so the learning rates it sets would never be used. Fix: build it on the "
                         f"optimizer you pass: {name}(optimizer, ...)")


def _build_strategy(config, world_size: int, precision):
    zero = config.get("zero")
    if zero:
        if zero["stage"] == 1:
            return ZeroStage1Strategy(**dict(config.get("torch_ddp") or {}))
        return FSDPStrategy(stage=zero["stage"], shard_modules=zero.get("shard_modules"),
                            offload_optimizer=bool(zero.get("offload_optimizer", False)),
                            reshard_after_forward=zero.get("reshard_after_forward"),
                            param_dtype=getattr(precision, "compute_dtype", None))
    handlers = config.get("gradient_handler")
    if handlers and any(h["type"] != DataParallelGradientHandler.__name__ for h in handlers):
        return HandlerStrategy(handlers)  # a user's handler runs at every world size, as legacy ran it
    if world_size <= 1:
        return SingleProcess()
    if handlers is not None:
        if not handlers:
            return SingleProcess()  # an explicit empty list: the user syncs gradients themselves
        bucket = handlers[0].get("bucket_size_mb", GRADIENT_BUCKET_MB)
        return AllReduceStrategy(bucket_size_mb=bucket)
    return DDPStrategy(**dict(config.get("torch_ddp") or {}))


def _compose(config, model: nn.Module, optimizer, world_size: int):
    """The precision and data-parallel parts the config asks for, applied to model and optimizer (then
    ``torch.compile`` when asked) -> ``(model, optimizer, precision, strategy)``."""
    precision = build_precision(config.get("fp16"))
    strategy = _build_strategy(config, world_size, precision)
    precision.shards_state = strategy.shards_state
    model, optimizer = precision.setup(model, optimizer)
    model, optimizer = strategy.setup(model, optimizer)
    compile_cfg = config.get("compile")
    if compile_cfg:
        model = torch.compile(model, **({} if compile_cfg is True else dict(compile_cfg)))
    return model, optimizer, precision, strategy


def _log_summary(logger, config, device, world_size: int, strategy):
    summary = "\n".join(f"  - {line}" for line in describe_features(config, world_size))
    logger.info(f"colossal_lite engine ready on {device}, world size {world_size}:\n{summary}", ranks=[0])
    if world_size > 1 and isinstance(strategy, SingleProcess) and type(strategy) is SingleProcess:
        logger.warning("gradient_handler=[] was given: gradients are not all-reduced across ranks", ranks=[0])


def initialize(model: Union[nn.Module, Callable[[], nn.Module]],
               optimizer: Union[torch.optim.Optimizer, Callable],
               criterion: Optional[Callable] = None,
               train_dataloader: Optional[Iterable] = None,
               test_dataloader: Optional[Iterable] = None,
               lr_scheduler=None,
               ophooks=None,
               verbose: bool = True,
               data_process_func: Optional[Callable] = None,
               config: Optional[dict] = None) -> Tuple[Engine, Optional[Iterable], Optional[Iterable], object]:
    """Compose the features ``gpc.config`` asks for; returns ``(engine, train_dataloader, test_dataloader, lr_scheduler)``.

    ``model`` may be a module or a callable that builds one; ``optimizer`` an optimizer or a
    callable taking the parameters. Works before ``launch`` too (as one process, fp32).
    ``config``: this engine's own features over the launch config (``ENGINE_KEYS``, e.g.
    ``dict(gradient_accumulation=2, grad_reduction='sum')``; a key set to None: without the launch config's
    setting), so engines of one program may differ.
    """
    if ophooks:
        raise ValueError("initialize(ophooks=...): op-hooks (Gemini) are not supported by colossal_lite; remove the argument")
    _check_launched()
    launch_config = gpc.config if gpc.config is not None else {}
    overrides = config
    config = _engine_config(launch_config, overrides)
    logger = get_dist_logger()
    _check_criterion(criterion)
    world_size = gpc.get_world_size()
    _warn_of_another_global_batch(logger, launch_config, config, overrides, world_size)
    _check_micro_batch_size(config, train_dataloader, world_size)
    _warn_of_undivided_train_data(logger, train_dataloader, world_size)
    model = _build_model(model)

    torch.backends.cudnn.benchmark = bool(setting(config, "cudnn_benchmark"))
    torch.backends.cudnn.deterministic = bool(setting(config, "cudnn_deterministic"))

    device = gpc.device
    model = model.to(device)
    optimizer = _build_optimizer(optimizer, model)
    _check_scheduler(lr_scheduler, optimizer)
    broadcast_module(model)  # every rank starts from rank 0's parameters

    model, optimizer, precision, strategy = _compose(config, model, optimizer, world_size)
    compile_cfg = config.get("compile")
    accumulation = setting(config, "gradient_accumulation") or 1
    auto = accumulation == "auto"
    window = AccumulationWindow(1 if auto else accumulation)
    engine = Engine(model=model, optimizer=optimizer, criterion=criterion, precision=precision, strategy=strategy,
                    window=window, clip_grad_norm=setting(config, "clip_grad_norm"),
                    schedule=NonPipelineSchedule(data_process_func), device=device,
                    reduction=build_reduction(setting(config, "grad_reduction")),
                    loss_guard=build_loss_guard(setting(config, "nonfinite_loss"), precision),
                    auto_batcher=AutoMicroBatcher(logger) if auto else None, compiled=bool(compile_cfg))
    gpc.add_engine(engine)
    if train_dataloader is not None:
        train_dataloader = AccumulationDataLoader(train_dataloader, window)
    if lr_scheduler is not None:
        lr_scheduler = EngineLRScheduler(lr_scheduler, engine)
    if verbose:
        _log_summary(logger, config, device, world_size, strategy)
    return engine, train_dataloader, test_dataloader, lr_scheduler


__all__ = ["initialize", "launch", "launch_from_torch", "launch_from_slurm", "launch_from_openmpi", "get_default_parser"]
