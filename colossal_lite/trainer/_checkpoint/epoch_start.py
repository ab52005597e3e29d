"""``EpochStart``: what continuing an epoch in a fresh process needs besides its position -- the random state the
epoch's data iterator began from, and the batches a loader without len had read ahead of training."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from ...checkpoint import capture_rng_state

__all__ = ["EpochStart", "NOT_STORED"]

#: ``take``'s read-ahead when the checkpoint could not hold the batches read ahead (not tensors and plain values).
NOT_STORED = object()


def _plain(obj: Any) -> bool:
    """``obj`` is tensors and plain values in plain containers: stored and read back, it is the same batch."""
    if obj is None or isinstance(obj, (torch.Tensor, bool, int, float, complex, str, bytes)):
        return True
    if type(obj) in (list, tuple):
        return all(_plain(item) for item in obj)
    if type(obj) is dict:
        return all(isinstance(key, (str, int)) and _plain(value) for key, value in obj.items())
    return False


def _own_storage(obj: Any) -> Any:
    """``obj`` with each tensor that views a larger storage copied out (a file would hold the whole storage)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone() if obj.untyped_storage().nbytes() > obj.nbytes else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_own_storage(item) for item in obj)
    if isinstance(obj, dict):
        return {key: _own_storage(value) for key, value in obj.items()}
    return obj


class _Held:
    """The batches an epoch's loop had read ahead when it ended."""

    def __init__(self, held):
        self.held = held


class EpochStart:
    """A part of the trainer's registry, per rank. Inside an epoch its state is ``{'epoch', 'batch_idx', 'rng',
    'read_ahead'}`` (``{}`` at an epoch's end, where nothing of the kind is needed).

    ``rng``: the random state recorded just before the epoch's iterator was made. Making it draws from torch's
    generator (a plain ``DataLoader``'s base seed for its workers, a ``RandomSampler``'s order), and so does
    reading its first batches; a resume inside the epoch makes the iterator and reads the batches already trained
    from that state, as the uninterrupted run did, then puts back the checkpoint's state.

    ``read_ahead`` (a loader without len only): the batches read but not yet trained. Such an epoch reads ahead of
    training, so those batches' draws (an augmentation in the main process) are already in the checkpoint's random
    state; the resume trains them first instead of reading them again from there. None: they are not tensors and
    plain values, so the checkpoint could not hold them.
    """

    def __init__(self, state):
        self._state = state  # the trainer's ``State``: where the run stands
        self._rng: Optional[Tuple[int, Dict[str, Any]]] = None  # (epoch, random state when its iterator was made)
        self._epoch = None  # the running epoch's batches (an ``UnsizedEpoch`` holds those read ahead)
        self._resume: Optional[Dict[str, Any]] = None  # what continuing the epoch starts from (loaded, or at a cut)

    def begin(self, epoch: int) -> None:
        """The epoch starts at its first batch: its iterator is made next, from the random state now."""
        self._rng = (epoch, capture_rng_state())
        self._resume = None

    def running(self, epoch) -> None:
        """``epoch`` (a ``SizedEpoch`` / ``UnsizedEpoch``) hands out the batches of the epoch in progress."""
        self._epoch = epoch

    def loop_ended(self) -> None:
        """The loop over the epoch's batches ended: what it holds read ahead is kept, not the epoch itself, whose
        iterator would otherwise keep a DataLoader's workers alive after the fit."""
        held = getattr(self._epoch, "held", None)
        self._epoch = None if held is None else _Held(held)

    def _snapshot(self, stored: bool) -> Dict[str, Any]:
        st = self._state
        held = getattr(self._epoch, "held", None)
        if not st.batch_idx or ((self._rng is None or self._rng[0] != st.epoch) and held is None):
            return {}
        out: Dict[str, Any] = {"epoch": st.epoch, "batch_idx": st.batch_idx}
        if self._rng is not None and self._rng[0] == st.epoch:
            out["rng"] = self._rng[1]
        if held is not None:
            batches = list(held)
            out["read_ahead"] = batches if not stored else _own_storage(batches) if _plain(batches) else None
        return out

    def state_dict(self) -> Dict[str, Any]:
        return self._snapshot(stored=True)

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        self._resume = dict(state) if state else None
        self._rng = None

    def note_cut(self) -> None:
        """The fit stops inside the epoch: the next fit on this trainer continues it from here, as a resume from
        the checkpoint taken here would (the batches read ahead kept as they are, whatever their type)."""
        self._resume = self._snapshot(stored=False) or None

    def forget(self) -> None:
        """The run was moved by hand: what was recorded belongs to another position."""
        self._resume = None
        self._rng = None

    def take(self, epoch: int, skip: int) -> Tuple[Optional[Dict[str, Any]], Optional[List[Any]]]:
        """The epoch continues ``skip`` batches in: ``(random state its iterator began from or None, batches read
        ahead to train first: None when there were none to keep, NOT_STORED when they could not be kept)``."""
        resume, self._resume = self._resume, None
        if resume is None or resume.get("epoch") != epoch or resume.get("batch_idx") != skip:
            self._rng = None
            return None, None
        rng = resume.get("rng")
        self._rng = (epoch, rng) if rng is not None else None  # later checkpoints of this epoch keep it
        if "read_ahead" not in resume:
            return rng, None
        held = resume["read_ahead"]
        return rng, NOT_STORED if held is None else list(held)
