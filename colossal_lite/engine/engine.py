"""``Engine``: the model, optimizer and criterion with the config's features composed in.

Used like PyTorch: ``zero_grad() / engine(x) / engine.criterion(out, y) / backward(loss) / step()``.
The parts (precision, data-parallel strategy, accumulation window) are chosen once by
``initialize``; the per-step path below asks no config and makes no host-device sync
(fp16 loss-scaling modes read one overflow flag per update, like torch's GradScaler).
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, Optional

import torch
from torch import nn

from ..amp.precision import FP32Precision
from ..logging import get_dist_logger
from .accumulation import AccumulationWindow, rescale_grads_
from .loss_guard import build_loss_guard
from .schedule import NonPipelineSchedule
from .strategy import SingleProcess, clip_grad_norm_

# what Engine.step calls directly when the strategy does not change them (saves a Python call per update)
_NO_REDUCTION = SingleProcess.reduce_gradients
_NULL_NO_SYNC = SingleProcess.no_sync
_PLAIN_CLIP = SingleProcess.clip_grad_norm_


class _Criterion:
    """``engine.criterion``: the user's criterion, run under the precision's autocast."""

    def __init__(self, engine: "Engine"):
        self._engine = engine

    def __call__(self, *args, **kwargs):
        engine = self._engine
        fn = engine._criterion
        if engine._plain and fn is not None:  # fp32, mean reduction: nothing to add
            return fn(*args, **kwargs)
        if fn is None:
            raise RuntimeError("engine.criterion was called but initialize() got no criterion; "
                               "pass criterion=torch.nn.CrossEntropyLoss() (or your loss) to initialize")
        with self._engine.precision.autocast():
            result = fn(*args, **kwargs)
        if isinstance(result, tuple) and len(result) == 2 and self._engine.grad_reduction == "per-token-mean":
            loss_sum, num_tokens = result
            return self._engine.token_loss(loss_sum, num_tokens)
        return result

    @property
    def wrapped(self):
        return self._engine._criterion

    def __repr__(self):
        return f"EngineCriterion({self._engine._criterion!r})"


class Engine:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, criterion=None, precision=None,
                 strategy=None, window: Optional[AccumulationWindow] = None, clip_grad_norm: float = 0.0,
                 schedule: Optional[NonPipelineSchedule] = None, device: Optional[torch.device] = None,
                 gradient_handlers=None, verbose: bool = True, grad_reduction: str = "mean", compiled: bool = False,
                 nonfinite_loss: str = "raise"):
        self._model = model
        self._optimizer = optimizer
        self._criterion = criterion
        self.precision = precision or FP32Precision()
        self.strategy = strategy or SingleProcess()
        self.window = window or AccumulationWindow(1)
        self.clip_grad_norm = float(clip_grad_norm or 0.0)
        self.schedule = schedule or NonPipelineSchedule()
        self.device = device or next((p.device for p in model.parameters()), torch.device("cpu"))
        self.training = True
        self.num_updates = 0  # optimizer steps really applied (skipped fp16 steps do not count)
        self.grad_norm: Optional[torch.Tensor] = None  # global L2 norm of the last update, on the device
        self.event_sink = None  # set by the Trainer: after_grad_norm / before_optimizer_step / after_optimizer_step
        self.measure_grad_norm = self.clip_grad_norm > 0
        if grad_reduction not in ("mean", "sum", "per-token-mean"):
            raise ValueError(f"grad_reduction must be 'mean', 'sum' or 'per-token-mean', got {grad_reduction!r}")
        self.grad_reduction = grad_reduction
        self._world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self._micro_tokens: Optional[torch.Tensor] = None
        self.auto_batcher = None  # an AutoMicroBatcher with gradient_accumulation='auto'
        self._compile_pending = compiled  # True until the first forward of a torch.compile'd model
        self.compile_time_s: Optional[float] = None
        self._criterion_call = _Criterion(self)
        self._seed: Optional[torch.Tensor] = None  # ``_backward_seed``'s last result, for ``_seed_divisor``
        self._seed_divisor = 0
        self.nonfinite_loss = nonfinite_loss
        self.loss_guard = build_loss_guard(nonfinite_loss, self.precision)
        self._warned_idle_step = False  # step() with no backward since the last update: said once
        self._params = self.precision.master_params(optimizer)
        optimizer.register_step_post_hook(self._count_update)
        self._plain = self._is_plain()

    def _is_plain(self) -> bool:
        """fp32 (exactly ``FP32Precision``), no token weighting, no pending compile: forward and criterion need no
        wrapping, and the precision's zero_grad, backward and step are the optimizer's and the loss's own, so the
        step calls those directly (a Python call fewer each, on the path that runs once per micro-step)."""
        return (type(self.precision) is FP32Precision and self.grad_reduction != "per-token-mean"
                and not self._compile_pending)

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
    def uses_pipeline(self) -> bool:
        return False

    @property
    def loss_scale(self) -> Optional[float]:
        return self.precision.loss_scale

    # -- the step ------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self._plain:  # fp32 and already compiled (if at all): the model alone
            return self._model(*args, **kwargs)
        if self._compile_pending:
            return self._first_compiled_call(*args, **kwargs)
        with self.precision.autocast():
            return self._model(*args, **kwargs)

    def micro_step_callables(self):
        """-> ``(forward, criterion)``: what ``engine(x)`` and ``engine.criterion(out, y)`` come down to now, for
        a loop that calls them once per micro-step (the Trainer asks once per epoch).

        With nothing to wrap (fp32, the model compiled if at all) they are the model and the user's criterion
        themselves, which saves the engine's layer; otherwise the engine's own ``__call__`` methods (bound
        methods: Python calls them more cheaply than the objects). The first forward of a compiled model
        changes the answer, so ask again rather than keep it.
        """
        plain = self._plain
        forward = self._model if plain else self.__call__
        criterion = self._criterion if plain and self._criterion is not None else self._criterion_call.__call__
        return forward, criterion

    def _first_compiled_call(self, *args, **kwargs):
        import time

        from ..logging import get_dist_logger

        start = time.perf_counter()
        with self.precision.autocast():
            out = self._model(*args, **kwargs)
        self._compile_pending = False
        self._plain = self._is_plain()
        self.compile_time_s = time.perf_counter() - start
        get_dist_logger().info(f"torch.compile: the first forward took {self.compile_time_s:.1f} s (compilation)",
                               ranks=[0])
        return out

    def zero_grad(self, set_to_none: bool = True):
        """Clear gradients, at the start of an accumulation window only."""
        if self.window.micro_step == 0:
            if self._plain:  # fp32: the precision's zero_grad is the optimizer's
                if set_to_none:
                    self._optimizer.zero_grad()  # (its default; no keyword to pass)
                else:
                    self._optimizer.zero_grad(set_to_none=False)
            else:
                self.precision.zero_grad(self._model, self._optimizer, set_to_none=set_to_none)

    def token_loss(self, loss_sum: torch.Tensor, num_tokens) -> torch.Tensor:
        """Record a micro-batch's real-token count; returns its per-token mean loss (what ``backward`` takes)."""
        n = torch.as_tensor(num_tokens, dtype=torch.float32, device=loss_sum.device)
        self._micro_tokens = n
        return loss_sum / n.clamp(min=1)

    def backward(self, loss: torch.Tensor, num_tokens=None):
        """Backward of ``loss / window size``; gradients are synced only on the window's last micro-step.

        With ``grad_reduction='sum'`` the loss is not divided; with ``'per-token-mean'`` the
        micro-batch's token count (``num_tokens``, or the one the criterion reported) weighs it.
        """
        divisor, last = self.window.begin_backward()
        self.loss_guard.watch(loss)
        seed = None  # the gradient backward starts from (None: 1)
        if self.grad_reduction == "per-token-mean":
            loss = self._weigh_by_tokens(loss, num_tokens)
        elif divisor != 1 and self.grad_reduction == "mean":
            if self._plain and not loss.ndim:
                seed = self._backward_seed(loss, divisor)
            else:
                loss = loss / divisor
        strategy = self.strategy
        if last or type(strategy).no_sync is _NULL_NO_SYNC:  # nothing to keep from syncing in this backward
            if self._plain:  # fp32: no loss scaling
                loss.backward(seed)
            else:
                self.precision.backward(loss)
        else:
            with strategy.no_sync(self._model):
                if self._plain:
                    loss.backward(seed)
                else:
                    self.precision.backward(loss)
        self.window.micro_step += 1  # (``window.end_backward()``, without the call)

    def _backward_seed(self, loss: torch.Tensor, divisor: int) -> torch.Tensor:
        """``1 / divisor`` as a 0-dim tensor like ``loss``: fp32 backward starts from it instead of dividing the
        loss first: the same gradients (the division's backward computes this same number) without the division
        and its backward node, two operators fewer per micro-step. Made once per window size, dtype and device."""
        seed = self._seed
        if seed is None or self._seed_divisor != divisor or seed.dtype is not loss.dtype or seed.device != loss.device:
            seed = self._seed = torch.ones((), dtype=loss.dtype, device=loss.device) / divisor
            self._seed_divisor = divisor
        return seed

    def _weigh_by_tokens(self, loss, num_tokens):
        n = self._micro_tokens if num_tokens is None else torch.as_tensor(num_tokens, dtype=torch.float32,
                                                                          device=loss.device)
        if n is None:
            raise RuntimeError("grad_reduction='per-token-mean' needs each micro-batch's real-token count: let the "
                               "criterion return (loss_sum, num_tokens) or call engine.backward(loss, num_tokens=n)")
        self._micro_tokens = None
        window = self.window
        window.tokens = n if window.tokens is None else window.tokens + n
        return loss * n  # back to the micro-batch's token sum; divided by the global count at step()

    def _reduce_scale(self) -> Optional[torch.Tensor]:
        """Factor turning the data-parallel mean of summed gradients into the chosen reduction."""
        if self.grad_reduction == "sum":
            return torch.tensor(float(self._world)) if self._world > 1 else None
        if self.grad_reduction == "per-token-mean":
            total = self.window.tokens if self.window.tokens is not None else torch.zeros((), device=self.device)
            if self._world > 1:
                total = total.clone()
                torch.distributed.all_reduce(total)  # every rank: the global real-token count
            return self._world / total.clamp(min=1)
        return None

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor):
        divisor, last = self.window.begin_backward()
        if divisor != 1:
            grad = grad / divisor
        if last:
            self.precision.backward_by_grad(tensor, grad)
        else:
            with self.strategy.no_sync(self._model):
                self.precision.backward_by_grad(tensor, grad)
        self.window.end_backward()

    def step(self) -> bool:
        """Update the parameters at the end of a window; True if they were updated."""
        window = self.window
        if window.micro_step < window.current_size:  # the window is not complete (``window.ready``)
            if window.micro_step == 0 and not self._warned_idle_step:
                self._warn_idle_step()
            return False
        if not self.loss_guard.allows_step():  # nonfinite_loss='skip' and a loss of this window was nan/inf
            return self._skip_update()
        strategy, plain = self.strategy, self._plain
        if type(strategy).reduce_gradients is not _NO_REDUCTION:
            strategy.reduce_gradients(self._model)
        if window.correction != 1.0 and self.grad_reduction == "mean":
            rescale_grads_(self._params, window.correction)
        if self.grad_reduction != "mean":
            rescale_grads_(self._params, self._reduce_scale())
        sink = self.event_sink
        if self.measure_grad_norm:
            if not plain:  # fp32 has nothing to unscale
                self.precision.unscale_(self._optimizer)
            if type(strategy).clip_grad_norm_ is _PLAIN_CLIP:
                self.grad_norm = clip_grad_norm_(self._params, self.clip_grad_norm)
            else:
                self.grad_norm = strategy.clip_grad_norm_(self._params, self.clip_grad_norm)
            if sink is not None:
                sink.after_grad_norm(self.grad_norm)
        if sink is not None:
            sink.before_optimizer_step()
        before = self.num_updates
        if plain:  # fp32: the precision's step is the optimizer's
            self._optimizer.step()
        else:
            self.precision.step(self._optimizer)
        window.reset()
        self.loss_guard.end_window()
        updated = self.num_updates != before
        if sink is not None:
            sink.after_optimizer_step(updated)
        return updated

    def _skip_update(self) -> bool:
        self.window.reset()
        self.loss_guard.end_window()
        get_dist_logger().warning(f"nonfinite_loss='skip': a loss of optimizer step {self.num_updates + 1} was nan or "
                                  f"inf on some rank; that update was skipped", ranks=[0])
        if self.event_sink is not None:
            self.event_sink.after_optimizer_step(False)
        return False

    def _warn_idle_step(self) -> None:
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
        if self.auto_batcher is not None and not forward_only:
            data, label = self.schedule.split(self.schedule.load_batch(data_iter, self.device))
            self.window.begin_backward()
            output, loss = self.auto_batcher.run(self, data, label)
            return (output, label, loss) if return_output_label else (None, None, loss)
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
        from .strategy import DDPStrategy, SingleProcess

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
            "precision": self.precision.state_dict(),
            "accumulation": self.window.state_dict(),
            "num_updates": self.num_updates,
        }
        if not self.window.at_start:
            state["window_grads"] = [None if p.grad is None else p.grad.detach().clone()
                                     for p in self.unwrapped_model.parameters()]
        return state

    @property
    def shards_state(self) -> bool:
        """True with ZeRO stage 2/3: model and optimizer state live as shards across ranks."""
        return getattr(self.strategy, "shards_gradients", False)

    def sharded_state_dict(self) -> Dict[str, Any]:
        """Model and optimizer state as this rank's shards (DTensors), for torch.distributed.checkpoint."""
        return self.strategy.sharded_state_dict(self._model, self._optimizer)

    def load_sharded_state_dict(self, state: Dict[str, Any]):
        self.strategy.load_sharded_state_dict(self._model, self._optimizer, state)

    def state_dict_without_shards(self) -> Dict[str, Any]:
        """Everything but model and optimizer (which ``sharded_state_dict`` holds)."""
        state = {"precision": self.precision.state_dict(), "accumulation": self.window.state_dict(),
                 "num_updates": self.num_updates}
        if not self.window.at_start:
            raise RuntimeError("a sharded checkpoint cannot be taken inside an accumulation window; save at an "
                               "optimizer step boundary")
        return state

    def load_state_dict(self, state: Dict[str, Any], strict: bool = True):
        if "model" in state:
            self.strategy.load_model_state_dict(self._model, state["model"], strict=strict)
        if "optimizer" in state:
            self.strategy.load_optimizer_state_dict(self._model, self._optimizer, state["optimizer"])
        self.precision.load_state_dict(state.get("precision", {}))
        if "accumulation" in state:
            self.window.load_state_dict(state["accumulation"])
        grads = state.get("window_grads")
        if grads is not None:
            params = list(self.unwrapped_model.parameters())
            if len(grads) != len(params):
                raise ValueError(f"the saved accumulation gradients cover {len(grads)} parameters, the model has {len(params)}")
            for p, g in zip(params, grads):
                p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype).clone()
        self.num_updates = int(state.get("num_updates", self.num_updates))
        self.loss_guard.start_counting_at(self.num_updates)


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
        if args or kwargs:
            self.lr_scheduler.step(*args, **kwargs)
        else:  # the usual call, without unpacking (which Python runs in a new interpreter loop)
            self.lr_scheduler.step()

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
