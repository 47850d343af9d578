"""Each trial's training step by step (loss, gradient norm, learning rate, tokens, and its accuracy during training:
Figure 3's points), read back from MLflow's metric histories and exported beside the report (`steps.json.gz`): what
a collapsed seed did can be examined once the machine and its store are gone, and a report made again from the
report's files alone (`clozemath.report.folders`) draws the same Figure 3."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path
from typing import Any, Protocol

from clozemath import tracking
from clozemath.errors import ClozeMathError
from clozemath.files import atomic_path
from clozemath.records import ACCURACY, CURVE_PREFIX, parse_eval_metric, train_metric
from clozemath.report.runs import TrialResult

STEPS_FILE = "steps.json.gz"
STEP_METRICS = tuple(train_metric(name) for name in ("loss", "grad_norm", "lr", "tokens"))
"""What the export keeps of every step (`clozemath.train.loop.StepMetrics`: the loss and the learning rate of the
step, the gradients' norm before clipping, its real tokens); and each accuracy the trial measured during training
(`curve_metrics`)."""
SIGNIFICANT_DIGITS = 7
"""A float32's precision: the training metrics were logged from float32 tensors (the accuracies during training are
ratios of counts, kept as logged)."""
RUN_FIELDS = ("run_id", "run_name", "model", "method", "seed", "rerun", "train_set")
"""What names the run of an exported trial's steps."""

Steps = dict[str, list[Any]]
"""`step`: the steps a run logged, in order; for each metric it logged, its value at each of them (None where it has
none)."""


def curve_metrics(metrics: dict[str, float]) -> list[str]:
    """The accuracies a trial measured during training (`curve/<set>/<decoding>/accuracy`), among its metrics."""
    return sorted(key for key in metrics if (parsed := parse_eval_metric(key)) is not None
                  and (parsed.prefix, parsed.stat) == (CURVE_PREFIX, ACCURACY))


class Histories(Protocol):
    """Where a trial's metrics step by step are read from: a tracking store, or a report's `steps.json.gz`."""

    def steps(self, trial: TrialResult) -> Steps:
        """The trial's steps and their `STEP_METRICS` and `curve_metrics`."""

    def history(self, trial: TrialResult, key: str) -> list[tuple[int, float]]:
        """(step, value) of one of those metrics, in step order; a step logged twice with its latest value."""


class StoreHistories:
    """The metric histories of a tracking store (opened at the first read: a report with nothing trained opens
    none)."""

    def __init__(self, tracking_uri: str) -> None:
        self._tracking_uri = tracking_uri

    def history(self, trial: TrialResult, key: str) -> list[tuple[int, float]]:
        points = tracking.client(self._tracking_uri).get_metric_history(trial.run_id, key)
        latest = {point.step: point.value for point in sorted(points, key=lambda point: point.timestamp)}
        return sorted(latest.items())

    def steps(self, trial: TrialResult) -> Steps:
        histories = {key: dict(self.history(trial, key)) for key in STEP_METRICS}
        histories = {key: {step: float(f"{value:.{SIGNIFICANT_DIGITS}g}") for step, value in values.items()}
                     for key, values in histories.items() if values}
        histories |= {key: dict(found) for key in curve_metrics(trial.metrics) if (found := self.history(trial, key))}
        every = sorted(set().union(*histories.values()))
        return {"step": every, **{key: [values.get(step) for step in every] for key, values in histories.items()}}


class ExportedHistories:
    """The histories a report exported (`export_steps`), by run id."""

    def __init__(self, steps: dict[str, Steps]) -> None:
        self._steps = steps

    def steps(self, trial: TrialResult) -> Steps:
        return self._steps[trial.run_id]

    def history(self, trial: TrialResult, key: str) -> list[tuple[int, float]]:
        steps = self._steps.get(trial.run_id, {})
        return [(step, value) for step, value in zip(steps.get("step", []), steps.get(key, [])) if value is not None]


def export_steps(results: list[TrialResult], histories: Histories, path: Path) -> Path:
    """Every trained trial's steps (`Histories.steps`) with its run (`RUN_FIELDS`), as one gzipped JSON list.
    Reproducible: the same runs give the same bytes, from the store or from an earlier export."""
    ordered = sorted((r for r in results if r.steps is not None),
                     key=lambda r: (r.train_set, r.model, r.method, r.seed, r.rerun, r.run_id))
    trials = [{"run_id": r.run_id, "run_name": r.run_name, "model": r.model, "method": r.method, "seed": r.seed,
               "rerun": r.rerun, "train_set": r.train_set, **histories.steps(r)} for r in ordered]
    with atomic_path(path) as temporary, temporary.open("wb") as file, \
            gzip.GzipFile(filename="", mode="wb", fileobj=file, mtime=0) as raw:  # no name nor time in the header
        with io.TextIOWrapper(raw, encoding="utf-8", newline="\n") as handle:
            handle.write("[\n" + ",\n".join(json.dumps(trial, sort_keys=True) for trial in trials) + "\n]\n")
    return path


def read_steps(path: Path) -> dict[str, Steps]:
    """The steps an `export_steps` file holds, by run id; a file that is not one is a one-line error naming it."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as handle:
            trials = json.load(handle)
        if not isinstance(trials, list):
            raise ValueError("not a list of trials")
        found = {}
        for trial in trials:
            steps = {key: value for key, value in trial.items() if key not in RUN_FIELDS}
            if not isinstance(steps.get("step"), list) or any(
                    not isinstance(values, list) or len(values) != len(steps["step"]) for values in steps.values()):
                raise ValueError(f"run {trial.get('run_id')}: its metrics are not lists as long as its steps")
            found[str(trial["run_id"])] = steps
        return found
    except OSError as exc:
        raise ClozeMathError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except (ValueError, KeyError, TypeError, AttributeError, EOFError) as exc:
        what = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ClozeMathError(f"{path}: not a steps.json.gz file `clozemath report` wrote ({what})") from None
