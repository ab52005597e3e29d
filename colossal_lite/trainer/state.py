"""``State``: the one object hooks read and change during a run.

Progress (epoch, step, iteration, batch index) survives between ``fit`` calls and goes into
checkpoints through ``state_dict()``; the per-iteration fields (batch, outputs, loss ...) are
overwritten every iteration; ``states`` is the legacy dict of metrics, reset at each ``fit``.
``docs/trainer.md`` says which event may change which field.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

__all__ = ["State"]


class State:
    """Progress, the current iteration and the metrics of a run.

    Progress, all counted from the start of training (not of this ``fit`` call):

    - ``epoch``: index of the current epoch (0-based); it grows by one after an epoch and its evaluation.
    - ``step``: optimizer steps taken (accumulation windows completed), including the one of this iteration.
    - ``iteration``: training micro-batches run.
    - ``batch_idx``: micro-batches run in the current epoch.

    Set by ``fit`` from its arguments: ``max_epochs`` (None = no epoch limit: a train loader without ``len``
    and a length in steps), ``max_steps`` (None = no step limit), ``steps_per_epoch`` (optimizer steps per
    epoch), ``iters_per_epoch`` (micro-batches per epoch), ``total_steps`` (optimizer steps the whole run will
    take), ``fitting`` (inside ``fit``; False in ``evaluate`` alone), ``will_test`` (``fit`` got a test loader),
    ``test_mode`` (``fit(test_mode=True)``'s one step and evaluation run: a hook writes nothing that lasts),
    ``closing_evaluation`` (an evaluation only the end of training asked for is running: the values are for the
    record, and a hook that decides training's course, an early stop or an LR plateau, leaves them out, since a
    longer run resumed from the final checkpoint would otherwise decide on an evaluation its uninterrupted
    counterpart never made). A train loader without ``len`` leaves ``steps_per_epoch`` and ``iters_per_epoch``
    None, and ``total_steps`` None unless the run's length is in steps; ``epoch_length`` is then the micro-batches
    of the current epoch once its iterator has ended (the loop reads a little ahead, so it is known before the
    epoch's last step).

    Current iteration: ``phase`` ('train', 'test' or None), ``batch`` (as loaded, on the device),
    ``data`` and ``label`` (the model input and the target split from it), ``output``, ``loss``
    (a device tensor, not divided by the accumulation size), ``grad_norm`` (device tensor or None),
    ``stepped`` (this iteration ended an accumulation window, so the optimizer stepped) and ``updated``
    (that step really changed the parameters; False when fp16 skipped it).

    Control: ``stop_training`` (set it to end ``fit`` after the current iteration; set it from values
    every rank agrees on, or ranks part ways) and ``stop_reason`` (a line for the log).
    """

    def __init__(self):
        # progress (checkpointed)
        self.epoch = 0
        self.step = 0
        self.iteration = 0
        self.batch_idx = 0
        # run shape, set by fit
        self.max_epochs: Optional[int] = None
        self.max_steps: Optional[int] = None
        self.steps_per_epoch: Optional[int] = None
        self.iters_per_epoch: Optional[int] = None
        self.total_steps: Optional[int] = None
        self.fitting = False  # inside fit (False in evaluate alone)
        self.will_test = False  # fit got a test_dataloader
        self.test_mode = False  # fit(test_mode=True) runs its one step: nothing written that lasts
        self.closing_evaluation = False  # an evaluation only the end of training asked for: for the record
        self.epoch_start_step = 0  # value of ``step`` when the current epoch began
        self.epoch_length: Optional[int] = None  # a loader without len: the epoch's micro-batches, once known
        self.last_eval_step: Optional[int] = None  # ``step`` at the last evaluation inside fit
        # current iteration
        self.phase: Optional[str] = None
        self.batch: Any = None
        self.data: Any = None
        self.label: Any = None
        self.output: Any = None
        self.loss: Any = None
        self.grad_norm: Any = None
        self.stepped = False
        self.updated = False
        self._lr: Optional[float] = None  # ``lr``: set, or read from ``_lr_source`` (LRSchedulerHook)
        self._lr_source = None
        # control
        self.stop_training = False
        self.stop_reason: Optional[str] = None
        # the legacy ``trainer.states`` dict: 'metrics' -> {'train': {...}, 'test': {...}}, 'step_metrics' -> {...}
        self.states: Dict[str, Any] = {}
        self.reset_states()

    # -- legacy metrics dict ---------------------------------------------------------------
    def reset_states(self) -> None:
        """Forget metrics and hook entries (done at the start of every ``fit`` and ``evaluate``)."""
        self.states.clear()
        self.states["metrics"] = {"train": {}, "test": {}}
        self.states["step_metrics"] = {}

    @property
    def metrics(self) -> Dict[str, Dict[str, Any]]:
        """``{'train': {name: Metric}, 'test': {name: Metric}}`` (the same dict as ``states['metrics']``)."""
        return self.states["metrics"]

    @property
    def step_metrics(self) -> Dict[str, Any]:
        """``{lower-case name: value}`` of the last iteration (device tensors or floats, read only when shown)."""
        return self.states.setdefault("step_metrics", {})

    # -- learning rate ------------------------------------------------------------------------
    @property
    def lr(self) -> Optional[float]:
        """The learning rate: read from the LR scheduler of ``LRSchedulerHook(store_lr_in_state=True)``
        when one is attached (so it is current after every step without costing one), else the value set."""
        source = self._lr_source
        return float(source()) if source is not None else self._lr

    @lr.setter
    def lr(self, value: Optional[float]) -> None:
        self._lr, self._lr_source = value, None

    def follow_lr(self, source) -> None:
        """Make ``lr`` read ``source()`` (a callable returning the current learning rate) when asked."""
        self._lr_source = source

    # -- derived -----------------------------------------------------------------------------
    @property
    def epoch_finished(self) -> bool:
        """All micro-batches of the current epoch have run (at ``after_train_epoch``: False when ``max_steps``,
        a stop or a preemption cut the epoch short, so the next ``fit`` continues it)."""
        end = self.iters_per_epoch if self.iters_per_epoch is not None else self.epoch_length
        return end is not None and self.batch_idx >= end

    @property
    def max_steps_reached(self) -> bool:
        return self.max_steps is not None and self.step >= self.max_steps

    def clear_iteration(self) -> None:
        """Drop references to the last batch, outputs and loss (so their memory can be freed)."""
        self.batch = self.data = self.label = self.output = self.loss = None
        self.grad_norm = None

    # -- checkpoint ----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, int]:
        """The progress counters: ``epoch``, ``step``, ``iteration``, ``batch_idx`` (micro-batches done in the epoch)."""
        return {"epoch": self.epoch, "step": self.step, "iteration": self.iteration, "batch_idx": self.batch_idx}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        for key in ("epoch", "step", "iteration", "batch_idx"):
            if key in state:
                value = int(state[key])
                if value < 0:
                    raise ValueError(f"State.load_state_dict: {key} must be >= 0, got {value}")
                setattr(self, key, value)

    def __repr__(self) -> str:
        return (f"State(epoch={self.epoch}, step={self.step}, iteration={self.iteration}, batch_idx={self.batch_idx}, "
                f"phase={self.phase!r}, stop_training={self.stop_training})")
