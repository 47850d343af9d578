"""Each trial's training step by step (loss, gradient norm, learning rate, tokens), read back from MLflow's metric
histories and exported beside the report (`steps.json.gz`): what a collapsed seed did can be examined once the
machine and its store are gone."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path
from typing import Any

from mlflow import MlflowClient

from clozemath import tracking
from clozemath.files import atomic_path
from clozemath.records import train_metric
from clozemath.report.runs import TrialResult

STEPS_FILE = "steps.json.gz"
STEP_METRICS = tuple(train_metric(name) for name in ("loss", "grad_norm", "lr", "tokens"))
"""What the export keeps of every step (`clozemath.train.loop.StepMetrics`: the loss and the learning rate of the
step, the gradients' norm before clipping, its real tokens)."""
SIGNIFICANT_DIGITS = 7
"""A float32's precision: the values were logged from float32 tensors."""


def trial_steps(client: MlflowClient, run_id: str) -> dict[str, list[Any]]:
    """`step`: the steps the run logged, in order; for each of `STEP_METRICS` it logged, its value at each of them
    (None where it has none). A step logged twice keeps its latest value."""
    histories = {}
    for key in STEP_METRICS:
        points = sorted(client.get_metric_history(run_id, key), key=lambda point: point.timestamp)
        if points:
            histories[key] = {point.step: float(f"{point.value:.{SIGNIFICANT_DIGITS}g}") for point in points}
    steps = sorted(set().union(*histories.values()))
    return {"step": steps, **{key: [values.get(step) for step in steps] for key, values in histories.items()}}


def export_steps(results: list[TrialResult], tracking_uri: str, path: Path) -> Path:
    """Every trained trial's steps (`trial_steps`) with its run (id, name, model, method, seed, training set), as one
    gzipped JSON list. Reproducible: the same runs give the same bytes."""
    ordered = sorted((r for r in results if r.steps is not None),
                     key=lambda r: (r.train_set, r.model, r.method, r.seed, r.rerun, r.run_id))
    client = tracking.client(tracking_uri) if ordered else None  # a report from exports alone opens no store
    trials = [{"run_id": r.run_id, "run_name": r.run_name, "model": r.model, "method": r.method, "seed": r.seed,
               "rerun": r.rerun, "train_set": r.train_set, **trial_steps(client, r.run_id)}
              for r in ordered if client is not None]
    with atomic_path(path) as temporary, temporary.open("wb") as file, \
            gzip.GzipFile(filename="", mode="wb", fileobj=file, mtime=0) as raw:  # no name nor time in the header
        with io.TextIOWrapper(raw, encoding="utf-8", newline="\n") as handle:
            handle.write("[\n" + ",\n".join(json.dumps(trial, sort_keys=True) for trial in trials) + "\n]\n")
    return path
