"""One training micro-step, written once, in the legacy order.

load and split the batch -> forward -> criterion -> backward, and at the end of an accumulation window
-> reduce gradients -> clip -> optimizer step. The fine events of an iteration fire between those
lines: the Trainer gives its hooks' handlers and its ``State`` (which hooks read and change);
``Engine.execute_schedule`` runs the same step with no handlers. Automatic micro-batching is the same
step with forward, loss and backward run as one retriable unit; evaluation is the forward-only form.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..core.tree import iter_leaves
from .accumulation import MicroBatch
from .batch import batch_len, call_with, move_to_device, take_rows


class NoEvents:
    """The handlers of a step nobody listens to: every event has none."""

    after_batch_loaded = before_forward = after_forward = after_loss = before_backward = after_backward = ()
    after_grad_norm = before_optimizer_step = after_optimizer_step = ()


NO_EVENTS = NoEvents()


class StepRecord:
    """What the last micro-step loaded and computed (in ``fit`` the Trainer's ``State`` plays this part)."""

    __slots__ = ("batch", "data", "label", "output", "loss", "grad_norm", "stepped", "updated")

    def __init__(self):
        self.batch = self.data = self.label = self.output = self.loss = self.grad_norm = None
        self.stepped = self.updated = False


class TrainStep:
    """Runs micro-steps of ``engine``; ``events`` holds, per event name, the functions to call with
    ``owner`` (the Trainer) as their first argument; ``record`` receives what each line produced, and what a
    handler writes there (a new batch, target or loss) is what the next line uses."""

    #: Functions called with no argument as each batch starts to load: a speed report marks there the end of
    #: the wait for data and the start of the host-to-device copy (no event fires between the two).
    before_load: tuple = ()
    #: Keep the step's output in the record through the backward and the update (the Trainer sets False when
    #: no hook reads it after the loss: the output, often a language model's large logits, is then let go
    #: before the backward instead of living through its peak).
    keep_output: bool = True

    def __init__(self, engine, record: Any = None, events: Any = NO_EVENTS, owner: Any = None):
        self.engine = engine
        self.record = record if record is not None else StepRecord()
        self.events = events
        self.owner = owner
        self.measure_grad_norm = bool(events.after_grad_norm)  # a hook wants the norm even without clipping
        # ``engine(x)`` as a bound method: calling it goes straight to the method, where calling the object first
        # looks ``__call__`` up on its type (the same code runs)
        self.forward = engine.__call__
        self.loss = engine.compute_loss

    def run(self, batch: Any, where: MicroBatch) -> None:
        """Train on one micro-batch; when it closes its window, update the parameters."""
        self.record.stepped = self.record.updated = False
        self.forward_backward(batch, where)
        if where.last:
            self.update()

    # Each event is a loop over its handlers, written out at its line: an event nobody handles is an empty
    # loop, with no call in between.
    def load(self, batch: Any) -> None:
        """Put the batch on the engine's device and split it into ``(data, label)``; a handler of
        ``after_batch_loaded`` may replace the whole batch (it is split again) or its parts."""
        rec, owner, schedule = self.record, self.owner, self.engine.schedule
        for fn in self.before_load:
            fn()
        placed = schedule.current_batch = move_to_device(batch, self.engine.device)
        rec.batch = placed
        rec.data, rec.label = schedule.split(placed)
        for fn in self.events.after_batch_loaded:
            fn(owner)
        if rec.batch is not placed:
            rec.data, rec.label = schedule.split(rec.batch)

    def forward_backward(self, batch: Any, where: Optional[MicroBatch] = None) -> None:
        rec, events, engine, owner = self.record, self.events, self.engine, self.owner
        if where is not None:  # announced before the forward, where data parallelism decides on syncing
            engine.window.expect(where)
        self.load(batch)
        for fn in events.before_forward:
            fn(owner)
        rec.output = call_with(self.forward, rec.data)
        for fn in events.after_forward:
            fn(owner)
        rec.loss = self.loss(rec.output, rec.label, rec.batch)
        for fn in events.after_loss:
            fn(owner)
        if not self.keep_output:
            rec.output = None
        for fn in events.before_backward:
            fn(owner)
        engine.backward(rec.loss, where=where)
        for fn in events.after_backward:
            fn(owner)

    def update(self) -> bool:
        """The window is complete: reduce and clip the gradients, then the optimizer step; True if applied."""
        rec, events, engine, owner = self.record, self.events, self.engine, self.owner
        rec.stepped = True
        rec.updated = False
        if engine.prepare_update():
            norm = engine.clip_gradients(measure=self.measure_grad_norm)
            if norm is not None:
                rec.grad_norm = norm
                for fn in events.after_grad_norm:
                    fn(owner, norm)
            for fn in events.before_optimizer_step:
                fn(owner)
            rec.updated = engine.apply_update()
        for fn in events.after_optimizer_step:
            fn(owner)
        return rec.updated

    def forward_only(self, batch: Any, with_loss: bool = True, keep: Optional[int] = None,
                     rows: Optional[int] = None) -> None:
        """Evaluation's step: load, forward and (with a criterion) the loss; run it under ``torch.no_grad``.
        The training events do not fire (evaluation has its own, around it).

        ``keep`` (None: all): how many leading rows of the batch's ``rows`` (None: its first tensor's) are real
        samples, the rest being a distributed sampler's padding. Every rank runs one forward per batch (a sharded
        model gathers its weights in it): on the real rows only when there are some, so that a loss the model
        computes itself covers them alone; on the whole batch when all are padding (a model may refuse an empty
        batch), whose output is then cut to no rows."""
        rec, engine = self.record, self.engine
        batch = real_rows(batch, keep, rows)
        rec.batch, rec.data, rec.label = engine.schedule.place(batch, engine.device)
        rec.output, rec.loss = self.evaluate(rec.batch, rec.data, rec.label, with_loss)
        if keep == 0 and drop_all_rows(rec, rows):
            engine.schedule.current_batch = rec.batch

    def evaluate(self, batch: Any, data: Any, label: Any, with_loss: bool):
        """Evaluation's forward and loss of a placed batch (no loss: None) -> (output, loss)."""
        output = call_with(self.forward, data)
        return output, (self.loss(output, label, batch, required=False) if with_loss else None)


def real_rows(batch: Any, keep: Optional[int], rows: Optional[int] = None) -> Any:
    """An evaluation batch's first ``keep`` of its ``rows`` (None: its first tensor's), its real samples (the rest a
    distributed sampler's padding); the batch whole when ``keep`` is None (all real) or 0 (all padding: every rank
    still runs one forward on it)."""
    return take_rows(batch, batch_len(batch) if rows is None else rows, keep) if keep else batch


def drop_all_rows(rec: Any, rows: Optional[int] = None) -> bool:
    """An evaluation batch that is all padding, after its forward: cut ``rec``'s batch, its split, label and output
    to no rows, and make its loss a zero (it weighs nothing in a per-sample mean, where a mean over no rows would be
    NaN). False (nothing cut) when no output tensor has the batch's ``rows`` (None: its first tensor's) first,
    since labels cut alone would no longer match the output."""
    rows = batch_len(rec.batch) if rows is None else rows
    if not any(isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == rows for t in iter_leaves(rec.output)):
        return False
    rec.batch, rec.data, rec.label, rec.output = (take_rows(part, rows, 0)
                                                  for part in (rec.batch, rec.data, rec.label, rec.output))
    if isinstance(rec.loss, torch.Tensor):
        rec.loss = torch.zeros_like(rec.loss)
    return True


class AutoMicroBatchStep(TrainStep):
    """``gradient_accumulation='auto'``: forward, loss and backward of a batch as one unit that the engine's
    ``AutoMicroBatcher`` retries in more pieces when it runs out of memory; no handler can act inside it.
    An evaluation batch's forward is split the same way."""

    INSIDE = ("after_forward", "after_loss", "before_backward")

    def __init__(self, engine, record: Any = None, events: Any = NO_EVENTS, owner: Any = None):
        inside = [f"{_owner_name(fn)}.{name}" for name in self.INSIDE for fn in getattr(events, name)]
        if inside:
            raise ValueError(f"gradient_accumulation='auto' runs forward, loss and backward as one unit (a batch "
                             f"that runs out of memory is retried in pieces), so no hook can act between them; "
                             f"these hooks try to: {', '.join(inside)}. Use a fixed gradient_accumulation with them")
        super().__init__(engine, record, events, owner)

    def forward_backward(self, batch, where=None):
        rec, engine, owner = self.record, self.engine, self.owner
        self.load(batch)
        for fn in self.events.before_forward:
            fn(owner)
        rec.output, rec.loss = engine.auto_batcher.run(engine, rec.batch, rec.data, rec.label, where,
                                                       keep_output=self.keep_output)
        for fn in self.events.after_backward:
            fn(owner)

    def evaluate(self, batch, data, label, with_loss):
        return self.engine.auto_batcher.evaluate(self.engine, batch, data, label, with_loss)


def _owner_name(fn) -> str:
    owner = getattr(fn, "__self__", None)
    return type(owner).__name__ if owner is not None else getattr(fn, "__qualname__", repr(fn))


def make_train_step(engine, record: Any = None, events: Any = NO_EVENTS, owner: Any = None) -> TrainStep:
    """The step ``engine`` trains with: automatic micro-batching when the config asked for it."""
    cls = AutoMicroBatchStep if engine.auto_batcher is not None else TrainStep
    return cls(engine, record, events, owner)
