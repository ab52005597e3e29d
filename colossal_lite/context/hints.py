"""What a wrong config value most likely meant, so that a fix hint can show the user's own value.

Each ``*_meant`` / ``as_*`` function returns the corrected value, or None when nothing sensible can be
told from the value (the hint then falls back to a stock example).
"""
from __future__ import annotations

import datetime
import difflib
import math
import numbers
from typing import Any, Dict, Iterable, Optional

from ..amp.amp_type import AMP_TYPE

_TRUE_WORDS = ("true", "yes", "on", "1")
_FALSE_WORDS = ("false", "no", "off", "0")

# Other names people give the precision modes (torch dtypes are matched by their printed name).
_MODE_WORDS = {
    "fp16": "AMP_TYPE.TORCH", "float16": "AMP_TYPE.TORCH", "half": "AMP_TYPE.TORCH", "amp": "AMP_TYPE.TORCH",
    "torch.float16": "AMP_TYPE.TORCH", "torch.half": "AMP_TYPE.TORCH", "o1": "AMP_TYPE.TORCH",
    "bfloat16": "AMP_TYPE.BF16", "bf-16": "AMP_TYPE.BF16", "bf_16": "AMP_TYPE.BF16", "torch.bfloat16": "AMP_TYPE.BF16",
    "o2": "AMP_TYPE.NAIVE", "o3": "AMP_TYPE.NAIVE",
    "fp32": "None", "float32": "None", "torch.float32": "None", "none": "None", "off": "None",
}


def py(value: Any) -> str:
    """``value`` as it would be written in a config file: ``AMP_TYPE.BF16``, ``dict(stage=2)``, ``'mean'``."""
    if isinstance(value, AMP_TYPE):
        return f"AMP_TYPE.{value.name}"
    if isinstance(value, dict):
        if all(isinstance(k, str) and k.isidentifier() for k in value):
            return "dict(" + ", ".join(f"{k}={py(v)}" for k, v in value.items()) + ")"
        return "{" + ", ".join(f"{py(k)}: {py(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(py(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    return repr(value)


def as_bool(value: Any) -> Optional[bool]:
    """True/False meant by ``1``, ``0``, ``'yes'``, ``'False'`` and the like."""
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE_WORDS:
            return True
        if word in _FALSE_WORDS:
            return False
    return None


def as_number(value: Any) -> Optional[numbers.Real]:
    """The finite number written as a number or as a string (``'8'`` -> 8, ``'1e-3'`` -> 0.001); bools are not numbers."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        number = value
    elif isinstance(value, str):
        text = value.strip().replace("_", "")
        try:
            number = int(text)
        except ValueError:
            try:
                number = float(text)
            except ValueError:
                return None
    else:
        return None
    return number if math.isfinite(number) else None


def as_positive_int(value: Any) -> Optional[int]:
    """A whole number >= 1 written as a float or a string (``8.0``, ``'8'``) -> 8."""
    number = as_number(value)
    if number is None or number < 1 or number != int(number):
        return None
    return int(number)


def as_positive_number(value: Any) -> Optional[numbers.Real]:
    number = as_number(value)
    return number if number is not None and number > 0 else None


def as_seconds(value: Any) -> Optional[numbers.Real]:
    """Seconds > 0 meant by a number, a string of one, or a ``datetime.timedelta``."""
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
        return (int(seconds) if seconds.is_integer() else seconds) if seconds > 0 else None
    return as_positive_number(value)


def _norm(word: str) -> str:
    return word.strip().lower().replace("_", "-").replace(" ", "-")


def as_choice(value: Any, choices: Iterable[str], aliases: Optional[Dict[str, str]] = None) -> Optional[str]:
    """The one of ``choices`` a string meant: another case, ``_`` for ``-``, an alias, or a close misspelling."""
    if not isinstance(value, str):
        return None
    by_norm = {_norm(c): c for c in choices}
    word = _norm(value)
    word = _norm(aliases.get(word, word)) if aliases else word
    if word in by_norm:
        return by_norm[word]
    close = difflib.get_close_matches(word, list(by_norm), n=1, cutoff=0.6)
    return by_norm[close[0]] if close else None


def amp_mode_meant(value: Any) -> Optional[str]:
    """How to write the precision mode ``value`` meant (``'AMP_TYPE.BF16'``, ``'None'``), apex excluded."""
    if value is None:
        return "None"
    if isinstance(value, AMP_TYPE):
        return None if value is AMP_TYPE.APEX else py(value)
    if isinstance(value, bool):
        return None
    word = str(value).strip().lower()
    word = word[len("amp_type."):] if word.startswith("amp_type.") else word  # the enum's name written as a string
    if word in _MODE_WORDS:
        return _MODE_WORDS[word]
    for mode in AMP_TYPE:
        if mode is not AMP_TYPE.APEX and word in (mode.value, mode.name.lower()):
            return py(mode)
    close = difflib.get_close_matches(word, ["torch", "naive", "bf16", *_MODE_WORDS], n=1, cutoff=0.6)
    if not close:
        return None
    return _MODE_WORDS.get(close[0]) or py(AMP_TYPE(close[0]))
