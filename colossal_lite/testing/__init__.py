"""Helpers for tests written like legacy Colossal-AI's (``colossalai.testing``): ``parameterize``, reruns,
``spawn`` for N-process tests, and tensor comparisons."""
from .comparison import assert_close, assert_close_loose, assert_equal, assert_equal_in_group, assert_not_equal
from .spawn import spawn
from .utils import clear_cache_before_run, free_port, parameterize, rerun_if_address_is_in_use, rerun_on_exception

__all__ = [
    "parameterize", "rerun_on_exception", "rerun_if_address_is_in_use", "clear_cache_before_run", "spawn", "free_port",
    "assert_close", "assert_close_loose", "assert_equal", "assert_not_equal", "assert_equal_in_group",
]
