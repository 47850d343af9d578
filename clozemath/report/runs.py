"""A grid's trials read back from MLflow (`TrialResult`), and the measurements selected from them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Run
from mlflow.exceptions import MlflowException

from clozemath import tracking
from clozemath.config import TrackingConfig
from clozemath.data.training_sets import training_set_names
from clozemath.errors import ClozeMathError
from clozemath.eval.decoding import decoding_names
from clozemath.records import (
    ACCURACY,
    EVAL_PREFIX,
    GRID_ROLE,
    METHOD_TAG,
    MODEL_TAG,
    PARENT_TAG,
    PLANNED_STEPS,
    PLANNED_TOKENS,
    ROLE_TAG,
    SEED_TAG,
    TRAIN_SET_TAG,
    TRAINED_STEPS,
    TRAINED_TOKENS,
    TRIAL_TAG,
    eval_metric,
    parse_eval_metric,
)
from clozemath.report.names import MODEL_NAMES, SYMBOLIC_SETS, Block, Column, ordered, rank

TRIALS_FILE = "trials.json"


@dataclass(frozen=True)
class TrialResult:
    """One child run: what it trained, and its metrics' latest values."""

    run_id: str
    model: str
    method: str
    train_set: str
    seed: str
    metrics: dict[str, float]
    steps: int | None = None
    """The optimizer steps the trial trained (for a run from before they were recorded, those it planned; always the
    same); None: it trained nothing."""
    planned_tokens: int | None = None
    """The training tokens its budget planned (its epochs over its training set's tokens)."""
    trained_tokens: int | None = None
    """The real (non-padding) tokens its steps trained on (None: not recorded, a run from before that record)."""
    run_name: str = ""
    tags: dict[str, str] = field(default_factory=dict)
    """The run's own tags (MLflow's `mlflow.*` ones left out)."""
    params: dict[str, str] = field(default_factory=dict)
    rerun: int = 0
    """`train.rerun`: 0 for the run every table but the noise floor's uses, k for its k-th repetition."""
    seconds: float | None = None
    """The run's wall time, start to end (None: not ended, or read from a `trials.json` written before it was)."""


PROBLEM_SET_PARAMS = ("split", "limit", "ids", "path", "per_template", "seed")
"""What of an evaluation set's settings (`eval.sets.<name>.*`) picks its problems: runs that differ in one evaluated
other problems under one name (a rate sweep's held-out GSM8K train against GSM8K test)."""


def check_one_problem_set_per_name(results: Sequence[TrialResult]) -> None:
    """Every run that evaluated a set of one name evaluated the same problems, else a one-line error naming two that
    differ: a table's column and a comparison would pool them. Files compare by name (a run on another machine read
    its copy); a setting a run did not record is not compared."""
    seen: dict[tuple[str, str], tuple[str, TrialResult]] = {}
    for result in results:
        for name in filter(None, result.params.get("eval.sets", "").split(", ")):
            for setting in PROBLEM_SET_PARAMS:
                value = result.params.get(f"eval.sets.{name}.{setting}")
                if value is None:
                    continue
                value = Path(value).name if setting in ("ids", "path") and value != "None" else value
                first = seen.setdefault((name, setting), (value, result))
                if first[0] != value:
                    raise ClozeMathError(
                        f"report: runs evaluated other problems as '{name}' (eval.sets.{name}.{setting}: {first[0]} in "
                        f"{first[1].run_name or first[1].run_id}, {value} in {result.run_name or result.run_id}): "
                        "report them apart")


def grid_runs(tracking_uri: str, experiment: str, parent_run_id: str | None = None) -> tuple[Run, list[TrialResult]]:
    """The grid's parent run (the latest of the experiment unless chosen) and its child runs."""
    client = tracking.client(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise ClozeMathError(f"MLflow experiment '{experiment}' not found in {tracking.resolved_uri(tracking_uri)}")
    if parent_run_id is None:
        parents = tracking.find_runs(TrackingConfig(uri=tracking_uri, experiment=experiment), {ROLE_TAG: GRID_ROLE})
        if not parents:
            raise ClozeMathError(f"MLflow experiment '{experiment}': no grid run in it (run `clozemath run` first)")
        parent = parents[0]
    else:
        parent = _grid_run(client, parent_run_id, found.experiment_id, experiment)
    children = _all_runs(client, found.experiment_id, f"tags.`{PARENT_TAG}` = '{parent.info.run_id}'")
    return parent, [_trial_result(run) for run in children if MODEL_TAG in run.data.tags]


def _grid_run(client: MlflowClient, run_id: str, experiment_id: str, experiment: str) -> Run:
    """The grid run `run_id` of the experiment; a one-line error where it is not one."""
    try:
        run = client.get_run(run_id)
    except MlflowException as error:
        raise ClozeMathError(f"--parent {run_id}: no such run ({error.error_code})") from None
    if run.info.experiment_id != experiment_id or run.data.tags.get(ROLE_TAG) != GRID_ROLE:
        raise ClozeMathError(f"--parent {run_id}: not a grid run of experiment '{experiment}'")
    return run


def _all_runs(client: MlflowClient, experiment_id: str, query: str) -> list[Run]:
    runs, token = [], None
    while True:
        page = client.search_runs([experiment_id], filter_string=query, max_results=1000, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def _trial_result(run: Run) -> TrialResult:
    tags = {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")}
    ended = run.info.end_time is not None and run.info.start_time is not None
    seconds = (run.info.end_time - run.info.start_time) / 1000 if ended else None
    return trial_result(run.info.run_id, run.info.run_name or "", tags, dict(run.data.params), dict(run.data.metrics),
                        seconds)


def trial_result(run_id: str, run_name: str, tags: dict[str, str], params: dict[str, str], metrics: dict[str, float],
                 seconds: float | None = None) -> TrialResult:
    """A trial from its run's tags (MLflow's `mlflow.*` ones left out), params, latest metrics and wall seconds: as
    the store holds them, or as `trials.json` wrote them down."""
    steps, planned, trained = (params.get(name) for name in (PLANNED_STEPS, PLANNED_TOKENS, TRAINED_TOKENS))
    steps = params.get(TRAINED_STEPS, steps)
    model, method = tags[MODEL_TAG], tags[METHOD_TAG]
    train_set, seed = tags.get(TRAIN_SET_TAG, ""), tags.get(SEED_TAG, "0")
    variant = _variant(tags.get(TRIAL_TAG, ""), model, method, train_set)
    return TrialResult(
        run_id, model, f"{method} ({variant})" if variant else method, train_set, seed, metrics,
        *(None if value is None else int(value) for value in (steps, planned, trained)), run_name, tags, params,
        int(params.get("train.rerun", "0")), seconds,
    )


def _variant(trial: str, model: str, method: str, train_set: str) -> str:
    """The grid point's other axis values (`lr=0.0001` of `grid/method=it,lr=0.0001`): trials that differ in them are
    not seeds of one cell, so the method is reported as `it (lr=0.0001)`."""
    labels = {model, method, train_set}  # a bundle axis may carry another name (`train_set=gsm8k`)
    pairs = [pair.split("=", 1) for pair in trial.split("/", 1)[-1].split(",") if "=" in pair]
    known = {"model", "method", "dataset", "seed", "rerun"}
    return ",".join(f"{key}={value}" for key, value in pairs if key not in known and value not in labels)


def experiments_runs(tracking_uri: str, experiments: Sequence[str], parent_run_ids: Sequence[str] = ()
                     ) -> list[tuple[Run, list[TrialResult]]]:
    """Each experiment's grid run and trials (`grid_runs`), or, given `parent_run_ids`, those grid runs of the one
    experiment (a seed added later by a grid of its own), to be reported as one: grids that share a trial (the same
    model, method, training set and seed) are refused, since their results would be pooled as if seeds."""
    if parent_run_ids and len(experiments) != 1:
        raise ClozeMathError("--parent names grid runs of one experiment: give one --experiment with it")
    if parent_run_ids:
        grids = [grid_runs(tracking_uri, experiments[0], run_id) for run_id in dict.fromkeys(parent_run_ids)]
        kind, labels = "grid runs", [parent.info.run_id for parent, _ in grids]
    else:
        grids = [grid_runs(tracking_uri, name) for name in experiments]
        kind, labels = "experiments", [f"'{name}'" for name in experiments]
    seen: dict[tuple[str, str, str, str, int], str] = {}
    for label, (_, runs) in zip(labels, grids):
        for r in runs:
            key = (r.model, r.method, r.train_set, r.seed, r.rerun)
            if seen.setdefault(key, label) != label:
                raise ClozeMathError(f"{kind} {seen[key]} and {label} both hold {r.method} seed {r.seed} of {r.model} "
                                     f"on {r.train_set}: report them apart")
    return grids


def trials_json(results: list[TrialResult]) -> str:
    """Every trial's run id and name, tags, params, latest metrics and wall seconds (`TRIALS_FILE`)."""
    in_order = sorted(results, key=lambda r: (r.train_set, r.model, r.method, r.seed, r.run_id))
    trials = [{"run_id": r.run_id, "run_name": r.run_name, "tags": r.tags, "params": r.params, "metrics": r.metrics,
               "seconds": r.seconds} for r in in_order]
    return json.dumps(trials, indent=1, sort_keys=True) + "\n"


def read_trials_json(path: Path) -> list[TrialResult]:
    """The trials a `trials_json` file holds; a file that is not one is a one-line error naming it."""
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(rows, list):
            raise ValueError("not a list of trials")
        return [trial_result(row["run_id"], row.get("run_name", ""), _strings(row["tags"]), _strings(row["params"]),
                             {key: float(value) for key, value in row["metrics"].items()}, _seconds(row))
                for row in rows]
    except OSError as exc:
        raise ClozeMathError(f"{path}: cannot be read ({exc.strerror})") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        what = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ClozeMathError(f"{path}: not a trials.json file `clozemath report` wrote ({what})") from None


def _seconds(row: dict[str, Any]) -> float | None:
    """A trial's wall seconds in `trials.json` (none in one written before they were)."""
    return None if row.get("seconds") is None else float(row["seconds"])


def _strings(values: dict[str, object]) -> dict[str, str]:
    return {str(key): str(value) for key, value in values.items()}


def blocks(results: list[TrialResult]) -> dict[Block, list[TrialResult]]:
    """The trials of each (training set, model), in the report's order."""
    train_sets = ordered((r.train_set for r in results), list(training_set_names()))
    models = ordered((r.model for r in results), list(MODEL_NAMES))
    found = {(t, m): [r for r in results if (r.train_set, r.model) == (t, m)] for t in train_sets for m in models}
    return {block: trials for block, trials in found.items() if trials}


def eval_columns(trials: list[TrialResult]) -> list[Column]:
    """Every (eval set, decoding) some trial has an accuracy of: the training sets first, then GSM-Symbolic's, each set's
    decodings in the registry's order."""
    parsed = [parse_eval_metric(key) for r in trials for key in r.metrics]
    found = {(m.set_name, m.decoding) for m in parsed
             if m is not None and m.prefix == EVAL_PREFIX and m.stat == ACCURACY}
    sets, decodings = [*training_set_names(), *SYMBOLIC_SETS], decoding_names()
    return sorted(found, key=lambda c: (rank(c[0], sets), rank(c[1], decodings)))


def accuracy_metric(column: Column) -> str:
    return eval_metric(column[0], column[1], ACCURACY)


def measured_on(trials: list[TrialResult], method: str, column: Column) -> list[TrialResult]:
    return [r for r in trials if r.method == method and accuracy_metric(column) in r.metrics]


def percents(trials: list[TrialResult], column: Column) -> list[float]:
    """The accuracy of each of these trials (all measured on `column`), in percent."""
    return [100 * r.metrics[accuracy_metric(column)] for r in trials]
