"""Experiment tracking behind a tiny interface, so training code never imports MLflow itself.

MLflow with a SQLite store is the default; `NullTracker` is for runs that should log nowhere.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Protocol


class Tracker(Protocol):
    run_id: str | None

    def start(self, run_name: str, params: dict, run_id: str | None = None) -> None: ...
    def log_metrics(self, metrics: dict, step: int) -> None: ...
    def log_artifact(self, path: Path) -> None: ...
    def end(self, status: str = "FINISHED") -> None: ...


class NullTracker:
    run_id = None

    def start(self, run_name, params, run_id=None): pass
    def log_metrics(self, metrics, step): pass
    def log_artifact(self, path): pass
    def end(self, status="FINISHED"): pass


def default_tracking_uri(run_dir: Path) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(Path(run_dir) / 'mlflow.db').resolve()}"


class MlflowTracker:
    def __init__(self, uri: str, experiment: str = "ffr-edge"):
        os.environ.setdefault("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")
        logging.getLogger("alembic").setLevel(logging.WARNING)
        import mlflow

        self._mlflow = mlflow
        users_uri = os.environ.get("MLFLOW_TRACKING_URI")
        mlflow.set_tracking_uri(uri)
        # MLflow also writes the URI into the environment; undo that so the next run's default is its own folder
        if users_uri is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = users_uri
        mlflow.set_experiment(experiment)
        self.uri, self.run_id = uri, None

    def start(self, run_name: str, params: dict, run_id: str | None = None) -> None:
        run = self._mlflow.start_run(run_id=run_id, run_name=None if run_id else run_name)
        self.run_id = run.info.run_id
        if run_id is None:
            self._mlflow.log_params({k: str(v)[:500] for k, v in params.items()})

    def log_metrics(self, metrics: dict, step: int) -> None:
        numeric = {_metric_name(k): float(v) for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v}
        self._mlflow.log_metrics(numeric, step=step)

    def log_artifact(self, path: Path) -> None:
        self._mlflow.log_artifact(str(path))

    def end(self, status: str = "FINISHED") -> None:
        self._mlflow.end_run(status=status)


def _metric_name(key: str) -> str:
    r"""MLflow allows only [A-Za-z0-9_.\- :/] in names: 'tar@1e-2' -> 'tar_at_1e-2', 'local+dfc' -> 'local_dfc'."""
    return key.replace("@", "_at_").replace("+", "_")
