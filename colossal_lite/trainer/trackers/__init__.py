"""Trackers: where the run's metric values go (the metrics file, TensorBoard, MLflow, or your own).

``fit(..., trackers=[...])`` takes any number; a ``MetricsFile`` is added by default when the run has a folder.
See ``docs/metrics.md``.
"""
from ._base import RunInfo, Tracker
from ._file import CSV_NAME, JSONL_NAME, MetricsFile
from ._mlflow import MLflowTracker
from ._tensorboard import TensorBoardTracker

__all__ = ["Tracker", "RunInfo", "MetricsFile", "TensorBoardTracker", "MLflowTracker", "JSONL_NAME", "CSV_NAME"]
