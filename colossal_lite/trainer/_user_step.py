"""A training step of the user's own, run by ``Trainer.fit(step=...)`` (PyTorch Ignite's process function).

For programs that are not one forward and one backward: a GAN's two models and two optimizers, a language
model that carries its hidden state from batch to batch. The user's function does the whole step with one or
more engines (``zero_grad``, forward, ``backward``, ``step``) and returns what the hooks should see; the
Trainer keeps the epochs, the hooks, evaluation, checkpoints, the history, progress and preemption.

Progress (``state.step``, ``max_steps``, intervals, checkpoint safe points) counts the optimizer steps of the
Trainer's own engine. Before each batch every engine of the step is told where the batch stands in its own
accumulation window (each engine keeps the features ``initialize`` gave it, accumulation included), so a window
runs as it would under the Trainer's own step; the other engines' states go into every checkpoint under
``engine.<name>`` (``Trainer.register_for_checkpointing``).
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch

from ..core.dist import all_gather_object, rank, world_size
from ..engine.batch import move_to_device
from ..engine.step import drop_all_rows, real_rows

__all__ = ["UserStep", "UserStepRunner", "bind_user_step"]

# The events inside one training step: the Trainer's own step fires them between its lines, but a user's step
# runs those lines itself, so no hook that handles one of them can run with it.
_INSIDE_EVENTS = ("before_forward", "after_forward", "after_loss", "before_backward", "after_backward",
                  "after_grad_norm", "before_optimizer_step")


class UserStep:
    """The step of ``Trainer.fit(step=UserStep(train, engines=..., evaluate=...))``.

    ``train(trainer, batch)`` trains on one loader batch (on the Trainer's engine's device) and returns the
    iteration's loss, or ``(output, label, loss)`` for hooks that read outputs (``AccuracyHook``); ``None`` when
    there is nothing to show. ``engines``: the engines it uses, by name (the name keys each one's state in
    checkpoints); the Trainer's own engine may be left out. ``evaluate(trainer, batch)``: evaluation's step,
    returning the same (run under ``torch.no_grad`` with every engine in eval mode); None: evaluation runs the
    Trainer's engine and criterion, as without a step of your own.
    """

    def __init__(self, train: Callable, engines: Optional[Mapping[str, Any]] = None,
                 evaluate: Optional[Callable] = None):
        if not callable(train):
            raise TypeError(f"UserStep(train=...) must be a function (trainer, batch) -> loss or (output, label, loss), "
                            f"got {type(train).__name__}")
        if evaluate is not None and not callable(evaluate):
            raise TypeError(f"UserStep(evaluate=...) must be a function (trainer, batch) -> loss or (output, label, "
                            f"loss), or None, got {type(evaluate).__name__}")
        self.train = train
        self.evaluate = evaluate
        self.engines: Dict[str, Any] = _checked_engines(engines)


def _checked_engines(engines) -> Dict[str, Any]:
    if engines is None:
        return {}
    if not isinstance(engines, Mapping):
        raise TypeError(f"UserStep(engines=...) must be a dict of engines by name, e.g. "
                        f"engines={{'generator': engine_g, 'discriminator': engine_d}}, got {type(engines).__name__}")
    seen: Dict[int, str] = {}
    for name, engine in engines.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"UserStep(engines=...): the name {name!r} is not a non-empty str; name each engine, "
                            f"e.g. 'generator'")
        if not callable(getattr(engine, "state_dict", None)) or not hasattr(engine, "window"):
            raise TypeError(f"UserStep(engines=...): {name!r} is a {type(engine).__name__}, not an Engine; give the "
                            f"engine colossal_lite.initialize returned")
        if id(engine) in seen:
            raise ValueError(f"UserStep(engines=...): {name!r} and {seen[id(engine)]!r} are the same engine; "
                             f"name each engine once")
        seen[id(engine)] = name
    return dict(engines)


def as_user_step(step: Union[UserStep, Callable]) -> UserStep:
    """``fit(step=...)``: a ``UserStep``, or a bare function for a step that uses the Trainer's engine only."""
    if isinstance(step, UserStep):
        return step
    if callable(step):
        return UserStep(step)
    raise TypeError(f"fit(step=...) must be a function (trainer, batch) -> loss or a UserStep(train, engines=..., "
                    f"evaluate=...), got {type(step).__name__}")


def _results(result, what: str) -> Tuple[Any, Any, Any]:
    """``(output, label, loss)`` from what the user's function returned."""
    if result is None or isinstance(result, torch.Tensor):
        return None, None, result
    if isinstance(result, (tuple, list)) and len(result) == 3:
        return tuple(result)
    kind = f"a {len(result)}-item {type(result).__name__}" if isinstance(result, (tuple, list)) \
        else f"a {type(result).__name__}"
    raise TypeError(f"the {what} function of fit(step=...) returned {kind}; return the loss (a tensor), "
                    f"(output, label, loss) for hooks that read outputs, or None")


@contextmanager
def _eval_mode(engines: List[Any]):
    """Every engine in ``engines`` in eval mode while the block runs, then back in the mode it was in."""
    training = [engine for engine in engines if engine.training]
    for engine in training:
        engine.eval()
    try:
        yield
    finally:
        for engine in training:
            engine.train()


class UserStepRunner:
    """A ``UserStep`` bound to one ``fit``: the step object the Trainer's loop calls (``run`` for a training
    micro-batch, ``forward_only`` for an evaluation batch), like the Trainer's own ``TrainStep``."""

    def __init__(self, step: UserStep, trainer, events, default_step):
        self.trainer, self.state, self.events = trainer, trainer.state, events
        self.step = step
        self.main = trainer.engine
        self.train_fn, self.eval_fn = step.train, step.evaluate
        self.default_step = default_step  # the Trainer's own step: evaluation without a function of the user's
        self.names = {id(engine): name for name, engine in step.engines.items()}
        self.names.setdefault(id(self.main), "trainer.engine")
        self.others = [engine for engine in step.engines.values() if engine is not self.main]

    def run(self, batch: Any, where) -> None:
        """Announce the batch's place to every engine, run the user's function, then record its results."""
        st, main = self.state, self.main
        st.stepped = st.updated = False
        places = self._announce(where, st.batch_idx)
        st.batch, st.data = move_to_device(batch, main.device), None
        main.schedule.current_batch = st.batch  # (the last batch loaded, whose size throughput counts)
        for fn in self.events.after_batch_loaded:
            fn(self.trainer)
        before = main.num_updates
        st.output, st.label, st.loss = _results(self.train_fn(self.trainer, st.batch), "train")
        self._settle(places)
        if where.last:
            st.stepped, st.updated = True, main.num_updates != before
            for fn in self.events.after_optimizer_step:
                fn(self.trainer)

    def _announce(self, where, index: int) -> List[Tuple[Any, Any]]:
        """Tell each engine where micro-batch ``index`` stands in its window; -> ``(engine, place)`` pairs."""
        main = self.main
        main.window.expect(where)
        places = [(main, where)]
        for engine in self.others:
            window = engine.window
            window.continue_at(index)  # (a restored window continues; one left open elsewhere is dropped)
            place = where if window.size == main.window.size else window.plan(index, self.state.iters_per_epoch)
            window.expect(place)
            places.append((engine, place))
        return places

    def _settle(self, places: List[Tuple[Any, Any]]) -> None:
        """After the user's function (flag reads, no device sync): an engine whose window's last micro-batch went
        backward must have stepped; a window that ended with this batch is left closed, as the Trainer's own step
        leaves it. A forward through an engine after its step (a GAN's discriminator judging the generator's
        output for the generator's loss) opens a micro-batch that no backward of that engine belongs to: it is
        dropped, so checkpoints find the window at its start."""
        for engine, place in places:
            window = engine.window
            if window.complete:
                raise RuntimeError(f"the train function of fit(step=...) ran backward on the last micro-batch of "
                                   f"{self.names[id(engine)]}'s accumulation window but did not call step() on it: "
                                   f"call engine.step() after engine.backward(loss) on every engine it trains")
            if place.last and not window.at_start:
                window.close()

    def forward_only(self, batch: Any, with_loss: bool = True, keep: Optional[int] = None,
                     rows: Optional[int] = None) -> None:
        """Evaluation's step: the user's ``evaluate`` function, else the Trainer's own forward-only step on its
        engine. Like that step, the function sees a batch's real rows only (``keep``: how many; a distributed
        sampler's padded repeats are cut), and a batch that is all padding whole, its results then cut to none."""
        if self.eval_fn is None:
            self.default_step.forward_only(batch, with_loss, keep, rows)
            return
        st = self.state
        batch = real_rows(batch, keep, rows)
        st.batch, st.data = move_to_device(batch, self.main.device), None
        with _eval_mode(self.others):
            st.output, st.label, st.loss = _results(self.eval_fn(self.trainer, st.batch), "evaluate")
        if keep == 0:
            drop_all_rows(st, rows)


class EngineCheckpoint:
    """An engine of the step as checkpoints keep it (``register_for_checkpointing``): ``Engine.state_dict()``, with
    the gradients of a window still open at the save kept for every rank. The Trainer saves at its own engine's
    step, where another engine may be inside its window, each rank holding the gradients it gathered alone (they
    are synchronised at the window's end); the checkpoint's shared part holds them all, and each rank takes its
    own back. Every rank calls ``state_dict`` (a collective with several ranks), as it does every registered
    object's."""

    def __init__(self, engine, name: str):
        self.engine, self.name = engine, name

    def state_dict(self) -> Dict[str, Any]:
        state = self.engine.state_dict()
        grads = state.pop("window_grads", None)
        if grads is not None:
            grads = [None if g is None else g.cpu() for g in grads]
        state["window_grads_by_rank"] = all_gather_object(grads)
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        state = dict(state)
        by_rank = state.pop("window_grads_by_rank", None)
        if by_rank is not None and any(grads is not None for grads in by_rank):
            if len(by_rank) != world_size():
                raise ValueError(f"engine {self.name!r}: the checkpoint was saved by {len(by_rank)} ranks inside its "
                                 f"accumulation window, whose gradients each rank gathered alone; resume it with "
                                 f"{len(by_rank)} ranks (or from a checkpoint where its window was complete)")
            state["window_grads"] = by_rank[rank()]
        self.engine.load_state_dict(state)


# One ``EngineCheckpoint`` per engine, so that another fit of the same trainer registers the same object again.
_ENGINE_CHECKPOINTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _refuse_inside_hooks(events) -> None:
    inside = [f"{type(getattr(fn, '__self__', fn)).__name__}.{name}" for name in _INSIDE_EVENTS
              for fn in getattr(events, name)]
    if inside:
        raise ValueError(f"fit(step=...): your step function runs forward, backward and the optimizer step itself, so "
                         f"the Trainer cannot fire the events between them; these hooks handle them: "
                         f"{', '.join(inside)}. Do what they do inside your step function, or train without step=")


def _check_engines(step: UserStep, trainer) -> None:
    main, st = trainer.engine, trainer.state
    for name, engine in step.engines.items():
        if engine.auto_batcher is not None:
            raise ValueError(f"fit(step=...): engine {name!r} has gradient_accumulation='auto', which retries the "
                             f"Trainer's own step in pieces; give it a fixed gradient_accumulation "
                             f"(initialize(..., config=dict(gradient_accumulation=N)))")
        if st.iters_per_epoch is None and engine.window.size != main.window.size:
            raise ValueError(f"fit(step=...): engine {name!r} accumulates {engine.window.size} micro-batches and the "
                             f"Trainer's engine {main.window.size}, but the train_dataloader has no len(), so its "
                             f"windows cannot be planned before the epoch's end is read; give the loader a __len__ "
                             f"or the engines one gradient_accumulation")
    if main.auto_batcher is not None:
        raise ValueError("fit(step=...): the Trainer's engine has gradient_accumulation='auto', which retries the "
                         "Trainer's own step in pieces; give it a fixed gradient_accumulation")


def evaluation_step(step: Union[UserStep, Callable], trainer, events, default_step) -> UserStepRunner:
    """``Trainer.evaluate(step=...)``: a ``UserStep``'s ``evaluate`` function (None: the Trainer's own evaluation,
    as in ``fit``), or a function ``(trainer, batch)`` that is evaluation's step itself; -> the runner."""
    if not isinstance(step, UserStep):
        if not callable(step):
            raise TypeError(f"evaluate(step=...) must be a function (trainer, batch) -> loss or (output, label, loss), "
                            f"or the UserStep given to fit, got {type(step).__name__}")
        step = UserStep(_not_for_training, evaluate=step)
    return UserStepRunner(step, trainer, events, default_step)


def _not_for_training(trainer, batch):
    raise RuntimeError("a step given to Trainer.evaluate does not train")


def bind_user_step(step: Union[UserStep, Callable], trainer, events, default_step) -> UserStepRunner:
    """Check ``step`` against this fit (its hooks' ``events``, its loader), register the other engines for
    checkpointing (before a resume restores them) and put them in training mode; -> the runner."""
    step = as_user_step(step)
    _refuse_inside_hooks(events)
    _check_engines(step, trainer)
    runner = UserStepRunner(step, trainer, events, default_step)
    for engine in runner.others:
        name = runner.names[id(engine)]
        saved = _ENGINE_CHECKPOINTS.get(engine)
        if saved is None or saved.name != name:
            saved = _ENGINE_CHECKPOINTS[engine] = EngineCheckpoint(engine, name)
        trainer.register_for_checkpointing(saved, f"engine.{name}")
        engine.train()
    return runner
