"""``BaseHook``: one method per event; override the ones you need.

A hook changes the run by changing ``trainer.state`` (see ``docs/trainer.md`` for what each event
may change). The trainer calls only the methods a hook overrides, in priority order.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

__all__ = ["BaseHook"]


class BaseHook:
    """Base class of every hook. Lower ``priority`` runs first; ties keep the order of the hook list.

    ``priority`` is a class attribute too (10), so a subclass whose ``__init__`` does not call
    ``super().__init__()`` still has one.
    """

    priority: int = 10
    #: Event names this hook's methods are not to be called for, read when the hooks are attached (at each
    #: ``fit``/``evaluate``): a hook whose options leave an overridden method idle lists it here (or makes this
    #: a property) so the trainer does not call it every iteration.
    skipped_events: tuple = ()
    #: Names of the metrics this hook reads (``'Loss'``, ``'test/Accuracy'``; see ``resolve_metric``). Once all
    #: of ``fit``'s hooks are attached the trainer refuses a name that no hook provides, listing those that exist,
    #: so a misspelt name fails before the first step instead of being silently never found.
    watched_metrics: tuple = ()
    #: True for a hook that writes the run's checkpoints (``SaveCheckpointHook``): the trainer's checkpoint
    #: session drives it (saves at safe points, the final save, preemption) and resumes from its folder.
    saves_checkpoints: bool = False
    #: The folder this hook keeps the run in (a checkpoint hook's), where ``fit`` writes the metrics file when
    #: no ``log_dir`` is given; None for hooks that keep none.
    run_folder = None
    #: Whether this hook may read a training step's output (``state.output``, or ``after_train_iter``'s
    #: ``output``) in an event after the loss: ``before_backward`` to ``after_train_iter``. When no hook that
    #: handles those events reads it, the trainer lets the output go before the backward, as a hand loop
    #: writing ``loss = criterion(model(x), y)`` does (a language model's logits are often the step's largest
    #: tensor); those events then see ``None``. A hook of your own keeps it unless it sets this to False.
    reads_train_output: bool = True

    def __init__(self, priority: Optional[int] = None) -> None:
        if priority is not None:
            if isinstance(priority, bool) or not isinstance(priority, (int, float)):
                raise TypeError(f"{type(self).__name__}(priority=...) must be a number (lower runs first), "
                                f"got {priority!r}")
            self.priority = priority

    # -- legacy lifecycle ------------------------------------------------------------------------
    def after_hook_is_attached(self, trainer) -> None:
        """Once per ``fit``/``evaluate``, after the hooks are sorted: register metrics, read the run's shape."""

    def after_hook_is_detached(self, trainer) -> None:
        """Once per ``fit``/``evaluate``, as it ends, normally or by an error (then on the rank that raised, and
        perhaps not on the others: no collective here): put back what the hook changed for the run only."""

    def before_train(self, trainer) -> None:
        pass

    def after_train(self, trainer) -> None:
        pass

    def before_train_epoch(self, trainer) -> None:
        pass

    def after_train_epoch(self, trainer) -> None:
        pass

    def before_train_iter(self, trainer) -> None:
        pass

    def after_train_iter(self, trainer, output, label, loss) -> None:
        pass

    def before_test(self, trainer) -> None:
        pass

    def after_test(self, trainer) -> None:
        pass

    def before_test_epoch(self, trainer) -> None:
        pass

    def after_test_epoch(self, trainer) -> None:
        pass

    def before_test_iter(self, trainer) -> None:
        pass

    def after_test_iter(self, trainer, output, label, loss) -> None:
        pass

    # -- inside a training iteration (two-way: change trainer.state) -----------------------------
    def before_zero_grad(self, trainer) -> None:
        """Gradients are about to be cleared (first micro-batch of an accumulation window only)."""

    def after_batch_loaded(self, trainer) -> None:
        """``state.batch`` is on the device and split into ``state.data`` / ``state.label``; replace any of them."""

    def before_forward(self, trainer) -> None:
        pass

    def after_forward(self, trainer) -> None:
        """``state.output`` is set; the loss is not computed yet (``state.label`` may still be replaced)."""

    def after_loss(self, trainer) -> None:
        """``state.loss`` is set; replace it to change what is back-propagated."""

    def before_backward(self, trainer) -> None:
        pass

    def after_backward(self, trainer) -> None:
        pass

    def after_grad_norm(self, trainer, grad_norm) -> None:
        """The global L2 norm of the gradients (a device tensor), before the optimizer step."""

    def before_optimizer_step(self, trainer) -> None:
        pass

    def after_optimizer_step(self, trainer) -> None:
        """``state.updated`` says whether the parameters changed (False when fp16 skipped the step)."""

    # -- state: what a checkpoint saves and a resumed run gets back (docs/checkpoints.md) ---------
    #: The entry of a trainer checkpoint's shared state that keeps this hook's ``state_dict()``, under the hook's
    #: key (``'EarlyStoppingHook.0'``): ``'trainer'`` (``shared_state['trainer']['hooks']``) or
    #: ``'lr_schedulers'`` (``shared_state['lr_schedulers']``, the format's entry for schedulers, which
    #: ``load_checkpoint``, ``ckpt merge`` files and older colossal_lite versions read schedulers from).
    checkpoint_entry: str = "trainer"

    def state_dict(self) -> Dict[str, Any]:
        """What this hook needs to resume, the same on every rank (empty for stateless hooks).

        Saved in every trainer checkpoint (and by ``Trainer.state_dict``) under the hook's key, and handed back
        to ``load_state_dict`` when a run resumes: a hook of your own that defines both is checkpointed and
        resumed with nothing else to do. Tensors and plain Python values only."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Take back what ``state_dict()`` returned (called once the hooks of the resuming run are attached)."""

    def rank_state_dict(self) -> Dict[str, Any]:
        """What this hook needs to resume that differs between ranks (e.g. a random generator of its own); empty
        for most hooks. Saved in each rank's file and handed back to ``load_rank_state_dict`` on that rank, when
        the run resumes with the number of ranks that wrote it (as the data position is)."""
        return {}

    def load_rank_state_dict(self, state: Dict[str, Any]) -> None:
        """Take back what ``rank_state_dict()`` returned on this rank."""

    # -- checkpoints (fired by the checkpoint code) ----------------------------------------------
    def on_save_checkpoint(self, trainer, checkpoint: Dict[str, Any]) -> None:
        """Add entries to ``checkpoint`` (the shared state about to be saved; put your entries under
        ``checkpoint['hooks']``, and this rank's under ``checkpoint['rank_state']['hooks']``)."""

    def on_load_checkpoint(self, trainer, checkpoint: Dict[str, Any]) -> None:
        """Read entries back from a loaded ``checkpoint``; every hook's ``load_state_dict`` has run."""

    # -- legacy helper ---------------------------------------------------------------------------
    def init_runner_states(self, trainer, key: str, val: Any) -> None:
        """Set ``trainer.states[key] = val`` unless the key is already there."""
        if key not in trainer.states:
            trainer.states[key] = val

    def __repr__(self) -> str:
        return f"{type(self).__name__}(priority={self.priority})"
