"""Memory usage reports for logs; every figure is in MiB (reported as MB) or percent."""
from __future__ import annotations

from typing import Any

import torch

from ..logging import get_dist_logger

__all__ = ["report_memory_usage"]

_MB = 1024 * 1024


def _mb(num_bytes: float) -> str:
    return f"{num_bytes / _MB:.2f}"


def _gpu_report() -> str:
    allocated = torch.cuda.memory_allocated()
    max_allocated = torch.cuda.max_memory_allocated()
    cached = torch.cuda.memory_reserved()
    max_cached = torch.cuda.max_memory_reserved()
    if torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
    return (
        f"GPU: allocated {_mb(allocated)} MB, max allocated {_mb(max_allocated)} MB, "
        f"cached: {_mb(cached)} MB, max cached: {_mb(max_cached)} MB"
    )


def _cpu_report() -> str:
    import psutil  # imported here so that importing colossal_lite stays cheap

    info = psutil.Process().memory_info()
    used_percent = psutil.virtual_memory().percent
    return f"CPU: RSS {_mb(info.rss)} MB, VMS {_mb(info.vms)} MB, system used {used_percent:.1f}%"


def report_memory_usage(message: str, logger: Any = None, report_cpu: bool = False) -> str:
    """Log and return ``"{message}: GPU: ... ; CPU: ..."`` with sizes in MB (GPU peaks are reset afterwards).
    Without ``logger``, the library's logger writes it (on rank 0, as legacy Colossal-AI's did).

    The GPU part appears when CUDA is available; the CPU part when ``report_cpu`` is True or there is no CUDA.
    """
    parts = []
    has_cuda = torch.cuda.is_available()
    if has_cuda:
        parts.append(_gpu_report())
    if report_cpu or not has_cuda:
        parts.append(_cpu_report())
    msg = f"{message}: " + "; ".join(parts)
    (logger if logger is not None else get_dist_logger()).info(msg)  # (on rank 0 by default, as other output)
    return msg
