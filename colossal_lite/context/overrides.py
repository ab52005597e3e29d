"""``--set KEY=VALUE``: config values given on the command line, applied to a loaded config before it is checked.

A dotted key reaches into dicts (``fp16.mode=bf16``, ``zero.stage=2``); a value is read as a Python literal
(``64``, ``1e-3``, ``True``, ``None``, ``[1, 2]``), ``true``/``false``/``none``/``null`` in any case as in YAML,
and otherwise kept as the plain string, so ``bf16`` needs no quotes. Each value set remembers the override that set it, so a check that refuses it names the override as a
config file's error names the line.
"""
from __future__ import annotations

import ast
import enum
from typing import Any, Dict, Iterable, List, Optional, Tuple

from .config import Config, ConfigException

KeyPath = Tuple[str, ...]


def parse_override(text: str) -> Tuple[KeyPath, Any]:
    """``'fp16.mode=bf16'`` -> ``(('fp16', 'mode'), 'bf16')``; a malformed override raises ``ConfigException``."""
    if not isinstance(text, str):
        raise TypeError(f"a config override must be a string KEY=VALUE, got {type(text).__name__}: {text!r}")
    key, eq, raw = text.partition("=")
    if not eq:
        raise ConfigException(f"--set {text}: no '=' in the override. Fix: write --set KEY=VALUE, "
                              f"for example --set zero.stage=2")
    parts = tuple(p.strip() for p in key.split("."))
    if not key.strip() or not all(parts):
        raise ConfigException(f"--set {text}: the key {key.strip()!r} has an empty part. Fix: write --set KEY=VALUE "
                              f"with a name on the left (dotted into dicts: fp16.mode=bf16)")
    return parts, _literal(raw.strip())


# Command-line users write YAML's and Hydra's spellings; kept as strings, 'false' would be truthy and switch on
# what it names. A quoted 'false' stays the string.
_WORDS = {"true": True, "false": False, "none": None, "null": None}


def _literal(raw: str) -> Any:
    """A Python literal when ``raw`` is one (numbers, True/False/None, quoted strings, lists, dicts), a word of
    ``_WORDS`` in any case, else ``raw``."""
    word = raw.lower()
    if word in _WORDS:
        return _WORDS[word]
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return raw


def cli_spelling(value: Any) -> str:
    """How to write ``value`` after ``--set KEY=`` so that it reads back as ``value``: a plain string bare when it
    would not read as something else, an enum member by its value (``AMP_TYPE.BF16`` -> ``bf16``), else ``repr``."""
    if isinstance(value, enum.Enum):
        return cli_spelling(value.value)
    if isinstance(value, str) and value == value.strip() and _literal(value) == value:
        return value
    return repr(value)


def apply_overrides(config: Config, overrides: Optional[Iterable[str]]) -> Config:
    """A copy of ``config`` with each override set in order (a later one wins); ``config`` is left as it was.

    Only the dicts a dotted key passes through are copied, so a Config shared with the caller is not changed.
    A dotted key may pass through a missing key or a None value (a new dict is made, so ``--set fp16.mode=bf16``
    works on a config without ``fp16``), but not through any other value.
    """
    overrides = [overrides] if isinstance(overrides, str) else list(overrides or ())
    if not overrides:
        return config
    result = Config(config)
    origins: Dict[KeyPath, str] = {}
    for text in overrides:
        path, value = parse_override(text)
        _set_path(result, path, value, text)
        origins = {p: t for p, t in origins.items() if p[:len(path)] != path}  # a later override replaces the key
        origins[path] = text
    object.__setattr__(result, "_source", OverriddenSource(config, origins))
    return result


def _set_path(config: Config, path: KeyPath, value: Any, text: str) -> None:
    node = config
    for i, name in enumerate(path[:-1]):
        child = node.get(name)
        if child is None:
            child = Config()
        elif not isinstance(child, dict):
            where = ".".join(path[:i + 1])
            raise ConfigException(f"--set {text}: cannot set '{'.'.join(path)}' because '{where}' is "
                                  f"{type(child).__name__} {child!r}, not a dict. Fix: set '{where}' itself "
                                  f"(--set {where}=VALUE), or make it a dict in the config")
        else:
            child = Config(child)  # a copy: the caller's nested dict stays as it was
        node[name] = child
        node = child
    node[path[-1]] = value


class OverriddenSource:
    """Where each key of an overridden config came from: its ``--set`` override, or the config it was loaded from."""

    def __init__(self, original: Config, origins: Dict[KeyPath, str]):
        self.original = original  # the config before the overrides, which knows its own keys' places
        self.origins = origins

    def override_of(self, path: KeyPath) -> Optional[str]:
        """The override that set the key at ``path`` (or a dict holding it), or None when the config did."""
        for n in range(len(path), 0, -1):
            text = self.origins.get(tuple(path[:n]))
            if text is not None:
                return text
        return None

    def where(self, path: KeyPath) -> str:
        """``--set TEXT`` for a key an override set (or one inside it); for a key that holds overridden keys, the
        config's own place followed by those overrides, or the overrides alone when they made the key."""
        text = self.override_of(path)
        if text is not None:
            return f"--set {text}"
        inside: List[str] = [f"--set {t}" for p, t in self.origins.items() if path and p[:len(path)] == tuple(path)]
        if not inside:
            return self.original._where(*path)
        if not _holds(self.original, path):
            return ", ".join(inside)
        return f"{self.original._where(*path)} (with {', '.join(inside)})"


def _holds(config: dict, path: KeyPath) -> bool:
    """Whether ``config`` has a value (not None) at the dotted ``path``."""
    node: Any = config
    for name in path:
        if not isinstance(node, dict) or node.get(name) is None:
            return False
        node = node[name]
    return True


__all__ = ["parse_override", "apply_overrides", "cli_spelling", "OverriddenSource"]
