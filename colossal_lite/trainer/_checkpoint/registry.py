"""``StateRegistry``: every stateful part of a trainer, by section and key -- what the checkpoint code walks."""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

__all__ = ["StateRegistry"]

_Part = tuple  # (owner, save: () -> state, load: (state) -> None)


class StateRegistry:
    """The stateful parts of one trainer: each is registered once, under a section and a key, with the function
    that returns its state and the one that loads it back.

    A section holds either one part (``'progress'``, ``'history'``: key None) or parts by key (``'hooks'``:
    ``'EarlyStoppingHook.0'``; ``'objects'``: what the user registered). ``rank=True`` parts hold what differs
    from rank to rank (random generators, the train metrics' sums); a checkpoint keeps them in each rank's own
    file. A state loaded while its part is not registered waits (``pending``) until the owner of the section
    hands it on: the hooks of the next ``fit`` are attached after a checkpoint was read. The registry knows no
    file layout; ``_checkpoint.contents`` maps its sections to a checkpoint's entries.
    """

    def __init__(self):
        self._parts: Dict[bool, Dict[str, Dict[Optional[str], _Part]]] = {False: {}, True: {}}
        self._keyed: Dict[bool, Dict[str, bool]] = {False: {}, True: {}}
        self._pending: Dict[bool, Dict[str, Dict[Optional[str], Any]]] = {False: {}, True: {}}
        self._before_save: Dict[str, Callable[[], None]] = {}

    def section(self, name: str, keyed: bool, rank: bool = False) -> None:
        """Declare a section: ``keyed`` sections hold parts by key (and save ``{}`` when empty)."""
        self._keyed[rank][name] = keyed
        self._parts[rank].setdefault(name, {})

    def add(self, name: str, key: Optional[str], owner: Any, save: Optional[Callable[[], Any]] = None,
            load: Optional[Callable[[Any], None]] = None, rank: bool = False) -> None:
        """Register ``owner`` under ``name`` / ``key``; ``save`` / ``load`` default to its ``state_dict`` /
        ``load_state_dict``. A keyed section needs a key, a section of one part takes None."""
        if name not in self._keyed[rank]:
            raise KeyError(f"StateRegistry: no section {name!r} (rank={rank}); declare it with section()")
        if self._keyed[rank][name] != (key is not None):
            raise ValueError(f"StateRegistry: section {name!r} {'needs a key' if key is None else 'takes key None'}")
        self._parts[rank][name][key] = (owner, save or owner.state_dict, load or owner.load_state_dict)

    def clear(self, name: str) -> None:
        """Unregister the parts of section ``name`` (shared and per rank); its waiting states keep waiting."""
        for rank in (False, True):
            self._parts[rank].get(name, {}).clear()
        self._before_save.pop(name, None)

    def before_save(self, name: str, fn: Callable[[], None]) -> None:
        """Call ``fn`` before the states are read (the owner of section ``name`` brings its state up to date;
        every rank calls ``state()``, so ``fn`` may be a collective). Cleared with the section."""
        self._before_save[name] = fn

    def parts(self, name: str, rank: bool = False) -> Dict[Optional[str], Any]:
        """The registered owners of section ``name``, by key."""
        return {key: part[0] for key, part in self._parts[rank].get(name, {}).items()}

    def key_of(self, owner: Any, name: str) -> str:
        """The key ``owner`` is registered under in section ``name``."""
        for key, part in self._parts[False].get(name, {}).items():
            if part[0] is owner:
                return key
        raise ValueError(f"{owner!r} is not registered in the trainer's {name!r}")

    # -- save --------------------------------------------------------------------------------------
    def state(self, rank: bool = False) -> Dict[str, Any]:
        """``{section: state}`` (a keyed section: ``{key: state}``, empty states left out). The shared
        states are read after every ``before_save`` function has run."""
        if not rank:
            for fn in list(self._before_save.values()):
                fn()
        out: Dict[str, Any] = {}
        for name, parts in self._parts[rank].items():
            if self._keyed[rank][name]:
                out[name] = {key: state for key, (_, save, _) in parts.items() if (state := save())}
            elif None in parts:
                out[name] = parts[None][1]()
        return out

    # -- load --------------------------------------------------------------------------------------
    def load(self, states: Dict[str, Any], rank: bool = False) -> None:
        """Give each registered part its state from ``{section: state}``; the states of parts not registered
        wait (they replace what waited in those sections). A section given as None is left as it is."""
        for name, state in states.items():
            if state is None or name not in self._keyed[rank]:
                continue
            given = dict(state) if self._keyed[rank][name] else {None: state}
            parts = self._parts[rank][name]
            waiting = {}
            for key, value in given.items():
                if key in parts:
                    parts[key][2](value)
                else:
                    waiting[key] = value
            self._pending[rank][name] = waiting

    def hand_on(self, name: str, rank: bool = False, drop_rest: bool = False) -> None:
        """Load the waiting states of section ``name`` into its parts registered now; ``drop_rest``: forget
        those still without a part (else they keep waiting)."""
        waiting = self._pending[rank].get(name, {})
        parts = self._parts[rank].get(name, {})
        for key in [k for k in waiting if k in parts]:
            parts[key][2](waiting.pop(key))
        if drop_rest:
            waiting.clear()
