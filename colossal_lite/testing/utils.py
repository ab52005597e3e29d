"""Decorators and helpers of the legacy ``colossalai.testing.utils``, re-exported by ``colossal_lite.testing``."""
from __future__ import annotations

import gc
import inspect
import re
import sys
from typing import Any, Callable, List, Optional, Tuple, Type, Union

import torch
import torch.multiprocessing as mp

from ..utils.common import free_port
from .comparison import assert_close, assert_close_loose, assert_equal, assert_equal_in_group, assert_not_equal
from .spawn import spawn

ADDRESS_IN_USE = r"(?i)address already in use|EADDRINUSE"


def _copy_identity(wrapper: Callable, func: Callable, signature: inspect.Signature) -> Callable:
    """Name, doc and signature of ``func`` on ``wrapper``, without ``__wrapped__``: pytest then asks for the
    parameters of ``signature`` as fixtures, not for the ones a decorator fills in."""
    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        if hasattr(func, attr):
            setattr(wrapper, attr, getattr(func, attr))
    wrapper.__signature__ = signature
    wrapper.__dict__.update({k: v for k, v in getattr(func, "__dict__", {}).items() if k != "__signature__"})
    return wrapper


def parameterize(argument: str, values: List[Any]) -> Callable:
    """Run the decorated function once for each of ``values`` as its ``argument``, in order.

    Stacked decorators give every combination (the outer one varies slowest). The other arguments are passed
    by keyword at the call. Unlike ``pytest.mark.parametrize`` all runs happen in one call, so a distributed
    test starts its processes and process group once for all of them. A failing run names its value.
    """
    values = list(values)

    def decorator(func: Callable) -> Callable:
        signature = inspect.signature(func)
        if argument not in signature.parameters and not any(
                p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
            raise TypeError(f"@parameterize({argument!r}, ...): {func.__qualname__} has no parameter {argument!r}")

        def run_each(*args, **kwargs):
            if argument in kwargs:
                raise TypeError(f"{func.__qualname__}(): {argument!r} is given by @parameterize, not by the call")
            for value in values:
                try:
                    func(*args, **{argument: value}, **kwargs)
                except Exception as e:
                    if hasattr(e, "add_note"):
                        e.add_note(f"@parameterize: {func.__qualname__} failed with {argument}={value!r}")
                    raise

        remaining = [p for name, p in signature.parameters.items() if name != argument]
        return _copy_identity(run_each, func, signature.replace(parameters=remaining))

    return decorator


def rerun_on_exception(exception_type: Union[Type[BaseException], Tuple[Type[BaseException], ...]] = Exception,
                       pattern: Optional[str] = None, max_try: Optional[int] = 5) -> Callable:
    """Call the decorated function again when it raises ``exception_type`` whose message matches ``pattern``.

    ``pattern`` is a regular expression searched in the message (None: any message); ``max_try`` bounds
    the calls (None: no bound). When the last try fails too, its exception is raised (legacy then returned
    None, which passed a test that never succeeded).
    """
    if max_try is not None and (not isinstance(max_try, int) or max_try < 1):
        raise TypeError(f"rerun_on_exception(max_try=...) must be None or a positive int, got {max_try!r}")

    def decorator(func: Callable) -> Callable:
        def run_until_success(*args, **kwargs):
            tries = 0
            while True:
                tries += 1
                try:
                    return func(*args, **kwargs)
                except exception_type as e:
                    if pattern is not None and not re.search(pattern, str(e), flags=re.DOTALL):
                        raise
                    if max_try is not None and tries >= max_try:
                        raise
                    print(f"rerun_on_exception: {func.__qualname__} raised {type(e).__name__} (try {tries}"
                          f"{'' if max_try is None else f' of {max_try}'}); running it again", file=sys.stderr)

        return _copy_identity(run_until_success, func, inspect.signature(func))

    return decorator


def rerun_if_address_is_in_use(max_try: Optional[int] = 5) -> Callable:
    """Rerun a test whose processes could not start because the port they were given was taken meanwhile."""
    return rerun_on_exception(exception_type=(mp.ProcessRaisedException, RuntimeError), pattern=ADDRESS_IN_USE,
                              max_try=max_try)


def clear_cache_before_run() -> Callable:
    """Collect garbage (and empty the CUDA cache) before each call, so a test starts from free memory."""

    def decorator(func: Callable) -> Callable:
        def run(*args, **kwargs):
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return func(*args, **kwargs)

        return _copy_identity(run, func, inspect.signature(func))

    return decorator


__all__ = [
    "parameterize", "rerun_on_exception", "rerun_if_address_is_in_use", "clear_cache_before_run", "spawn", "free_port",
    "assert_close", "assert_close_loose", "assert_equal", "assert_not_equal", "assert_equal_in_group",
]
