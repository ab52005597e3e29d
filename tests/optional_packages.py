"""Optional packages that some tests need: such a test skips, with the reason, when its package cannot be imported.

A torchvision built for another torch (a CPU torch beside a CUDA torchvision, when the CPU index cannot be reached)
raises a RuntimeError on import, not an ImportError, so ``pytest.importorskip`` would let it through; and a module
that imports it at its top stops the whole run at collection.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch


def require_torchvision(why: str, module_level: bool = False):
    """``torchvision``, or a skip that says ``why`` it is needed and why it cannot be imported."""
    try:
        import torchvision
    except Exception as error:  # ImportError when missing; RuntimeError (and others) when built for another torch
        pytest.skip(f"{why}, but torchvision cannot be imported with torch {torch.__version__} "
                    f"({type(error).__name__}: {error}); install the torchvision built for this torch (README, "
                    f"'Install')", allow_module_level=module_level)
    return torchvision


def require_transformers(why: str, module_level: bool = False) -> None:
    """A skip that says ``why`` transformers is needed when it is not installed (it comes with
    ``pip install -e ".[hf]"`` and in the dev extra). Found without importing it, so collecting a test file that
    needs it costs nothing in a run that deselects its tests."""
    if importlib.util.find_spec("transformers") is None:
        pytest.skip(f"{why}, but transformers is not installed; install it with pip install -e \".[hf]\"",
                    allow_module_level=module_level)
