"""``Config``: a dict with attribute access, loaded from a ``.py`` file in isolation."""
from __future__ import annotations

import ast
import inspect
import sys
import types
import uuid
from pathlib import Path
from typing import Any, Dict, Optional, Tuple


class ConfigException(Exception):
    """A config that cannot work; the message names the file, line, key and fix."""


class Config(dict):
    """Dict with attribute access. Nested dicts become ``Config``; dicts inside lists stay plain.

    A missing attribute raises ``AttributeError`` (so ``hasattr`` works), a missing item ``KeyError``.
    """

    def __init__(self, config: Optional[dict] = None):
        super().__init__()
        object.__setattr__(self, "_source", None)
        if config is not None:
            if not isinstance(config, dict):
                raise TypeError(f"Config expects a dict, got {type(config).__name__}")
            for key, value in config.items():
                self._add_item(key, value)
            if isinstance(config, Config):
                object.__setattr__(self, "_source", config._source)

    def __missing__(self, key):
        raise KeyError(key)

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key, value):
        self._add_item(key, value)

    def __delattr__(self, key):
        try:
            del self[key]
        except KeyError:
            raise AttributeError(key) from None

    def _add_item(self, key, value):
        if isinstance(value, dict) and not isinstance(value, Config):
            value = Config(value)
        super().__setitem__(key, value)

    def __setitem__(self, key, value):
        self._add_item(key, value)

    def update(self, config=None, **kwargs):
        if config is not None:
            if not isinstance(config, dict):
                raise TypeError(f"Config.update expects a dict, got {type(config).__name__}")
            for k, v in config.items():
                self._add_item(k, v)
        for k, v in kwargs.items():
            self._add_item(k, v)
        return self

    def copy(self) -> dict:
        """A shallow plain-dict copy (legacy ``initialize`` relied on this being a dict)."""
        return dict(self)

    def __reduce__(self):
        return (Config, (dict(self),))

    # -- source tracking, used by error messages -------------------------------------------
    # (underscore names only: a public attribute here would hide a user's key of that name)
    def _where(self, *path: str) -> str:
        """``file:line`` of the key at ``path`` when known, else the file, else ``<dict config>``; the ``--set``
        override that set it for a config given overrides (``OverriddenSource``)."""
        src = self._source
        return "<dict config>" if src is None else src.where(path)

    @staticmethod
    def from_file(filename) -> "Config":
        return load_config_file(filename)


class ConfigSource:
    """Where a config came from, and the line of each key written in it; ``elsewhere``: the source of each
    top-level key the file took from a sibling file (``from base_config import *``)."""

    def __init__(self, path: Path, lines: Dict[Tuple[str, ...], int],
                 elsewhere: Optional[Dict[str, "ConfigSource"]] = None):
        self.path = path
        self.lines = lines
        self.elsewhere = elsewhere or {}

    def where(self, path: Tuple[str, ...]) -> str:
        if path and path[0] in self.elsewhere:
            return self.elsewhere[path[0]].where(path)
        line = self.line_of(path)
        return f"{self.path}:{line}" if line else str(self.path)

    def line_of(self, path: Tuple[str, ...]) -> Optional[int]:
        # the deepest known prefix of the key path
        for n in range(len(path), 0, -1):
            line = self.lines.get(tuple(path[:n]))
            if line:
                return line
        return None


def _key_lines(tree: ast.Module) -> Dict[Tuple[str, ...], int]:
    """Map ``('fp16', 'mode')`` style key paths to the line where they are written."""
    lines: Dict[Tuple[str, ...], int] = {}

    def visit_value(prefix: Tuple[str, ...], node: ast.AST):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
            for kw in node.keywords:
                if kw.arg is not None:
                    lines[prefix + (kw.arg,)] = getattr(kw, "lineno", None) or node.lineno
                    visit_value(prefix + (kw.arg,), kw.value)
        elif isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and isinstance(k.value, str):
                    lines[prefix + (k.value,)] = k.lineno
                    visit_value(prefix + (k.value,), v)

    for stmt in tree.body:
        targets = []
        if isinstance(stmt, ast.Assign):
            targets = [t for t in stmt.targets if isinstance(t, ast.Name)]
            value = stmt.value
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
            targets = [stmt.target]
            value = stmt.value
        for t in targets:
            lines[(t.id,)] = stmt.lineno
            visit_value((t.id,), value)
    return lines


def _found_in(module, folder: Path) -> bool:
    """Whether ``module`` (a top-level module or package) was found directly in ``folder``."""
    locations = [getattr(module, "__file__", None)] if getattr(module, "__path__", None) is None else list(module.__path__)
    for loc in locations:
        try:
            if loc and Path(loc).resolve().parent == folder:
                return True
        except (OSError, TypeError, ValueError):
            pass
    return False


def load_config_file(filename) -> Config:
    """Execute a ``.py`` config in its own namespace and keep its public values.

    Kept: every top-level name not starting with ``_`` that is not a module or a class.
    The config may import sibling files from its folder; neither the config's module nor
    those siblings linger in ``sys.modules``, and ``sys.path`` is restored.
    """
    path = _config_path(filename)
    tree = _parse(path)
    module, siblings = _execute_isolated(tree, path)
    values: Dict[str, Any] = {}
    for name, value in module.__dict__.items():
        if name.startswith("_") or inspect.ismodule(value) or inspect.isclass(value):
            continue
        values[name] = value
    config = Config(values)
    lines = _key_lines(tree)
    object.__setattr__(config, "_source", ConfigSource(path, lines, _sibling_sources(values, lines, siblings)))
    return config


def _sibling_sources(values: Dict[str, Any], lines, siblings: Dict[Path, Dict[str, Any]]) -> Dict[str, ConfigSource]:
    """The sibling file that assigns each top-level key the config file took from it without assigning it."""
    found: Dict[str, ConfigSource] = {}
    for file, namespace in siblings.items():
        try:
            source = ConfigSource(file, _key_lines(_parse(file)))
        except (ConfigException, OSError, UnicodeDecodeError):
            continue  # a file we cannot read again: its keys keep the config's own place
        for name, value in values.items():
            if (name,) not in lines and (name,) in source.lines and namespace.get(name, source) is value:
                found.setdefault(name, source)
    return found


def _config_path(filename) -> Path:
    """The absolute path of an existing ``.py`` file, or a ``ConfigException`` saying what ``filename`` is instead."""
    if not isinstance(filename, (str, Path)):
        raise TypeError(f"config path must be a str or pathlib.Path, got {type(filename).__name__}")
    path = Path(filename).expanduser()
    if not path.exists():
        raise ConfigException(f"Config file not found: {path} (check the path given as config=...)")
    if path.is_dir():
        raise ConfigException(f"Config path is a folder, not a file: {path}")
    if path.suffix != ".py":
        raise ConfigException(f"Config file must be a Python file ending in .py: {path} (got '{path.suffix or 'no suffix'}')")
    return path.resolve()


def _parse(path: Path) -> ast.Module:
    try:
        source = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigException(f"{path}:1: not a Python config: it is not UTF-8 text (byte {e.start} cannot be "
                              f"decoded)") from None
    try:
        return ast.parse(source, filename=str(path))
    except SyntaxError as e:
        raise ConfigException(f"{path}:{e.lineno}: syntax error in config: {e.msg}\n    {(e.text or '').rstrip()}") from None


def _execute_isolated(tree: ast.Module, path: Path) -> Tuple[types.ModuleType, Dict[Path, Dict[str, Any]]]:
    """The config run as a module of its own, with its folder importable while it runs and forgotten after;
    with the namespace of each sibling ``.py`` file it imported from that folder (for the places of its keys)."""
    module_name = f"_colossal_lite_config_{uuid.uuid4().hex}"
    module = types.ModuleType(module_name)
    module.__file__ = str(path)
    modules_before = set(sys.modules)
    path_before = list(sys.path)
    sys.path.insert(0, str(path.parent))
    sys.modules[module_name] = module
    try:
        exec(compile(tree, str(path), "exec"), module.__dict__)
    except ConfigException:
        raise
    except Exception as e:  # the user's config raised: point at its line
        line = _line_in(e, path)
        where = f"{path}:{line}" if line else str(path)
        raise ConfigException(f"{where}: error while executing config: {type(e).__name__}: {e}{_fix_of(e)}") from e
    finally:
        sys.modules.pop(module_name, None)
        # forget the sibling modules and packages (and their submodules) imported from the config's folder
        new_names = set(sys.modules) - modules_before
        siblings = {}
        for name in [n for n in new_names if n.partition(".")[0] in new_names
                     and _found_in(sys.modules.get(n.partition(".")[0]), path.parent)]:
            sibling = sys.modules.pop(name, None)
            file = getattr(sibling, "__file__", None)
            if file and file.endswith(".py"):
                siblings[Path(file).resolve()] = dict(vars(sibling))
        sys.path[:] = path_before
    return module, siblings


def _fix_of(error: BaseException) -> str:
    """The fix of an error a config raised, where one is known: a legacy Colossal-AI config imports ``colossalai``,
    whose names (``AMP_TYPE``) colossal_lite keeps under its own package."""
    name = getattr(error, "name", None) if isinstance(error, ModuleNotFoundError) else None
    if name == "colossalai" or (name or "").startswith("colossalai."):
        return ". Fix: replace 'colossalai' with 'colossal_lite' in the config's imports"
    return ""


def _line_in(error: BaseException, path: Path) -> Optional[int]:
    """The last line of the file ``path`` in ``error``'s traceback (the config's line that raised), if any."""
    line = None
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == str(path):
            line = tb.tb_lineno
        tb = tb.tb_next
    return line
