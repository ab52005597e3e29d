"""``Engine``: the model, optimizer and criterion with the config's features composed in.

Used like PyTorch: ``zero_grad() / engine(x) / engine.criterion(out, y) / backward(loss) / step()``.
The parts are chosen once by ``initialize`` and always called: precision (``FP32Precision`` does
nothing), data-parallel strategy (``SingleProcess`` does nothing), accumulation window, gradient
reduction and loss guard. The per-step path asks no config and makes no host-device sync (fp16
loss-scaling modes read one overflow flag per update, like torch's GradScaler).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterable, Optional

import torch
from torch import nn

from ..amp.convert import AMPOptimizer
from ..amp.precision import FP32Precision
from ..checkpoint.optimizer_match import optimizer_class_name
from ..core.tree import clone_tensors
from ..logging import get_dist_logger
from .accumulation import AccumulationWindow, MicroBatch
from .batch import call_criterion
from .loss_guard import build_loss_guard
from .model_loss import ModelLoss
from .reduction import MeanReduction, not_a_loss
from .schedule import NonPipelineSchedule
from .strategy import DDPStrategy, HandlerStrategy, SingleProcess


class _Criterion:
    """``engine.criterion``: the user's criterion, run under the precision's autocast; with none, the loss the
    model returned (``ModelLoss``)."""

    def __init__(self, engine: "Engine"):
        self._engine = engine

    def __call__(self, *args, **kwargs):
        engine = self._engine
        if engine._criterion is None:
            return engine.model_loss(*args, **kwargs)
        with engine.precision.autocast():
            result = engine._criterion(*args, **kwargs)
        return engine.reduction.criterion_result(result)  # (a per-token mean reads a ``(loss_sum, num_tokens)`` pair)

    @property
    def wrapped(self):
        return self._engine._criterion

    def __repr__(self):
        return f"EngineCriterion({self._engine._criterion!r})"


def _strategy_with_handlers(strategy, gradient_handlers):
    """The data-parallel part: ``strategy``, or the legacy ``gradient_handlers`` run in its place."""
    if gradient_handlers is not None and not isinstance(gradient_handlers, (list, tuple)):
        raise TypeError(f"Engine(gradient_handlers=...) must be a list of gradient handlers, got "
                        f"{type(gradient_handlers).__name__}")
    if not gradient_handlers:  # None or [] (legacy passed [] for none): nothing replaces the strategy
        return strategy or SingleProcess()
    for i, handler in enumerate(gradient_handlers):
        if not callable(getattr(handler, "handle_gradient", None)):
            raise TypeError(f"Engine(gradient_handlers=[...]): item {i} is a {type(handler).__name__}, which has no "
                            f"handle_gradient(); give handler objects, e.g. "
                            f"DataParallelGradientHandler(model, optimizer)")
    if strategy is not None:
        raise ValueError(f"Engine got both gradient_handlers and strategy={type(strategy).__name__}: the handlers "
                         f"are the gradient sync; give one of the two")
    return HandlerStrategy(handlers=gradient_handlers)


class Engine:
    """The legacy ``Engine(model, optimizer, criterion, gradient_handlers, clip_grad_norm, ophook_list, verbose,
    schedule)``, in that order, so a legacy script that builds one by hand runs unchanged; ``initialize`` builds
    it with the parts the config chose (the keyword-only arguments).

    ``gradient_handlers``: handler objects (``BaseGradientHandler``, built with this model and optimizer) whose
    ``handle_gradient()`` runs once per optimizer update on every rank, before clipping; they replace the
    ``strategy``. ``ophook_list``: Gemini op-hooks are not supported; None or an empty list.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, criterion=None, gradient_handlers=None,
                 clip_grad_norm: float = 0.0, ophook_list=None, verbose: bool = True,
                 schedule: Optional[NonPipelineSchedule] = None, *, precision=None, strategy=None,
                 window: Optional[AccumulationWindow] = None, device: Optional[torch.device] = None,
                 reduction: Optional[MeanReduction] = None, loss_guard=None, auto_batcher=None,
                 compiled: bool = False):
        if ophook_list:
            raise ValueError("Engine(ophook_list=...): op-hooks (Gemini) are not supported by colossal_lite; "
                             "remove the argument (a torch module hook or a Trainer hook can do what yours did)")
        optimizer = torch_optimizer(optimizer, "Engine(optimizer=...)")
        self._model = model
        self._optimizer = optimizer
        self._criterion = criterion
        # with no criterion the model computes its own loss; a ModelLoss criterion says where it is in the output
        self.model_loss = criterion if isinstance(criterion, ModelLoss) else ModelLoss() if criterion is None else None
        self.precision = precision or FP32Precision()
        self.strategy = _strategy_with_handlers(strategy, gradient_handlers)
        self.window = window or AccumulationWindow(1)
        self.reduction = reduction or MeanReduction()
        self.clip_grad_norm = float(clip_grad_norm or 0.0)
        self.schedule = schedule or NonPipelineSchedule()
        self.device = device or next((p.device for p in model.parameters()), torch.device("cpu"))
        self.training = True
        self.num_updates = 0  # optimizer steps really applied (skipped fp16 steps do not count)
        self.grad_norm: Optional[torch.Tensor] = None  # global L2 norm of the last update, on the device
        self.auto_batcher = auto_batcher  # an AutoMicroBatcher with gradient_accumulation='auto'
        self._compile_pending = compiled  # True until the first forward of a torch.compile'd model
        self.compile_time_s: Optional[float] = None
        self._criterion_call = _Criterion(self)
        self.loss_guard = loss_guard or build_loss_guard("raise", self.precision)
        self._warned_idle_step = False  # step() with no backward since the last update: said once
        self._params = self.precision.master_params(model, optimizer)
        optimizer.register_step_post_hook(self._count_update)

    def _count_update(self, optimizer, args, kwargs):
        self.num_updates += 1

    # -- the parts ---------------------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        """The model forward runs through (DDP-wrapped when data parallel)."""
        return self._model

    @property
    def unwrapped_model(self) -> nn.Module:
        """The user's own module, without DDP."""
        return self.strategy.unwrap(self._model)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    @property
    def criterion(self):
        return self._criterion_call

    @property
    def grad_reduction(self) -> str:
        return self.reduction.name

    @property
    def nonfinite_loss(self) -> str:
        return self.loss_guard.choice

    @property
    def uses_pipeline(self) -> bool:
        return False

    @property
    def loss_scale(self) -> Optional[float]:
        return self.precision.loss_scale

    # -- the micro-step ----------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        """The model's forward under the precision's autocast. A forward that records a graph belongs to a
        micro-batch: data parallelism decides here whether its backward synchronises gradients (only the
        window's last micro-batch does)."""
        if torch.is_grad_enabled():
            self.enter_micro_batch()
        return self.run_model(*args, **kwargs)

    def run_model(self, *args, **kwargs):
        """The model's forward under autocast, outside the accumulation plan (no gradient-sync decision)."""
        try:
            if self._compile_pending:
                return self._first_compiled_call(*args, **kwargs)
            with self.precision.autocast():
                return self._model(*args, **kwargs)
        except RuntimeError as error:
            # data parallelism raises its own errors here (DDP's unused parameters): the strategy says them in the
            # config's words, on the rank where they happen
            explained = self.strategy.explain(self._model, error)
            if explained is None:
                raise
            raise explained from error

    def _first_compiled_call(self, *args, **kwargs):
        start = time.perf_counter()
        with self.precision.autocast():
            out = self._model(*args, **kwargs)
        self._compile_pending = False
        self.compile_time_s = time.perf_counter() - start
        get_dist_logger().info(f"torch.compile: the first forward took {self.compile_time_s:.1f} s (compilation)",
                               ranks=[0])
        return out

    def enter_micro_batch(self, where: Optional[MicroBatch] = None) -> MicroBatch:
        """A forward or backward runs: its micro-batch's place; a window's first micro-batch opens the window."""
        before = self.window.current
        where = self.window.enter(where)
        if where is not before and where.first:  # a window left open by a loop that broke off leaves nothing behind
            self.reduction.reset()
            self.loss_guard.open_window()
        self.strategy.set_gradient_sync(self._model, where.last)
        return where

    def compute_loss(self, output: Any, label: Any, batch: Any = None, required: bool = True):
        """The micro-batch's loss as the training step takes it: the criterion on ``(output, label)``, spread as
        legacy did; or, training on the model's own loss, that loss, with the batch's real tokens counted for
        ``grad_reduction='per-token-mean'``. ``required=False`` (evaluation): None for an output with no loss."""
        model_loss = self.model_loss
        if model_loss is None:
            if label is None and isinstance(batch, dict):
                raise ValueError("the batch is a dict with no 'labels' entry, so the criterion has no target. Fix: "
                                 "put the target under 'labels', or pass initialize(..., data_process_func=lambda "
                                 "batch: (data, label)) to say which part is the label")
            return call_criterion(self._criterion_call, output, label)
        loss = model_loss(output) if required else model_loss.find(output)
        counted = loss is not None and batch is not None and model_loss.num_tokens is not None
        return self.reduction.own_loss(loss, model_loss.count_tokens(batch) if counted else None)

    def zero_grad(self, set_to_none: bool = True):
        """Clear gradients before a window's first micro-batch only.

        Called after a backward of that first micro-batch, before ``step()``, it starts the micro-batch over, as
        ``optimizer.zero_grad()`` would: what the backward added is dropped (an optimizer's closure evaluating the
        loss again, a loop that skips an update)."""
        window = self.window
        if not window.opens_next:
            return
        if window.backward_done:
            window.backward_done = False
            self.reduction.reset()
            self.loss_guard.open_window()
        self.precision.zero_grad(self._model, self._optimizer, set_to_none=set_to_none)

    def token_loss(self, loss_sum: torch.Tensor, num_tokens) -> torch.Tensor:
        """Record a micro-batch's real-token count; returns its per-token mean loss (what ``backward`` takes)."""
        return self.reduction.token_loss(loss_sum, num_tokens)

    def backward(self, loss: torch.Tensor, num_tokens=None, where: Optional[MicroBatch] = None):
        """Backward of the micro-batch's share of the window's loss; gradients are synced across ranks only
        on the window's last micro-batch. Several backward calls in one micro-batch add up.

        ``where``: the micro-batch's place in its window (None: as the loader ``initialize`` returned said, or
        counted). ``num_tokens``: its real-token count with ``grad_reduction='per-token-mean'`` (None: the
        count the criterion reported).
        """
        if not isinstance(loss, torch.Tensor):  # a type check, no device read
            raise not_a_loss(loss, self._criterion, self.reduction.name)
        where = self.enter_micro_batch(where)
        self.loss_guard.watch(loss)
        self.precision.backward(loss, self.reduction.loss_weight(loss, where, num_tokens))
        self._backward_done(where)

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor, where: Optional[MicroBatch] = None):
        where = self.enter_micro_batch(where)
        self.precision.backward_by_grad(tensor, grad / where.divisor if where.divisor != 1 else grad)
        self._backward_done(where)

    def _backward_done(self, where: MicroBatch) -> None:
        self.window.backward_done = True
        if not where.last:
            # Sync back on, so that a forward which bypasses the engine (``engine.model(x)``) syncs: an extra
            # all-reduce is never wrong, a skipped one would be.
            self.strategy.set_gradient_sync(self._model, True)

    # -- the update: ``step`` = prepare_update, clip_gradients, apply_update -----------------------
    def step(self, closure: Optional[Callable[[], torch.Tensor]] = None) -> bool:
        """End the micro-batch; at the end of a window, update the parameters. True if they were updated.

        ``closure``: for an optimizer that evaluates the loss itself (``torch.optim.LBFGS``), a function that runs
        the batch through the engine (``engine.zero_grad()``, ``engine(x)``, ``engine.backward(loss)``) and returns
        the loss; the optimizer calls it as often as it needs (``_step_with_closure``).
        """
        if closure is not None:
            return self._step_with_closure(closure)
        window = self.window
        if not window.complete:
            current = window.current
            if current is None and window.at_start or current is not None and current.last:
                self._warn_idle_step()  # nothing to apply: the window starts afresh rather than counting on
                window.close()
            else:
                window.end_micro_batch()
            return False
        if not self.prepare_update():
            return False
        self.clip_gradients()
        return self.apply_update()

    def prepare_update(self) -> bool:
        """The window is complete: reduce its gradients over ranks and make them the configured reduction.
        False when the loss guard skips this update (``nonfinite_loss='skip'``); the window is then closed."""
        if not self.loss_guard.allows_step():
            self._close_window()
            get_dist_logger().warning(f"nonfinite_loss='skip': a loss of optimizer step {self.num_updates + 1} was "
                                      f"nan or inf on some rank; that update was skipped", ranks=[0])
            return False
        self.strategy.reduce_gradients(self._model)
        self.reduction.finish(self._params, self.window.closing)
        return True

    def clip_gradients(self, measure: bool = False) -> Optional[torch.Tensor]:
        """Clip to the global norm ``clip_grad_norm`` (when set); returns the norm before clipping, on the device,
        or None when nothing is clipped and ``measure`` is false."""
        if self.clip_grad_norm <= 0 and not measure:
            return None
        self.precision.unscale_(self._optimizer)
        self.grad_norm = self.strategy.clip_grad_norm_(self._params, self.clip_grad_norm)
        return self.grad_norm

    def apply_update(self) -> bool:
        """The optimizer step (fp16 modes skip it on overflow); True if the parameters changed."""
        before = self.num_updates
        self.precision.step(self._optimizer)
        self._close_window()
        return self.num_updates != before

    def _step_with_closure(self, closure: Callable[[], torch.Tensor]) -> bool:
        """One update by an optimizer that calls ``closure`` itself. Each evaluation's gradients are made what
        ``step()`` hands the optimizer (reduced over ranks, the configured reduction, clipped), and the loss it
        returns to the optimizer is the mean over the data-parallel ranks: a line search or a tolerance on the loss
        then decides alike on every rank, which keeps the ranks' collectives in step."""
        self._check_closure_supported()

        def evaluate():
            loss = closure()
            if not self.window.complete:
                raise RuntimeError("engine.step(closure): the closure ran no engine.backward(loss). Fix: the closure "
                                   "runs engine.zero_grad(), out = engine(x), loss = engine.criterion(out, y), "
                                   "engine.backward(loss), and returns loss")
            self.prepare_update()  # (always True here: the guard that skips updates is refused above)
            self.clip_gradients()
            return self.strategy.mean_over_ranks(loss.detach())

        before = self.num_updates
        self._optimizer.step(evaluate)
        self._close_window()
        return self.num_updates != before

    def _check_closure_supported(self) -> None:
        """An update inside the optimizer's own loop cannot span micro-batches or be skipped by the engine."""
        why = None
        if self.window.size != 1 or self.auto_batcher is not None:
            why = ("gradient accumulation splits a batch's gradient over several step() calls, and the optimizer "
                   "evaluates the whole batch at each call of the closure. Fix: gradient_accumulation=1")
        elif getattr(self.precision, "skips_nonfinite_steps", False):
            why = ("fp16 loss scaling skips an update after checking the gradients, which it cannot do for an update "
                   "the optimizer makes inside its own loop (torch's GradScaler refuses closures too). Fix: bf16 or "
                   "fp32")
        elif not self.strategy.takes_closures:
            why = (f"{self.strategy.name} shards the optimizer's work across ranks, and an optimizer such as LBFGS "
                   f"needs every parameter's gradient in one flat view. Fix: without zero, or with zero=None")
        elif self.loss_guard.choice == "skip":
            why = ("nonfinite_loss='skip' skips an update before the optimizer steps, which it cannot do for an update "
                   "the optimizer makes inside its own loop. Fix: nonfinite_loss='raise' (the default)")
        if why is not None:
            raise ValueError(f"engine.step(closure): {why}")

    def _close_window(self) -> None:
        self.window.close()
        self.reduction.reset()
        self.loss_guard.end_window()

    def _warn_idle_step(self) -> None:
        if self._warned_idle_step:
            return
        self._warned_idle_step = True
        get_dist_logger().warning(
            "engine.step() was called with no engine.backward(loss) since the last update, so it applied nothing "
            "(said once). Call engine.backward(loss) before engine.step(): loss.backward() alone bypasses the engine's "
            "accumulation, loss scaling and gradient sync, and its gradients are never applied", ranks=[0])

    def check_loss_finite(self) -> None:
        """Raise ``NonFiniteLossError`` if a training loss so far was nan or inf on any rank (with
        ``nonfinite_loss='raise'``; otherwise nothing). Reads the device once and is a collective: every rank calls
        it, at a point where metrics are read anyway (the Trainer: each epoch's end, each checkpoint, fit's end)."""
        self.loss_guard.check()

    def execute_schedule(self, data_iter: Iterable, forward_only: bool = False, return_loss: bool = True,
                         return_output_label: bool = True):
        """Load the next batch, move it to the device, forward, loss and (unless ``forward_only``) backward.

        Returns ``(output, label, loss)``; it does not call ``zero_grad`` or ``step``.
        With ``gradient_accumulation='auto'`` a batch that runs out of memory is retried in more micro-batches.
        """
        return self.schedule.forward_backward_step(self, data_iter, forward_only=forward_only, return_loss=return_loss,
                                                   return_output_label=return_output_label)

    def train(self):
        self.training = True
        self._model.train()

    def eval(self):
        self.training = False
        self._model.eval()

    def detach_from_group(self):
        """Stop communicating: forward runs on the user's module without the DDP wrapper (called by gpc.destroy)."""
        if isinstance(self.strategy, DDPStrategy):
            self._model = self.unwrapped_model
            self.strategy = SingleProcess()

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Model (without DDP prefixes), optimizer, loss scaler, accumulation counter.

        Inside an accumulation window the gradients gathered so far are included, so a
        resume mid-window continues exactly.
        """
        state = {
            "model": self.strategy.model_state_dict(self._model),
            "optimizer": self.strategy.optimizer_state_dict(self._model, self._optimizer),
            **self.state_dict_without_shards(check_window=False),
        }
        if not self.window.at_start:
            state["window_grads"] = [None if p.grad is None else p.grad.detach().clone()
                                     for p in self.unwrapped_model.parameters()]
        return state

    @property
    def shards_state(self) -> bool:
        """True with ZeRO stage 2/3: model and optimizer state live as shards across ranks."""
        return self.strategy.shards_state

    def sharded_state_dict(self, as_it_is: bool = False) -> Dict[str, Any]:
        """Model and optimizer state as this rank's shards (DTensors), for torch.distributed.checkpoint: also the
        template to load a checkpoint into, so an optimizer without state gets it made, as torch's
        ``get_state_dict`` does; ``as_it_is=True`` (for a save) reads the optimizer without changing it."""
        return self.strategy.sharded_state_dict(self._model, self._optimizer, as_it_is=as_it_is)

    def load_sharded_state_dict(self, state: Dict[str, Any]):
        self.strategy.load_sharded_state_dict(self._model, self._optimizer, state)

    def state_dict_without_shards(self, check_window: bool = True) -> Dict[str, Any]:
        """Everything but model and optimizer (which ``sharded_state_dict`` holds)."""
        if check_window and not self.window.at_start:
            raise RuntimeError("a sharded checkpoint cannot be taken inside an accumulation window; save at an "
                               "optimizer step boundary")
        # "accumulation": the open window, its progress and what the reduction gathered over it (token counts);
        # with gradient_accumulation='auto' the split the run settled on, so a resumed run starts with it
        auto = {} if self.auto_batcher is None else {"auto_parts": self.auto_batcher.parts}
        return {"optimizer_class": optimizer_class_name(self._optimizer),  # (a resume with another is refused)
                "precision": self.precision.state_dict(),
                "accumulation": {**self.window.state_dict(), **self.reduction.state_dict(), **auto},
                "num_updates": self.num_updates}

    def load_state_dict(self, state: Dict[str, Any], strict: bool = True):
        if "model" in state:
            self.strategy.load_model_state_dict(self._model, state["model"], strict=strict)
        if "optimizer" in state:
            self.strategy.load_optimizer_state_dict(self._model, self._optimizer, clone_tensors(state["optimizer"]))
        self.precision.load_state_dict(state.get("precision", {}))
        if "accumulation" in state:
            self.window.load_state_dict(state["accumulation"])
            self.reduction.load_state_dict(state["accumulation"])
            if self.auto_batcher is not None:
                self.auto_batcher.parts = int(state["accumulation"].get("auto_parts", self.auto_batcher.parts))
        if state.get("window_grads") is not None:
            self._load_window_grads(state["window_grads"])
        self.num_updates = int(state.get("num_updates", self.num_updates))
        self.loss_guard.start_counting_at(self.num_updates)

    def _load_window_grads(self, grads) -> None:
        params = list(self.unwrapped_model.parameters())
        if len(grads) != len(params):
            raise ValueError(f"the saved accumulation gradients cover {len(grads)} parameters, the model has {len(params)}")
        for p, g in zip(params, grads):
            p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype).clone()


def torch_optimizer(optimizer, where: str):
    """The optimizer the engine steps. A legacy ``ColossalaiOptimizer(optim)`` is its ``optim``: the wrapper adds
    nothing the engine does not do itself, and an LR scheduler built on it already shares the optimizer's groups.
    An AMP wrapper from ``convert_to_amp`` is refused: the engine applies the config's precision itself."""
    if not isinstance(optimizer, AMPOptimizer):
        return optimizer
    if type(optimizer.precision) is not FP32Precision:
        raise TypeError(f"{where}: got an optimizer that convert_to_amp wrapped ({type(optimizer).__name__}), and "
                        f"the engine applies mixed precision itself. Fix: pass the torch optimizer it wraps "
                        f"(.optim) and set fp16 = dict(mode=AMP_TYPE.{optimizer.precision.mode.name}) in the config "
                        f"(or initialize(..., config=dict(fp16=...)))")
    return optimizer.optim


class EngineLRScheduler:
    """An LR scheduler that advances only after the engine really updated the parameters.

    So with accumulation it moves once per update, and an fp16 step skipped for overflow
    does not move it. Everything else is forwarded to the wrapped scheduler.
    """

    def __init__(self, lr_scheduler, engine: Engine):
        self.__dict__["lr_scheduler"] = lr_scheduler
        self.__dict__["_engine"] = engine
        self.__dict__["_seen_updates"] = engine.num_updates

    def step(self, *args, **kwargs):
        updates = self._engine.num_updates
        if updates == self._seen_updates:
            return
        self.__dict__["_seen_updates"] = updates
        self.lr_scheduler.step(*args, **kwargs)

    def state_dict(self):
        return {"scheduler": self.lr_scheduler.state_dict(), "seen_updates": self._seen_updates}

    def load_state_dict(self, state):
        if "scheduler" in state and "seen_updates" in state:
            self.lr_scheduler.load_state_dict(state["scheduler"])
            self.__dict__["_seen_updates"] = int(state["seen_updates"])
        else:  # a bare scheduler state
            self.lr_scheduler.load_state_dict(state)

    def get_last_lr(self):
        return self.lr_scheduler.get_last_lr()

    def __getattr__(self, name):
        return getattr(self.__dict__["lr_scheduler"], name)

    def __setattr__(self, name, value):
        setattr(self.lr_scheduler, name, value)

    def __repr__(self):
        return f"EngineLRScheduler({self.lr_scheduler!r})"
