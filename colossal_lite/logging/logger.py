"""``get_dist_logger``: a logger that knows the rank.

Console output goes to rank 0 by default (``ranks=[0]``); pass ``ranks=[0, 1]`` or
``ranks='all'`` for others. Errors print on every rank unless ``ranks`` says otherwise.
On a terminal the console output goes through rich; otherwise it is plain lines,
so batch logs stay readable. Files written by ``log_to_file`` get every message of their rank.
A console line printed by a rank other than 0 names it (``colossal_lite [rank 1] - ERROR: ...``): the
ranks share one terminal or log, and a line without its rank cannot be told apart from rank 0's.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Dict, Iterable, Optional, Union

_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_loggers: Dict[str, "DistributedLogger"] = {}


def _current_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def _stream_is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class _ConsoleFilter(logging.Filter):
    def filter(self, record):
        return getattr(record, "cl_console", True)


class _ConsoleFormatter(logging.Formatter):
    """The console format, with `` [rank R]`` after the logger's name on ranks other than 0 (read at each line:
    a logger made before ``launch`` knows its rank only from the environment until then)."""

    def format(self, record):
        rank = _current_rank()
        record.cl_rank = f" [rank {rank}]" if rank else ""
        return super().format(record)


class DistributedLogger:
    """Rank-aware logger; one instance per name (``get_dist_logger(name)``)."""

    def __init__(self, name: str):
        self.name = name
        self._logger = logging.getLogger(f"colossal_lite.{name}" if name != "colossal_lite" else "colossal_lite")
        self._logger.propagate = False
        self._logger.setLevel(logging.INFO)
        self._console: Optional[logging.Handler] = None
        self._console_stream = None
        self._file_paths = set()

    @staticmethod
    def get_instance(name: str) -> "DistributedLogger":
        return get_dist_logger(name)

    def _ensure_console(self):
        # (re)made lazily so a redirected/captured stdout is honoured and rich is only imported on a terminal
        stream = sys.stdout
        if self._console is not None and self._console_stream is stream:
            return
        if self._console is not None:
            self._logger.removeHandler(self._console)
        if _stream_is_terminal(stream) and not os.environ.get("NO_COLOR"):
            from rich.console import Console
            from rich.logging import RichHandler

            handler: logging.Handler = RichHandler(console=Console(file=stream), show_path=False, markup=False)
            handler.setFormatter(_ConsoleFormatter(f"{self.name}%(cl_rank)s - %(message)s"))
        else:
            handler = logging.StreamHandler(stream)
            handler.setFormatter(_ConsoleFormatter(f"{self.name}%(cl_rank)s - %(levelname)s: %(message)s"))
        handler.addFilter(_ConsoleFilter())
        self._logger.addHandler(handler)
        self._console, self._console_stream = handler, stream

    def set_level(self, level: str):
        level = str(level).upper()
        if level not in _LEVELS:
            raise ValueError(f"logging level must be one of {', '.join(_LEVELS)}, got {level!r}")
        self._logger.setLevel(getattr(logging, level))

    def log_to_file(self, path: Union[str, Path], mode: str = "a", level: str = "INFO", suffix: Optional[str] = None):
        """Also write this rank's messages to ``path/rank_{rank}[_{suffix}].log`` (``path`` is a folder)."""
        level = str(level).upper()
        if level not in _LEVELS:
            raise ValueError(f"logging level must be one of {', '.join(_LEVELS)}, got {level!r}")
        folder = Path(path)
        if folder.exists() and not folder.is_dir():
            raise NotADirectoryError(f"log_to_file expects a folder, but {folder} is a file")
        folder.mkdir(parents=True, exist_ok=True)
        rank = _current_rank()
        file = folder / (f"rank_{rank}_{suffix}.log" if suffix else f"rank_{rank}.log")
        if str(file) in self._file_paths:
            return
        handler = logging.FileHandler(file, mode=mode, encoding="utf-8")
        handler.setLevel(getattr(logging, level))
        handler.setFormatter(logging.Formatter(f"%(asctime)s {self.name} - %(levelname)s: %(message)s"))
        self._logger.addHandler(handler)
        self._file_paths.add(str(file))

    def _log(self, level: int, message, ranks: Optional[Union[Iterable[int], str]], default_all: bool):
        if not self._logger.isEnabledFor(level):
            return
        self._ensure_console()
        if ranks is None:
            on_console = default_all or _current_rank() == 0
        elif ranks == "all":
            on_console = True
        else:
            on_console = _current_rank() in set(ranks)
        if not on_console and len(self._logger.handlers) <= 1:
            return
        self._logger.log(level, str(message), extra={"cl_console": on_console})

    def info(self, message, parallel_mode=None, ranks=None):
        self._log(logging.INFO, message, ranks, default_all=False)

    def warning(self, message, parallel_mode=None, ranks=None):
        self._log(logging.WARNING, message, ranks, default_all=False)

    def debug(self, message, parallel_mode=None, ranks=None):
        self._log(logging.DEBUG, message, ranks, default_all=False)

    def error(self, message, parallel_mode=None, ranks=None):
        self._log(logging.ERROR, message, ranks, default_all=True)


def get_dist_logger(name: str = "colossal_lite") -> DistributedLogger:
    """The logger called ``name`` (one per name per process)."""
    if name == "colossalai":  # legacy scripts pass the old default name
        name = "colossal_lite"
    if name not in _loggers:
        _loggers[name] = DistributedLogger(name)
    return _loggers[name]


def disable_existing_loggers(include: Optional[list] = None, exclude: Optional[list] = None):
    """Set other libraries' loggers to WARNING (``include``: only these; ``exclude``: never these)."""
    exclude = ["colossal_lite", "colossalai"] if exclude is None else exclude
    for name in list(logging.root.manager.loggerDict):
        if include is not None and name not in include:
            continue
        if any(name == e or name.startswith(e + ".") for e in exclude):
            continue
        logging.getLogger(name).setLevel(logging.WARNING)
