"""The parts of ``colossal_lite.trainer.checkpointing`` (read its docstring for the design), one idea per module:
``contents`` (what a checkpoint holds, and writing it), ``restore`` (reading it back into a run), ``session``
(one ``fit``'s resume, saves at safe points and preemption), ``preemption`` (the exit after a preemption) and
``round_trip`` (``fit(test_mode=True)``'s save-and-compare)."""
