"""Counts host-device synchronising calls (.item, .cpu, .tolist, tensor-to-bool) made from colossal_lite code."""
from __future__ import annotations

import contextlib
import os
import sys

import torch

import colossal_lite

PACKAGE_DIR = os.path.dirname(colossal_lite.__file__)
METHODS = ("item", "cpu", "tolist", "__bool__", "numpy")


@contextlib.contextmanager
def count_syncs():
    """Yields a dict {method: [caller 'file:line', ...]} for calls whose direct caller is inside colossal_lite."""
    calls = {m: [] for m in METHODS}
    originals = {m: getattr(torch.Tensor, m) for m in METHODS}

    def wrap(name, fn):
        def counted(self, *args, **kwargs):
            frame = sys._getframe(1)
            if frame.f_code.co_filename.startswith(PACKAGE_DIR):
                calls[name].append(f"{frame.f_code.co_filename}:{frame.f_lineno}")
            return fn(self, *args, **kwargs)
        return counted

    for m, fn in originals.items():
        setattr(torch.Tensor, m, wrap(m, fn))
    try:
        yield calls
    finally:
        for m, fn in originals.items():
            setattr(torch.Tensor, m, fn)
