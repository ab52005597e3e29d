"""``EMAHook``: an exponential moving average of the weights, kept by ``torch.optim.swa_utils.AveragedModel``."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from ._base_hook import BaseHook

__all__ = ["EMAHook"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class _Float32Weights:
    """A model's parameters and buffers, those in half precision as fp32 copies: what
    ``AveragedModel.update_parameters`` reads (all it calls), so that an average kept in fp32 is updated in fp32.
    A half-precision average would round ``(1 - decay)``'s small steps away."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def parameters(self):
        return (t.float() if t.dtype in _LOW_PRECISION else t for t in self.model.parameters())

    def buffers(self):
        return (t.float() if t.dtype in _LOW_PRECISION else t for t in self.model.buffers())


class EMAHook(BaseHook):
    """Keeps ``ema = decay * ema + (1 - decay) * weights`` after every applied optimizer step (a step fp16
    skipped for overflow changes nothing, so it is not averaged in); evaluation runs on the EMA weights.

    The average is an ``AveragedModel`` over the engine's (unwrapped) model with ``get_ema_multi_avg_fn(decay)``;
    buffers (BatchNorm statistics) are averaged too. Before each evaluation the model's weights and the EMA
    weights trade places, and trade back after it, so training goes on from its own weights. The first applied
    step copies the weights (the average starts at them). ``state_dict`` holds the average and its count, so a
    resumed run's EMA weights are the uninterrupted run's. ``ema_model`` is the ``AveragedModel`` (its
    ``module`` the averaged copy) for use after ``fit``; out of a checkpoint (the ``best`` one, say) the average
    comes with ``colossal_lite.checkpoint.load_weights(path, ema=True)`` or ``colossal-lite ckpt export PATH OUT
    --ema``, while the checkpoint's model entry stays the live weights a resume continues from. Every rank keeps
    its own copy, equal on every rank as the weights are under data parallelism.
    """

    reads_train_output = False  # (BaseHook.reads_train_output)

    def __init__(self, decay: float = 0.999, priority: int = 5):
        super().__init__(priority)
        if isinstance(decay, bool) or not isinstance(decay, (int, float)):
            raise TypeError(f"EMAHook(decay={decay!r}): give a number in [0, 1], e.g. decay=0.999")
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMAHook(decay={decay!r}) must be in [0, 1] (the weight kept from the average)")
        self.decay = float(decay)
        self.ema_model: Optional[AveragedModel] = None
        self._model: Optional[torch.nn.Module] = None
        self._pending: Optional[Dict[str, Any]] = None
        self._held_live: Optional[List[torch.Tensor]] = None  # the model's own weights while it holds the average

    def after_hook_is_attached(self, trainer) -> None:
        model = trainer.engine.unwrapped_model
        if trainer.engine.shards_state:  # (every rank attaches its hooks, so every rank raises: none waits on another)
            raise ValueError("EMAHook cannot average a model sharded by FSDP2 (zero stage 2 or 3): it keeps a whole "
                             "copy of the model on every rank (torch.optim.swa_utils.AveragedModel), and a sharded "
                             "model cannot be copied. Use zero=dict(stage=1) (optimizer state sharded, the whole "
                             "model on each rank) with EMAHook, or leave EMAHook out")
        if self.ema_model is None or self._model is not model:  # a later fit on the same model keeps the average
            self._model = model
            self.ema_model = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(self.decay), use_buffers=True)
            for t in (*self.ema_model.module.parameters(), *self.ema_model.module.buffers()):
                if t.dtype in _LOW_PRECISION:
                    t.data = t.data.float()
        if self._pending is not None:
            self.ema_model.load_state_dict(self._pending)
            self._pending = None

    def after_optimizer_step(self, trainer) -> None:
        if trainer.state.updated:
            self.ema_model.update_parameters(_Float32Weights(self._model))

    def before_test(self, trainer) -> None:
        if self.ema_model is not None and int(self.ema_model.n_averaged) > 0 and not self._swapped:
            self._swap()

    def after_test(self, trainer) -> None:
        if self._swapped:
            self._swap()

    def after_hook_is_detached(self, trainer) -> None:
        if self._swapped:  # an evaluation that raised: the model gets its live weights back
            self._swap()

    @torch.no_grad()
    def _swap(self) -> None:
        """The model takes the average's weights and buffers, or (the second call) its own back. The average is
        only read: kept in fp32 under a half-precision model, it would lose its low bits if it held the model's
        weights in between; so the model's own wait in a copy while the average is in."""
        live = list(self._model.parameters()) + list(self._model.buffers())
        if self._held_live is None:
            self._held_live = [a.detach().clone() for a in live]
            averaged = list(self.ema_model.module.parameters()) + list(self.ema_model.module.buffers())
            for a, b in zip(live, averaged):
                a.copy_(b)
        else:
            # The buffers the evaluation ran with go into the average: under data parallelism they are rank 0's
            # (brought at the evaluation's first forward), so every rank's average agrees with the one evaluated.
            for b, a in zip(self.ema_model.module.buffers(), self._model.buffers()):
                b.copy_(a)
            for a, held in zip(live, self._held_live):
                a.copy_(held)
            self._held_live = None

    @property
    def _swapped(self) -> bool:
        """The model holds the average (an evaluation is running on it)."""
        return self._held_live is not None

    def on_save_checkpoint(self, trainer, checkpoint: Dict[str, Any]) -> None:
        """A checkpoint taken during evaluation (a hook saving in ``after_test_epoch``) read the model while it held
        the average: its ``engine`` -> ``model`` gets the live weights back, so a resume continues training from
        them and the average stays in this hook's state only."""
        if not self._swapped:
            return
        engine = checkpoint.get("engine") or {}
        if "model" not in engine:
            raise RuntimeError("a checkpoint of a zero stage 2/3 run was asked for during evaluation, while EMAHook "
                               "has the average in the model: save after evaluation (SaveCheckpointHook does)")
        held = {id(t): h for t, h in zip([*self._model.parameters(), *self._model.buffers()], self._held_live)}
        # by the tensors the model's state dict names (tied weights under two names, no non-persistent buffers)
        live = {k: held[id(t)] for k, t in self._model.state_dict(keep_vars=True).items() if id(t) in held}
        if set(live) != set(engine["model"]):
            raise RuntimeError(f"EMAHook: the checkpoint's model keys differ from the model's own: "
                               f"{sorted(set(live) ^ set(engine['model']))[:10]}")
        checkpoint["engine"] = dict(engine, model={k: v.clone() for k, v in live.items()})

    def state_dict(self) -> Dict[str, Any]:
        if self.ema_model is None:
            return dict(self._pending or {})
        return {k: v.clone() for k, v in self.ema_model.state_dict().items()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if not state:
            return
        if self.ema_model is None:
            self._pending = dict(state)  # applied once attached to a trainer, when the average is built
        else:
            self.ema_model.load_state_dict(state)

