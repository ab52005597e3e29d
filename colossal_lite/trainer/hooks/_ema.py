"""``EMAHook``: an exponential moving average of the weights, kept by ``torch.optim.swa_utils.AveragedModel``."""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from ._base_hook import BaseHook

__all__ = ["EMAHook"]


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

    def __init__(self, decay: float = 0.999, priority: int = 5):
        super().__init__(priority)
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMAHook(decay={decay!r}) must be in [0, 1] (the weight kept from the average)")
        self.decay = float(decay)
        self.ema_model: Optional[AveragedModel] = None
        self._model: Optional[torch.nn.Module] = None
        self._pending: Optional[Dict[str, Any]] = None
        self._swapped = False

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
        if self._pending is not None:
            self.ema_model.load_state_dict(self._pending)
            self._pending = None

    def after_optimizer_step(self, trainer) -> None:
        if trainer.state.updated:
            self.ema_model.update_parameters(self._model)

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
        """The model's and the average's weights and buffers trade places (twice is where it started)."""
        live = list(self._model.parameters()) + list(self._model.buffers())
        averaged = list(self.ema_model.module.parameters()) + list(self.ema_model.module.buffers())
        for a, b in zip(live, averaged):
            held = a.detach().clone()
            a.copy_(b)
            b.copy_(held)
        self._swapped = not self._swapped

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
        live = self.ema_model.module.state_dict()  # while swapped, the averaged copy holds the live weights
        if set(live) != set(engine["model"]):
            raise RuntimeError(f"EMAHook: the checkpoint's model keys differ from the averaged copy's: "
                               f"{sorted(set(live) ^ set(engine['model']))[:10]}")
        checkpoint["engine"] = dict(engine, model={k: v.detach().clone() for k, v in live.items()})

    def state_dict(self) -> Dict[str, Any]:
        if self.ema_model is None:
            return dict(self._pending or {})
        if self._swapped:  # saved during evaluation: the average is in the model
            self._swap()
            state = {k: v.clone() for k, v in self.ema_model.state_dict().items()}
            self._swap()
            return state
        return {k: v.clone() for k, v in self.ema_model.state_dict().items()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if not state:
            return
        if self.ema_model is None:
            self._pending = dict(state)  # applied once attached to a trainer, when the average is built
        else:
            self.ema_model.load_state_dict(state)

