"""Draw a run's metrics against optimizer steps: one panel per metric (Loss, Accuracy, LR, ...), its train and
test values on the same axes.

matplotlib (``pip install 'colossal_lite[plot]'``) is imported only when a plot is drawn, and only its
object API: no pyplot, so no display is needed and a notebook's or script's own backend is left alone.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from .metrics_file import Record, by_name, find_metrics_file, read_metrics

__all__ = ["plot_metrics", "metric_group", "group_names", "PlotError", "PLOT_FORMATS", "PLOT_EXTRA"]

PLOT_EXTRA = "pip install 'colossal_lite[plot]'"
PLOT_FORMATS = (".png", ".svg", ".pdf")
# Train values in the first colour of matplotlib's cycle, test in the second, in every panel; other phases
# (a user's 'val/...') and unprefixed names take the next colours in the order they first appear.
_PHASE_COLOURS = {"train": "C0", "test": "C1"}
_MAX_MARKERS = 100  # more markers than this merge into a thick band
_PANEL_SIZE = (5.5, 3.4)  # inches of one panel, before the figure's size is set by the panels' grid


class PlotError(ValueError):
    """A plot that cannot be drawn as asked (an unknown metric, an unsupported output format)."""


def metric_group(name: str) -> str:
    """The panel a metric name belongs to: 'train/Loss_step', 'train/Loss' and 'test/Loss' -> 'Loss';
    'lr' -> 'LR'; a name without a 'phase/' prefix is its own group."""
    base = name.split("/", 1)[1] if "/" in name else name
    if base.endswith("_step") and len(base) > len("_step"):
        base = base[: -len("_step")]
    return "LR" if base.lower() == "lr" else base


def _order_in_group(name: str) -> Tuple[int, int]:
    """Train before the other phases, and a train metric's per-step line before its epoch values."""
    return (0 if name.startswith("train/") else 1, 0 if name.endswith("_step") else 1)


def group_names(names: Iterable[str]) -> Dict[str, List[str]]:
    """Metric names grouped by panel: groups in the order they first appear, LR last; in a group, train
    per-step, train epoch, then the other phases in the order they first appear."""
    groups: Dict[str, List[str]] = {}
    for name in names:
        groups.setdefault(metric_group(name), []).append(name)
    ordered = {g: sorted(n, key=_order_in_group) for g, n in groups.items() if g != "LR"}
    if "LR" in groups:
        ordered["LR"] = sorted(groups["LR"], key=_order_in_group)
    return ordered


def _select(groups: Dict[str, List[str]], wanted: Optional[Sequence[str]], where: str) -> List[str]:
    """The groups named in ``wanted`` (case-insensitive, in the order given); all of them when None."""
    if wanted is None:
        return list(groups)
    lower = {g.lower(): g for g in groups}
    unknown = [w for w in wanted if w.lower() not in lower]
    if unknown:
        raise PlotError(f"no metric {', '.join(map(repr, unknown))} in {where}; the metrics there are "
                        f"{', '.join(groups)}")
    return [lower[w.lower()] for w in wanted]


def _names(value: Union[None, str, Iterable[str]]) -> Optional[List[str]]:
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    return [s.strip() for s in items if s.strip()]


def _style(name: str, points: int, colours: Dict[str, str]) -> Dict[str, Any]:
    """A per-step series ('..._step', 'lr') is a plain line, faint beside the epoch values it fluctuates
    around; epoch and evaluation values are a bolder line with a marker at each value while few enough to tell
    apart."""
    phase = name.split("/", 1)[0] if "/" in name else ""
    if phase not in colours:
        others = sum(p not in _PHASE_COLOURS for p in colours)
        colours[phase] = _PHASE_COLOURS.get(phase) or f"C{2 + others}"
    style: Dict[str, Any] = dict(color=colours[phase])
    if name.endswith("_step") and points > 1:
        return dict(style, linewidth=0.8, alpha=0.6)
    if name == "lr" and points > 1:
        return dict(style, linewidth=1.2)
    if points <= _MAX_MARKERS:
        style.update(marker="o" if phase == "train" else "s", markersize=4)
    return dict(style, linewidth=1.5)


def _check_output(output: Union[str, Path]) -> Path:
    output = Path(output)
    if output.suffix.lower() not in PLOT_FORMATS:
        raise PlotError(f"{output}: the file's suffix picks the format; use one of {', '.join(PLOT_FORMATS)}")
    if not output.parent.is_dir():
        raise PlotError(f"{output}: the folder {output.parent} does not exist; create it first")
    return output


def _figure_class():
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(f"plotting metrics needs matplotlib ({e}): {PLOT_EXTRA}") from e
    return Figure


def _draw_panel(ax, group: str, names: List[str], series, log_y: bool, colours: Dict[str, str]) -> None:
    for name in names:
        steps, values = series[name]
        finite = [v if math.isfinite(v) else math.nan for v in values]  # a gap where a value was inf or NaN
        ax.plot(steps, finite, label=name, **_style(name, len(steps), colours))
    ax.set_title(group)
    ax.set_xlabel("step")
    if log_y:
        ax.set_yscale("log", nonpositive="mask")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")


def plot_metrics(source: Union[str, Path, Iterable[Record]], output: Union[str, Path, None] = None, *,
                 metrics: Union[None, str, Iterable[str]] = None, title: Optional[str] = None,
                 log_y: Union[None, str, Iterable[str]] = None, size: Optional[Tuple[float, float]] = None,
                 dpi: float = 100):
    """Draw ``source``'s metrics (a run folder, a metrics .jsonl/.csv file, or an iterable of records as
    ``read_metrics`` gives them), one panel per metric group, x = optimizer step; save to ``output`` (.png, .svg or .pdf) when given
    and return the matplotlib ``Figure``. ``metrics``: the groups to draw ('Loss,Accuracy'), in that order;
    ``log_y``: groups drawn on a log scale; ``size``: (width, height) in inches; ``dpi``: pixels per inch."""
    out = _check_output(output) if output is not None else None
    from_file = isinstance(source, (str, Path))
    where = find_metrics_file(source) if from_file else "the records given"
    records = read_metrics(where) if from_file else list(source)
    series = by_name(records)
    if not series:
        raise PlotError(f"no records in {where}: nothing to plot")
    groups = group_names(series)
    chosen = _select(groups, _names(metrics), str(where))
    logged = {g.lower() for g in _select(groups, _names(log_y), str(where))} if log_y else set()
    Figure = _figure_class()
    cols = 1 if len(chosen) == 1 else 2
    rows = math.ceil(len(chosen) / cols)
    fig = Figure(figsize=size or (_PANEL_SIZE[0] * cols, _PANEL_SIZE[1] * rows), dpi=dpi, layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    colours: Dict[str, str] = {}
    for ax, group in zip(axes, chosen):
        _draw_panel(ax, group, groups[group], series, group.lower() in logged, colours)
    for ax in axes[len(chosen):]:
        fig.delaxes(ax)
    if title is None and from_file:
        title = str(source)
    if title:
        fig.suptitle(title)
    if out is not None:
        fig.savefig(out, dpi=dpi)
    return fig
