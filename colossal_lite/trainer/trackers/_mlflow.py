"""``MLflowTracker``: the run's records, config and final checkpoint in one MLflow run."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, Optional

from ...logging import get_dist_logger
from ._base import RunInfo, Tracker

__all__ = ["MLflowTracker"]

_PARAM_CHARS = 500  # the value length every MLflow store accepts
_BATCH = 100  # params per log_batch call (the store's limit); metrics are sent in batches of this size too


def _mlflow():
    try:
        import mlflow
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient
    except ImportError as err:
        raise ImportError("MLflowTracker needs the mlflow package, which is not installed: "
                          "pip install 'colossal_lite[mlflow]' (or pip install mlflow)") from err
    return mlflow, MlflowClient, Metric, Param


class MLflowTracker(Tracker):
    """One MLflow run per training run: the config as params, every record as a metric with its step, and the
    checkpoint written when ``fit`` ends as artifacts under ``checkpoints/<name>``.

    Args:
        experiment: the experiment's name (made when missing).
        tracking_uri: where the runs are kept (None: MLflow's default, e.g. ``MLFLOW_TRACKING_URI``); a server
            (``http://host:5000``), a database (``sqlite:///mlflow.db``, with the full ``mlflow`` package) or
            a folder (``file:///path/mlruns``; recent MLflow wants ``MLFLOW_ALLOW_FILE_STORE=true`` for it).
        run_name, tags: of a new run.
        log_checkpoint: upload the final checkpoint (a folder of the run's size).

    The run id is in every trainer checkpoint, so a resumed run writes to the same MLflow run (no new params);
    values of steps the interrupted run had already sent are not sent twice. The Trainer calls it on rank 0 only.
    The run ends ``FINISHED``, ``FAILED`` (an error in ``fit``) or ``KILLED`` (preempted; resumable).
    """

    def __init__(self, experiment: str = "colossal_lite", tracking_uri: Optional[str] = None,
                 run_name: Optional[str] = None, tags: Optional[Dict[str, Any]] = None, log_checkpoint: bool = True):
        _mlflow()  # fails where the tracker is made when mlflow is missing
        self.experiment = experiment
        self.tracking_uri = tracking_uri
        self.run_name = run_name
        self.tags = dict(tags or {})
        self.log_checkpoint_files = bool(log_checkpoint)
        self.run_id: Optional[str] = None
        self._client = None
        self._sent: Dict[str, Dict[int, float]] = {}  # per metric, what an earlier process sent, by step
        self._warned_resent = False

    def start(self, run: RunInfo) -> None:
        _, client_cls, _, param_cls = _mlflow()
        self._client = client = self._connect(client_cls)
        if self.run_id is not None:
            client.update_run(self.run_id, status="RUNNING")
            self._sent = self._values_sent()
            return
        found = client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found is not None else client.create_experiment(self.experiment)
        self.run_id = client.create_run(experiment_id, run_name=self.run_name, tags=self.tags).info.run_id
        params = [param_cls(key, str(value)[:_PARAM_CHARS]) for key, value in run.params.items()]
        for i in range(0, len(params), _BATCH):
            client.log_batch(self.run_id, params=params[i:i + _BATCH])

    def _connect(self, client_cls):
        """A client of the tracking store, or an error saying what to install or set when MLflow cannot use it
        (MLflow's default store is a SQLite file, which the client-only ``mlflow-skinny`` cannot open without
        SQLAlchemy and Alembic)."""
        from mlflow.exceptions import MlflowException

        try:
            client = client_cls(tracking_uri=self.tracking_uri)
            client.search_experiments(max_results=1)  # the first call opens the store
        except (MlflowException, ImportError) as err:
            uri = self.tracking_uri or "MLflow's default (MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)"
            raise RuntimeError(
                f"MLflowTracker cannot use the tracking store {uri}: {type(err).__name__}: {str(err)[:300]}. Fix: "
                f"install the full MLflow (pip install 'colossal_lite[mlflow]'; the client-only mlflow-skinny needs "
                f"pip install sqlalchemy alembic for a sqlite:/// store), or give MLflowTracker(tracking_uri=...) a "
                f"server ('http://host:5000') or a folder ('file:///path/mlruns', with the environment variable "
                f"MLFLOW_ALLOW_FILE_STORE=true)") from err
        return client

    def _values_sent(self) -> Dict[str, Dict[int, float]]:
        """The values the run already has, per metric and step (what an earlier process sent; the latest at a step)."""
        sent: Dict[str, Dict[int, float]] = {}
        for name in self._client.get_run(self.run_id).data.metrics:
            points = sorted(self._client.get_metric_history(self.run_id, name), key=lambda m: m.timestamp)
            sent[name] = {m.step: m.value for m in points}
        return sent

    def log_metrics(self, metrics: Dict[str, float], step: int, epoch: int, time: float) -> None:
        """Send the records of ``step``. A record an earlier process sent alike (a resume replays what followed its
        checkpoint) is not sent twice; one with another value (a resume from an earlier checkpoint, other data)
        is: MLflow cannot delete the earlier value, so the step shows both, the later being this run's."""
        _, _, metric_cls, _ = _mlflow()
        stamp = int(time * 1000)
        batch = []
        for name, value in metrics.items():
            earlier = self._sent.get(name, {}).get(step)
            if earlier is not None and (earlier == value or (math.isnan(earlier) and math.isnan(value))):
                continue  # (a figure the run had not got is NaN both times: the same record)
            if earlier is not None and not self._warned_resent:
                self._warned_resent = True
                get_dist_logger().warning(
                    f"MLflowTracker: run {self.run_id} already holds other values from step {step} on (this run "
                    f"resumed from an earlier checkpoint, or trains other data); MLflow cannot delete them, so those "
                    f"steps show both values, the later one this run's", ranks=[0])
            batch.append(metric_cls(name, value, stamp, step))
        for i in range(0, len(batch), _BATCH):
            self._client.log_batch(self.run_id, metrics=batch[i:i + _BATCH])

    def log_checkpoint(self, path: Path) -> None:
        if not self.log_checkpoint_files:
            return
        path = Path(path)
        if path.is_dir():
            self._client.log_artifacts(self.run_id, str(path), artifact_path=f"checkpoints/{path.name}")
        else:
            self._client.log_artifact(self.run_id, str(path), artifact_path="checkpoints")

    def finish(self, status: str = "FINISHED") -> None:
        if self._client is not None and self.run_id is not None:
            self._client.set_terminated(self.run_id, status=status)

    def state_dict(self) -> Dict[str, Any]:
        return {} if self.run_id is None else {"run_id": self.run_id}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.run_id = state.get("run_id", self.run_id)

    def __repr__(self) -> str:
        return f"MLflowTracker(experiment={self.experiment!r}, tracking_uri={self.tracking_uri!r})"
