"""Capture and restore every random number generator of this process as plain values.

Python's ``random``, NumPy's global generator (when NumPy is installed), torch's CPU generator
and, when CUDA is available, the generator of every CUDA device. Each rank has its own state,
so the result belongs in the per-rank part of a checkpoint.
"""
from __future__ import annotations

import random
import warnings
from typing import Any, Dict

import torch


def _numpy():
    try:
        import numpy as np
    except ImportError:  # NumPy is optional
        return None
    return np


def capture_rng_state() -> Dict[str, Any]:
    """The state of every generator of this process: only tensors, ints, floats, strings and lists."""
    version, internal, gauss_next = random.getstate()
    state: Dict[str, Any] = {"python": {"version": version, "state": list(internal), "gauss_next": gauss_next}}
    np = _numpy()
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = {"bit_generator": str(name), "keys": torch.from_numpy(keys.astype(np.int64)),
                          "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    state["torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
        # the generator this rank draws from: a resume where the ranks see their GPUs at other indices (another
        # CUDA_VISIBLE_DEVICES or number of processes per node) gives it back to the rank's own device
        state["cuda_current"] = torch.cuda.get_rng_state(torch.cuda.current_device()).cpu()
    return state


def restore_rng_state(state: Dict[str, Any]) -> None:
    """Put back what ``capture_rng_state`` returned; generators missing on either side are left alone (with a warning)."""
    if "python" in state:
        py = state["python"]
        random.setstate((int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss_next"]))
    if "numpy" in state:
        np = _numpy()
        if np is None:
            warnings.warn("the checkpoint holds a NumPy random state but NumPy is not installed; it was not restored",
                          stacklevel=2)
        else:
            s = state["numpy"]
            keys = s["keys"].numpy() if isinstance(s["keys"], torch.Tensor) else np.asarray(s["keys"])
            np.random.set_state((s["bit_generator"], keys.astype(np.uint32), int(s["pos"]), int(s["has_gauss"]),
                                 float(s["cached_gaussian"])))
    if "torch" in state:
        torch.set_rng_state(state["torch"].to(torch.uint8))
    if "cuda" in state:
        saved = state["cuda"]
        if not torch.cuda.is_available():
            warnings.warn(f"the checkpoint holds the random state of {len(saved)} CUDA device(s) but CUDA is not "
                          f"available here; it was not restored", stacklevel=2)
        else:
            n = torch.cuda.device_count()
            if len(saved) != n:
                warnings.warn(f"the checkpoint holds the random state of {len(saved)} CUDA device(s) and this process "
                              f"sees {n}; the first {min(n, len(saved))} were restored", stacklevel=2)
            for i, s in enumerate(saved[:n]):
                torch.cuda.set_rng_state(s.to(torch.uint8), device=i)
            if "cuda_current" in state:  # (a checkpoint from before it holds the devices by index only)
                torch.cuda.set_rng_state(state["cuda_current"].to(torch.uint8), device=torch.cuda.current_device())
