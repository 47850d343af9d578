"""Stand-ins for `clozemath.tracking` and `ray_jobs.cluster` (branch `train`) until they land on main: the few
functions the evaluation job calls, with the same names and signatures. Delete this file when they land and import
from there instead.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from tempfile import TemporaryDirectory

import ray
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunStatus
from mlflow.exceptions import MlflowException
from pydantic import BaseModel

from clozemath.config import TrackingConfig, dump_yaml, flatten

CARRIED_ENV_VARS = ("CLOZEMATH_DATA_DIR", "HF_HUB_OFFLINE", "HF_HOME", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
MIN_LOCAL_CPUS = 8
_BATCH = 100  # MLflow's limit of params per log_batch call


def init_ray() -> None:
    """Nothing when Ray is already up (a test session, a Tune trial); else join RAY_ADDRESS or start locally."""
    if ray.is_initialized():
        return
    env = {"env_vars": {name: os.environ[name] for name in CARRIED_ENV_VARS if name in os.environ}}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(runtime_env=env)
    else:
        ray.init(num_cpus=max(MIN_LOCAL_CPUS, os.cpu_count() or 1), runtime_env=env)


def resolved_uri(uri: str) -> str:
    for scheme in ("sqlite:///", "file://"):
        if uri.startswith(scheme) and not uri[len(scheme) :].startswith("/"):
            return f"{scheme}{Path(uri[len(scheme) :]).resolve()}"
    return uri


def client(uri: str) -> MlflowClient:
    return MlflowClient(tracking_uri=resolved_uri(uri))


def _experiment_id(tracking: TrackingConfig) -> str:
    mlflow = client(tracking.uri)
    found = mlflow.get_experiment_by_name(tracking.experiment)
    if found is not None:
        return found.experiment_id
    location = tracking.artifact_location
    uri = resolved_uri(tracking.uri)
    if location is None and uri.startswith("sqlite:///"):
        location = (Path(uri[len("sqlite:///") :]).parent / "mlartifacts").as_uri()
    elif location is not None and "://" not in location:
        location = Path(location).resolve().as_uri()
    try:
        return mlflow.create_experiment(tracking.experiment, artifact_location=location)
    except MlflowException:  # created concurrently
        return mlflow.get_experiment_by_name(tracking.experiment).experiment_id


def start_run(tracking: TrackingConfig, name: str, parent_run_id: str | None = None) -> str:
    tags = {"mlflow.parentRunId": parent_run_id} if parent_run_id is not None else {}
    return client(tracking.uri).create_run(_experiment_id(tracking), tags=tags, run_name=name).info.run_id


def end_run(uri: str, run_id: str, succeeded: bool = True) -> None:
    status = RunStatus.FINISHED if succeeded else RunStatus.FAILED
    client(uri).set_terminated(run_id, status=RunStatus.to_string(status))


def log_config(uri: str, run_id: str, config: BaseModel) -> None:
    params = [Param(key, str(value)[:6000]) for key, value in flatten(config).items()]
    mlflow = client(uri)
    for start in range(0, len(params), _BATCH):
        mlflow.log_batch(run_id, params=params[start : start + _BATCH])
    with TemporaryDirectory() as folder:
        path = Path(folder) / "config.yaml"
        path.write_text(dump_yaml(config))
        mlflow.log_artifact(run_id, str(path))


def log_metrics(uri: str, run_id: str, step: int, metrics: Mapping[str, float]) -> None:
    now = int(time.time() * 1000)
    client(uri).log_batch(run_id, metrics=[Metric(key, float(value), now, step) for key, value in metrics.items()])


def log_artifacts(uri: str, run_id: str, folder: str | Path, artifact_path: str | None = None) -> None:
    client(uri).log_artifacts(run_id, str(folder), artifact_path=artifact_path)
