"""The ``colossal-lite`` command: ``info``, ``check CONFIG.py``, ``ckpt ...``, ``plot RUN``, ``report RUN``,
``--version``."""
from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys
import warnings
from typing import Any, Callable, List, Optional

import torch

from ._version import __version__
from .checkpoint import cli as ckpt_cli
from .context.batch_size import resolve_batch_sizes
from .context.config import ConfigException
from .context.features import describe_features
from .context.option_types import check_zero_world_size
from .context.validation import load_config
from .pipe_exit import BROKEN_PIPE_STATUS, quiet_on_broken_pipe
from .trainer.speed_report import figures_from_records, format_report
from .utils.metrics_file import MetricsFileError, find_metrics_file, read_metrics
from .utils.plot import PLOT_FORMATS, PlotError, plot_metrics

__all__ = ["main", "version_text", "quiet_on_broken_pipe", "BROKEN_PIPE_STATUS"]

def version_text() -> str:
    """``colossal_lite 0.1.0 (torch 2.6.0, Python 3.11.7)``."""
    return f"colossal_lite {__version__} (torch {torch.__version__}, Python {platform.python_version()})"


def _info() -> int:
    cuda = torch.cuda.is_available()
    lines = [
        f"colossal_lite: {__version__}",
        f"Python: {platform.python_version()} ({sys.executable})",
        f"torch: {torch.__version__}",
        f"CUDA available: {cuda} (torch built with CUDA {torch.version.cuda or 'none'})",
        f"NCCL available: {torch.distributed.is_available() and torch.distributed.is_nccl_available()}",
        f"gloo available: {torch.distributed.is_available() and torch.distributed.is_gloo_available()}",
        f"CPU count: {os.cpu_count()}",
        f"GPUs: {torch.cuda.device_count() if cuda else 0}",
    ]
    if cuda:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"  cuda:{i}: {p.name}, {p.total_memory / 2**30:.1f} GiB")
    for extra, module in (("tensorboard", "tensorboard"), ("mlflow", "mlflow"), ("plot", "matplotlib")):
        lines.append(f"{extra} extra: {_extra(extra, module)}")
    print("\n".join(lines))
    return 0


def _extra(extra: str, module: str) -> str:
    """Whether an extra's package can be found, without the slow import of it that `info` does not need."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    return "installed" if found else f"not installed (pip install 'colossal_lite[{extra}]')"


def _check(path: str, world_size: int = 1, overrides: Optional[List[str]] = None) -> int:
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            config = load_config(path, overrides)
            resolve_batch_sizes(config, world_size)
            check_zero_world_size(config, world_size)
    except (ConfigException, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    given = "".join(f" --set {o}" for o in overrides or ())
    print(f"{path}{given}: OK. This config switches on:")
    for line in describe_features(config, world_size):
        print(f"  - {line}")
    user = sorted(k for k in config if isinstance(k, str) and k.isupper())
    if user:
        print(f"  your own values: {', '.join(f'{k}={config[k]!r}' for k in user)}")
    return 0


def _size(text: str):
    try:
        width, height = (float(x) for x in text.lower().replace("x", ",").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTH,HEIGHT in inches such as 11,7; got {text!r}") from None
    if width <= 0 or height <= 0:
        raise argparse.ArgumentTypeError(f"a size is positive inches, got {text!r}")
    return width, height


def _argument(convert: Callable[[str], Any], fits: Callable[[Any], bool], expected: str, limits: str):
    """An argparse type: ``convert`` the text (else "expected ...") and check it ``fits`` (else ``limits``)."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}; got {text!r}") from None
        if not fits(value):
            raise argparse.ArgumentTypeError(f"{limits}, got {text!r}")
        return value
    return parse


_world_size = _argument(int, lambda n: n >= 1, "a number of processes such as 8", "a run has 1 process or more")
_dpi = _argument(float, lambda d: 0 < d <= 2000, "pixels per inch such as 100",
                 "pixels per inch are above 0 and at most 2000")
_rows = _argument(int, lambda n: n >= 1, "a whole number of causes to list, such as 6",
                  "the report lists 1 cause or more")


def _add_plot_parser(sub) -> None:
    p = sub.add_parser("plot", help="draw a run's loss, accuracy, LR and other metrics against steps",
                       description="Draw a run's metrics against optimizer steps, one panel per metric, train and "
                                   "test on the same axes. Needs matplotlib: pip install 'colossal_lite[plot]'.")
    p.add_argument("path", help="a run folder holding metrics.jsonl or metrics.csv, or such a file")
    p.add_argument("-o", "--output", required=True,
                   help=f"the picture to write; its suffix picks the format ({', '.join(PLOT_FORMATS)})")
    p.add_argument("--metrics", help="the metrics to draw, in this order, e.g. Loss,Accuracy (default: all)")
    p.add_argument("--log-y", help="metrics to draw on a log scale, e.g. Loss")
    p.add_argument("--title", help="the figure's title (default: the path read)")
    p.add_argument("--size", type=_size, help="WIDTH,HEIGHT of the figure in inches (default: by the panels)")
    p.add_argument("--dpi", type=_dpi, default=100, help="pixels per inch of a .png (default 100)")


def _plot(args) -> int:
    try:
        fig = plot_metrics(args.path, args.output, metrics=args.metrics, title=args.title, log_y=args.log_y,
                           size=args.size, dpi=args.dpi)
    # (OSError: the picture cannot be written; ValueError: matplotlib refuses a picture of that many pixels)
    except (MetricsFileError, PlotError, ImportError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    panels = ", ".join(f"{ax.get_title()} ({len(ax.get_lines())})" for ax in fig.axes)
    print(f"wrote {args.output}: {panels}")
    return 0


def _add_report_parser(sub) -> None:
    p = sub.add_parser("report", help="where a run's time went, ranked, with what to change",
                       description="Read a run's metrics file and print the speed report of a fit that ran with "
                                   "SpeedReportHook: throughput, MFU, and the time of each phase ranked, each with "
                                   "one suggestion.")
    p.add_argument("path", help="a run folder holding metrics.jsonl or metrics.csv, or such a file")
    p.add_argument("--rows", type=_rows, default=6, help="how many causes to list (default 6)")


def _report(args) -> int:
    try:
        figures = figures_from_records(read_metrics(find_metrics_file(args.path)))
    except (MetricsFileError, ValueError) as e:
        print(f"error: {args.path}: {e}", file=sys.stderr)
        return 1
    print(format_report(figures, rows=args.rows))
    return 0


@quiet_on_broken_pipe
def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="colossal-lite", description="colossal_lite command-line tools")
    parser.add_argument("--version", action="version", version=version_text(),
                        help="print the colossal_lite, torch and Python versions and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions of Python, torch, CUDA/NCCL, CPUs, GPUs and extras")
    p = sub.add_parser("check", help="validate a config file and explain the features it switches on")
    p.add_argument("config", help="path to a config .py file")
    p.add_argument("--world-size", type=_world_size, default=1,
                   help="data-parallel size to check the batch-size arithmetic against (default 1)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value first, as a training script's --set does (repeatable)")
    ckpt_cli.register(sub)
    _add_plot_parser(sub)
    _add_report_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "info":
        return _info()
    if args.command == "check":
        return _check(args.config, args.world_size, args.set)
    if args.command == "ckpt":
        return ckpt_cli.run(args)
    if args.command == "plot":
        return _plot(args)
    if args.command == "report":
        return _report(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
