"""Tensor comparisons of the legacy ``colossalai.testing``: each fails with both values and the largest gap."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def _gap(a: Tensor, b: Tensor) -> str:
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or a.shape != b.shape or a.numel() == 0:
        return ""
    diff = (a.detach().double() - b.detach().double()).abs()
    return f" (largest absolute difference {diff.max().item():.4g})"


def _check_shapes(a, b):
    if isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape != b.shape:
        raise AssertionError(f"expected tensors of the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")


def assert_equal(a: Tensor, b: Tensor):
    """Every element of ``a`` equals the one of ``b``."""
    _check_shapes(a, b)
    assert torch.all(a == b), f"expected a and b to be equal but they are not{_gap(a, b)}: {a} vs {b}"


def assert_not_equal(a: Tensor, b: Tensor):
    """Some element of ``a`` differs from the one of ``b``."""
    assert not torch.all(a == b), f"expected a and b to differ but they are equal: {a} vs {b}"


def assert_close(a: Tensor, b: Tensor, rtol: float = 1e-5, atol: float = 1e-8):
    """``|a - b| <= atol + rtol * |b|`` element-wise (``torch.allclose``, legacy defaults)."""
    _check_shapes(a, b)
    assert torch.allclose(a, b, rtol=rtol, atol=atol), \
        f"expected a and b to be close (rtol={rtol:g}, atol={atol:g}) but they are not{_gap(a, b)}: {a} vs {b}"


def assert_close_loose(a: Tensor, b: Tensor, rtol: float = 1e-3, atol: float = 1e-3):
    """``assert_close`` with the tolerances legacy used for reduced precision."""
    assert_close(a, b, rtol, atol)


def assert_equal_in_group(tensor: Tensor, process_group=None):
    """Every rank of ``process_group`` holds the same ``tensor`` (a collective: every rank calls it)."""
    world = dist.get_world_size(process_group)
    gathered = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(gathered, tensor.contiguous(), group=process_group)
    for i in range(world - 1):
        a, b = gathered[i], gathered[i + 1]
        assert torch.all(a == b), f"expected the tensors of ranks {i} and {i + 1} to be equal but they are not: {a} vs {b}"
