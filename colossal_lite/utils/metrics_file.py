"""Read the metrics file a run writes: ``metrics.jsonl`` (one JSON object a line) or ``metrics.csv``.

Each record is ``{"step": int, "epoch": int or None, "name": str, "value": float, "time": float or None}``
(``time`` in seconds since the epoch). Plain Python, so reading a run needs nothing beyond the library.
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

__all__ = ["MetricsFileError", "find_metrics_file", "read_metrics", "by_name", "METRICS_FILE_NAMES"]

METRICS_FILE_NAMES = ("metrics.jsonl", "metrics.csv")
CSV_COLUMNS = ("step", "epoch", "name", "value", "time")
Record = Dict[str, Any]


class MetricsFileError(ValueError):
    """A metrics file that is missing, empty or malformed; the message names the file (and line) and the fix."""


def find_metrics_file(path: Union[str, Path]) -> Path:
    """The metrics file ``path`` names: the file itself (.jsonl or .csv), or a run folder's ``metrics.jsonl``,
    else its ``metrics.csv``."""
    path = Path(path)
    if path.is_dir():
        for name in METRICS_FILE_NAMES:
            if (path / name).is_file():
                return path / name
        raise MetricsFileError(f"no metrics.jsonl or metrics.csv in {path}: give the run folder the Trainer wrote "
                               "them to (a checkpoint folder or log_dir), or the path of a .jsonl or .csv file")
    if not path.exists():
        raise MetricsFileError(f"no such file or folder: {path}")
    if path.suffix not in (".jsonl", ".csv"):
        raise MetricsFileError(f"{path}: expected a metrics .jsonl or .csv file (or a run folder holding one)")
    return path


def read_metrics(path: Union[str, Path]) -> List[Record]:
    """The records of a metrics file, in file order; ``path`` is a run folder or a .jsonl / .csv file."""
    file = find_metrics_file(path)
    try:
        with open(file, encoding="utf-8", newline="") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise MetricsFileError(f"{file} is not a metrics file: it is not UTF-8 text (byte {e.start} cannot be "
                               f"decoded)") from None
    records = _read_csv(file, text) if file.suffix == ".csv" else _read_jsonl(file, text)
    if not records:
        raise MetricsFileError(f"{file} holds no metrics records yet: the run writes one per metric at each "
                               "optimizer step; plot it once a step has been logged")
    return records


def _read_jsonl(file: Path, text: str) -> List[Record]:
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        last_unfinished = number == len(lines) and not text.endswith("\n")
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            if last_unfinished:
                # A run still writing (or killed mid-write) leaves a last line without its newline: the records
                # before it are whole and worth plotting.
                break
            raise MetricsFileError(f"{file}:{number}: not a JSON object ({e.msg}): {_clip(line)}") from None
        if not isinstance(obj, dict):
            raise MetricsFileError(f"{file}:{number}: expected a JSON object like {{\"step\": 12, \"name\": "
                                   f"\"train/Loss_step\", \"value\": 0.5}}, got {_clip(line)}")
        records.append(_record(file, number, obj))
    return records


def _read_csv(file: Path, text: str) -> List[Record]:
    if not text.endswith("\n") and "\n" in text:
        # A run still writing (or killed mid-write) leaves a last line without its newline: the rows before it are
        # whole and worth plotting, as in a .jsonl file.
        text = text[:text.rindex("\n") + 1]
    reader = csv.reader(text.splitlines())
    header = next(reader, None)
    if header is None:
        return []
    header = [h.strip() for h in header]
    missing = [c for c in ("step", "name", "value") if c not in header]
    if missing:
        raise MetricsFileError(f"{file}:1: the header lacks column(s) {', '.join(missing)}: expected "
                               f"{','.join(CSV_COLUMNS)}, got {','.join(header)}")
    records = []
    for row in reader:
        if not any(cell.strip() for cell in row):
            continue
        if len(row) != len(header):
            raise MetricsFileError(f"{file}:{reader.line_num}: {len(row)} fields where the header has "
                                   f"{len(header)} ({','.join(header)}): {_clip(','.join(row))}")
        records.append(_record(file, reader.line_num, dict(zip(header, row)), from_text=True))
    return records


def _record(file: Path, number: int, obj: Dict[str, Any], from_text: bool = False) -> Record:
    where = f"{file}:{number}"
    for key in ("step", "name", "value"):
        if key not in obj:
            raise MetricsFileError(f"{where}: the record has no '{key}' (each needs step, name and value)")
    name = obj["name"]
    if not isinstance(name, str) or not name:
        raise MetricsFileError(f"{where}: 'name' should be a metric name such as 'train/Loss_step', got {name!r}")
    return {
        "step": _number(where, "step", obj["step"], int, from_text),
        "epoch": _optional(where, "epoch", obj.get("epoch"), int, from_text),
        "name": name,
        "value": _value(where, obj["value"], from_text),
        "time": _optional(where, "time", obj.get("time"), float, from_text),
    }


def _number(where: str, key: str, raw: Any, kind: type, from_text: bool) -> Any:
    if from_text and isinstance(raw, str):
        try:
            return kind(raw.strip())
        except ValueError:
            pass
    elif isinstance(raw, (int, float)) and not isinstance(raw, bool):
        if kind is float or float(raw).is_integer():
            return kind(raw)
    need = "a whole number" if kind is int else "a number"
    raise MetricsFileError(f"{where}: '{key}' should be {need}, got {raw!r}")


def _optional(where: str, key: str, raw: Any, kind: type, from_text: bool) -> Optional[Any]:
    if raw is None or (from_text and isinstance(raw, str) and not raw.strip()):
        return None
    return _number(where, key, raw, kind, from_text)


def _value(where: str, raw: Any, from_text: bool) -> float:
    """A metric's value as a float; a missing one (JSON null, an empty CSV cell) is NaN, a gap in its curve."""
    if raw is None or (from_text and isinstance(raw, str) and not raw.strip()):
        return math.nan
    return _number(where, "value", raw, float, from_text)


def _clip(text: str, width: int = 80) -> str:
    text = text.rstrip("\r\n")
    return text if len(text) <= width else text[: width - 3] + "..."


def by_name(records: Iterable[Record]) -> Dict[str, Tuple[List[int], List[float]]]:
    """Each metric's ``(steps, values)`` sorted by step, names in the order they first appear. A step recorded
    twice keeps its later record: a run resumed from a checkpoint logs again the steps after that checkpoint."""
    latest: Dict[str, Dict[int, float]] = {}
    for r in records:
        latest.setdefault(r["name"], {})[r["step"]] = r["value"]
    out = {}
    for name, values in latest.items():
        steps = sorted(values)
        out[name] = (steps, [values[s] for s in steps])
    return out
