"""``Registry``: a name -> class table that a config's ``type='Name'`` is looked up in."""
from __future__ import annotations

import difflib
import importlib
from types import ModuleType
from typing import Callable, Dict, List, Optional, Sequence, Union


class RegistryError(NameError):
    """A name that is neither registered nor found in the registry's libraries (a ``NameError``, as legacy raised)."""


class Registry:
    """Classes (or functions) by name, filled with ``@REGISTRY.register_module``.

    ``third_party_library``: modules (or their dotted names, imported on first use) whose attributes are
    found too, after the registered names, as legacy did for ``torch.nn``, ``torch.optim`` and torchvision.
    """

    def __init__(self, name: str, third_party_library: Optional[Sequence[Union[ModuleType, str]]] = None):
        self._name = name
        self._registry: Dict[str, object] = {}
        self._third_party_lib = list(third_party_library or [])
        self.variable = name.upper()  # the name users import it by, for messages

    @property
    def name(self) -> str:
        return self._name

    def __repr__(self):
        return f"Registry({self._name!r}, registered={sorted(self._registry)})"

    def __contains__(self, module_name: str) -> bool:
        return self.has(module_name)

    def __len__(self) -> int:
        return len(self._registry)

    def names(self) -> List[str]:
        """The registered names (not the libraries'), sorted."""
        return sorted(self._registry)

    def register_module(self, module_class=None, *, name: Optional[str] = None, force: bool = False):
        """Register ``module_class`` under ``name`` (default: its ``__name__``) and return it unchanged.

        Works as ``@REG.register_module``, ``@REG.register_module()``, ``@REG.register_module(name='x')`` and as
        a plain call ``REG.register_module(cls)``. Another object under a taken name is refused (legacy asserted
        so), unless ``force``; the same class defined again by the same module (a re-import or reload) replaces
        the old one, so re-running a script or notebook cell works.
        """
        if module_class is None:
            return lambda cls: self.register_module(cls, name=name, force=force)
        key = name or getattr(module_class, "__name__", None)
        if not isinstance(key, str) or not key:
            raise TypeError(f"registry '{self._name}': cannot register {module_class!r}: it has no __name__; "
                            f"pass register_module(obj, name='...')")
        old = self._registry.get(key)
        if old is not None and old is not module_class and not force and not _same_definition(old, module_class):
            raise KeyError(f"registry '{self._name}': the name {key!r} is already taken by {_where(old)}; "
                           f"rename {_where(module_class)}, or pass register_module(..., force=True) to replace it")
        self._registry[key] = module_class
        return module_class

    def get_module(self, module_name: str):
        """The object registered (or found in a library) under ``module_name``; ``RegistryError`` if none."""
        if module_name in self._registry:
            return self._registry[module_name]
        for lib in self._libraries():
            if hasattr(lib, module_name):
                return getattr(lib, module_name)
        raise RegistryError(self.missing_message(module_name))

    def has(self, module_name: str) -> bool:
        """True if ``module_name`` is registered or found in one of the registry's libraries."""
        if module_name in self._registry:
            return True
        return any(hasattr(lib, module_name) for lib in self._libraries())

    def missing_message(self, module_name) -> str:
        """What to say when ``module_name`` is not found: the registry, its names and the nearest one."""
        names = self.names()
        listed = ", ".join(names) if names else "none"
        libs = [lib if isinstance(lib, str) else lib.__name__ for lib in self._third_party_lib]
        also = f" and is not an attribute of {', '.join(libs)}" if libs else ""
        near = difflib.get_close_matches(str(module_name), names, n=1, cutoff=0.6)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        return (f"{module_name!r} is not registered in the registry '{self._name}'{also} (registered: {listed}){hint}. "
                f"Register it with @{self.variable}.register_module (from colossal_lite.registry) before it is looked up")

    def _libraries(self) -> List[ModuleType]:
        libs = []
        for i, lib in enumerate(self._third_party_lib):
            if isinstance(lib, str):
                try:
                    lib = importlib.import_module(lib)
                except ImportError:  # an optional library (torchvision) that is not installed has no names
                    continue
                self._third_party_lib[i] = lib
            libs.append(lib)
        return libs

    def build(self, config: dict, **extra) -> object:
        """``get_module(config['type'])(**rest, **extra)``: the legacy builders' way of making an object."""
        options = dict(config)
        if "type" not in options:
            raise KeyError(f"registry '{self._name}': a config to build from needs a 'type', got {config!r}")
        cls: Callable = self.get_module(options.pop("type"))
        return cls(**options, **extra)


def _same_definition(old, new) -> bool:
    return (getattr(old, "__module__", None), getattr(old, "__qualname__", None)) == \
           (getattr(new, "__module__", None), getattr(new, "__qualname__", None))


def _where(obj) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"
