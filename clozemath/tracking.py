"""MLflow tracking: one run per experiment (a child of its grid's run when there is one), the flattened config as
params, metrics per step, artifacts (adapter, resolved config).

Every function takes the tracking config or a run id explicitly (an `MlflowClient`, no global active run), so the
same calls work from the driver, from a Ray Train callback in another process, or from a Tune trial. Metric names
are stable: `train/loss`, `train/lr`, `train/tokens_per_s`, `train/pad_share` (see `TRAIN_METRICS`).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Mapping
from contextlib import closing
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, Run, RunStatus
from mlflow.exceptions import MlflowException
from pydantic import BaseModel

from clozemath.config import TrackingConfig, dump_yaml, flatten

TRAIN_METRICS = ("train/loss", "train/lr", "train/tokens_per_s", "train/pad_share")
PARENT_TAG = "mlflow.parentRunId"
_BATCH = 100  # MLflow's limit of params per log_batch call
_MAX_PARAM_LENGTH = 6000


def resolved_uri(uri: str) -> str:
    """A relative SQLite or file store made absolute (against the current folder), so that every process that
    logs to the run, whatever its working folder, reaches the same store."""
    for scheme in ("sqlite:///", "file://"):
        if uri.startswith(scheme):
            path = uri[len(scheme):]
            if not path.startswith("/"):
                return f"{scheme}{Path(path).resolve()}"
    if "://" not in uri:
        return Path(uri).resolve().as_uri()
    return uri


def artifact_location(tracking: TrackingConfig) -> str | None:
    """The configured artifact location, else `mlartifacts/` beside a local SQLite store (None: MLflow decides)."""
    if tracking.artifact_location is not None:
        location = tracking.artifact_location
        return location if "://" in location else Path(location).resolve().as_uri()
    uri = resolved_uri(tracking.uri)
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").as_uri()
    return None


def client(uri: str) -> MlflowClient:
    return MlflowClient(tracking_uri=resolved_uri(uri))


def experiment_id(tracking: TrackingConfig) -> str:
    """The experiment's id, creating it (with an explicit artifact location) when it does not exist yet."""
    mlflow = client(tracking.uri)
    found = mlflow.get_experiment_by_name(tracking.experiment)  # creates a SQLite store's tables
    write_ahead_log(tracking.uri)
    if found is not None:
        return found.experiment_id
    try:
        return mlflow.create_experiment(tracking.experiment, artifact_location=artifact_location(tracking))
    except MlflowException:  # created concurrently (grid trials start together)
        return mlflow.get_experiment_by_name(tracking.experiment).experiment_id


def write_ahead_log(uri: str) -> None:
    """Put a SQLite store in WAL mode (it stays so): a reader (a trial looking for its run, `mlflow ui`, the report)
    no longer blocks the trials that write, and writers queue (MLflow waits up to 20 s for the lock). Several
    machines need a tracking server: SQLite locks do not hold on network file systems."""
    path = resolved_uri(uri).removeprefix("sqlite:///")
    if path == resolved_uri(uri):
        return
    try:
        with closing(sqlite3.connect(path, timeout=20)) as database:
            database.execute("PRAGMA journal_mode=WAL")
    except sqlite3.OperationalError:  # busy beyond the timeout: the next run sets it
        pass


def start_run(
    tracking: TrackingConfig, name: str, parent_run_id: str | None = None, tags: Mapping[str, str] | None = None
) -> str:
    """Create a run (running) in the config's experiment; returns its id."""
    all_tags = dict(tags or {})
    if parent_run_id is not None:
        all_tags[PARENT_TAG] = parent_run_id
    run = client(tracking.uri).create_run(experiment_id(tracking), tags=all_tags, run_name=name)
    return run.info.run_id


def end_run(uri: str, run_id: str, succeeded: bool = True, status: str | None = None) -> None:
    """End a run FINISHED or FAILED (`succeeded`), or with the given `status` (KILLED: interrupted)."""
    client(uri).set_terminated(run_id, status=status or ("FINISHED" if succeeded else "FAILED"))


def log_params(uri: str, run_id: str, params: Mapping[str, Any]) -> None:
    items = [Param(key, str(value)[:_MAX_PARAM_LENGTH]) for key, value in params.items()]
    mlflow = client(uri)
    for start in range(0, len(items), _BATCH):
        mlflow.log_batch(run_id, params=items[start : start + _BATCH])


def log_config(uri: str, run_id: str, config: BaseModel) -> None:
    """The flattened config as params and the resolved config as `config.yaml`."""
    log_params(uri, run_id, flatten(config))
    with TemporaryDirectory() as folder:
        path = Path(folder) / "config.yaml"
        path.write_text(dump_yaml(config))
        client(uri).log_artifact(run_id, str(path))


def log_metrics(uri: str, run_id: str, step: int, metrics: Mapping[str, float]) -> None:
    now = int(time.time() * 1000)
    items = [Metric(key, float(value), now, step) for key, value in metrics.items()]
    client(uri).log_batch(run_id, metrics=items)


def last_step(uri: str, run_id: str, metric: str) -> int:
    """The last step at which the run logged `metric` (0 if never)."""
    return max((m.step for m in client(uri).get_metric_history(run_id, metric)), default=0)


def log_artifacts(uri: str, run_id: str, folder: str | Path, artifact_path: str | None = None) -> None:
    client(uri).log_artifacts(run_id, str(folder), artifact_path=artifact_path)


def find_runs(tracking: TrackingConfig, tags: Mapping[str, str]) -> list[Run]:
    """The runs of the config's experiment carrying all these tags, newest first (none if it does not exist)."""
    mlflow = client(tracking.uri)
    experiment = mlflow.get_experiment_by_name(tracking.experiment)
    if experiment is None:
        return []
    query = " and ".join(f"tags.`{key}` = '{value}'" for key, value in tags.items())
    newest_first = ["attributes.start_time DESC"]
    return list(mlflow.search_runs([experiment.experiment_id], filter_string=query, order_by=newest_first))


def reopen_run(uri: str, run_id: str) -> None:
    """Mark a run running again (a trial resumed after its driver died logs on into the run it had)."""
    client(uri).update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
