"""The grid on Ray Tune: one trial per point, each a `run_experiment` (preprocess, Ray Train, evaluation).

The trial is a Tune function trainable: it launches the trial's `TorchTrainer` (Ray Train V2 runs no longer go into a
`Tuner` themselves), whose workers hold their own resources, with a `TuneReportCallback` so that the metrics of its
checkpoints and evaluations reach Tune; then it evaluates. The function itself asks for one CPU; how many trials run
at once follows the cluster's GPUs (`max_concurrent_trials` overrides it).

MLflow: the driver opens one parent run per grid; each trial logs into a child run tagged with its model, method,
training set and seed. Restore: the Tune experiment lives in `<train.output_dir>/tune/<grid>-<key>`, the key a hash
of every trial's resolved config. `clozemath run` with the same config finds it and calls `Tuner.restore`:
finished trials are not run again; an unfinished trial starts its function again, whose `TorchTrainer` (under a
run name fixed by the trial's config, the data it reads and the code that makes its samples: `trial_key`) resumes
from its newest whole checkpoint, and which logs on into its child run. A
trial whose child run already finished (the driver died before Tune recorded it) only reports that run's metrics.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray
from ray import tune

from clozemath import console, interrupts, tracking
from clozemath.config import ExperimentConfig, GridConfig, TrackingConfig, from_wire, to_wire
from clozemath.errors import ClozeMathError
from clozemath.eval.predictions import read_predictions, results_table, trials_results_table
from clozemath.files import remove_abandoned_staging, storage_fault_advice
from clozemath.model.tokenizer import load_tokenizer
from clozemath.plan import RunPlan, data_inputs, run_inputs, trial_labels, with_absolute_paths
from clozemath.records import (
    ADAPTER_DIR,
    GRID_ARTIFACT,
    GRID_KEY_TAG,
    GRID_ROLE,
    LOGS_DIR,
    PARENT_TAG,
    PREDICTIONS_ARTIFACTS,
    REPORT_DIR,
    ROLE_TAG,
    TRIAL_TAG,
    TUNE_DIR,
    cache_folder,
    grid_folder,
    grid_tags,
    headline_metric,
    is_eval_metric,
    parse_eval_metric,
    run_folder,
    train_metric,
    trial_run_names,
    trial_tags,
)
from clozemath.safe_yaml import dump_yaml
from clozemath.tracking import TrackedRun
from ray_jobs.cluster import init_ray, user_error
from ray_jobs.logs import logged
from ray_jobs.run import run_experiment, with_budgets
from ray_jobs.reports import TuneProgress


class QuietUserErrors(logging.Filter):
    """Drop Tune's log of a failed trial's traceback when the failure is a user mistake: the command ends with its
    one-line error, and the traceback stays in the trial's error file. Other failures keep their traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return error is None or user_error(error) is None


class TrialLines(tune.Callback):
    """On the driver: a console line when a trial of the grid starts, and when it ends (with its headline)."""

    def __init__(self, headlines: dict[str, str]) -> None:
        self.headlines = headlines

    def on_trial_start(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        console.phase(f"trial {trial.config['trial']}: started")

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        name = trial.config["trial"]
        console.phase(f"trial {name}: finished{headline_text(self.headlines.get(name), trial.last_result or {})}")

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        console.phase(f"trial {trial.config['trial']}: failed (its error comes at the end)")


def headline_text(headline: str | None, metrics: dict[str, Any]) -> str:
    """`  gsm8k/beam 41.20%`: the headline accuracy, if measured."""
    value = metrics.get(headline or "")
    return "" if value is None else f"  {parse_eval_metric(headline).measured} {value:.2%}"


MLFLOW_UI = "http://127.0.0.1:5000"
"""Where `mlflow ui` serves by default."""
TUNE_CONTROLLER_LOGGER = "ray.tune.execution.tune_controller"
"""Where Tune logs a failed trial's traceback."""
TUNE_ERROR_FILE = "error.txt"
TRIAL_RESOURCES = {"CPU": 1}
"""The trial function's own: Ray Train's workers, Ray Data's tasks and the evaluation actors ask for theirs."""
RUN_ID_KEY = "mlflow_run_id"
STAGING_WAIT_S = 10.0
"""How long an interrupted command waits for its trials' processes to end before it removes the data they were
preparing."""


@dataclass(frozen=True)
class TrialOutcome:
    name: str
    status: str
    """Tune's: TERMINATED (finished), ERROR, ..."""
    run_id: str | None
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    headline: str | None = None
    """The accuracy to show first (`clozemath.records.headline_metric`)."""
    folder: Path | None = None
    """The trial's run folder (adapter, evaluation)."""
    error_file: Path | None = None
    """Where Tune keeps a failed trial's traceback."""


@dataclass(frozen=True)
class GridOutcome:
    name: str
    parent_run_id: str
    tracking_uri: str
    experiment: str
    path: Path
    """The Tune experiment's folder."""
    trials: list[TrialOutcome]
    restored: bool
    view: str = ""
    """The MLflow UI's page of the grid's trials side by side (`tracking.trials_view`), after its host."""

    @property
    def failed(self) -> list[TrialOutcome]:
        return [trial for trial in self.trials if trial.error is not None]


# --------------------------------------------------------------------------------------------------------------
# The driver


def run_command(plan: RunPlan) -> None:
    """`clozemath run`: an experiment (a grid of one) or a grid, on Ray Tune; an interrupted grid resumes."""
    logs = plan.folder / LOGS_DIR
    cache = cache_folder(plan.experiments[0].train.output_dir)
    try:
        with interrupts.on_stuck(lambda: remove_abandoned_staging(cache, wait_s=1.0)), logged(logs):
            outcome = run_grid(plan)
    except KeyboardInterrupt:  # Ray is down by now: the trials that were preparing data have ended
        remove_abandoned_staging(cache, wait_s=STAGING_WAIT_S)
        raise
    print_grid_outcome(outcome, logs)


def run_grid(plan: RunPlan) -> GridOutcome:
    """Run (or resume) every trial of the grid on Ray Tune; returns how each ended (`print_grid_outcome` turns
    failed trials into a one-line error)."""
    grid = plan.grid
    experiments = [with_absolute_paths(experiment) for experiment in plan.experiments]
    check_models(experiments)
    init_ray()  # before preparing data (`with_budgets`): the console's first line says which Ray the command runs on
    experiments = with_budgets(experiments, plan.root)
    key = grid_key(experiments)
    tracking_cfg = experiments[0].tracking
    path = Path(experiments[0].train.output_dir) / TUNE_DIR / f"{_safe(grid.name)}-{key}"
    warn_local_store_on_a_cluster(tracking_cfg.uri)
    parent = parent_run(grid, tracking_cfg, key, len(experiments))
    view = tracking.trials_view(tracking_cfg, grid.name)
    restored = tune.Tuner.can_restore(str(path))
    trials = {e.name: to_wire(e) for e in in_start_order(experiments)}  # the same on restore: the key says so
    labels = trial_labels(grid)
    run_names = dict(zip(labels, trial_run_names(list(labels.values()), grid.name)))
    trainable = tune.with_resources(
        tune.with_parameters(run_trial, trials=trials, grid=grid.name, parent_run_id=parent.run_id,
                             run_names=run_names), TRIAL_RESOURCES
    )
    headlines = {e.name: headline_metric(e) for e in experiments if e.eval.sets}
    if restored:
        console.phase(f"[{grid.name}] resuming the grid in {path}")
        tuner = tune.Tuner.restore(str(path), trainable, resume_unfinished=True, resume_errored=True)
    else:
        if len(experiments) > 1:
            console.phase(
                f"[{grid.name}] {len(experiments)} trials, up to {concurrent_trials(grid, experiments)} at a time"
            )
        tuner = tune.Tuner(
            trainable,
            param_space={"trial": tune.grid_search(list(trials))},
            tune_config=tune.TuneConfig(
                max_concurrent_trials=concurrent_trials(grid, experiments), trial_dirname_creator=trial_dirname,
                reuse_actors=True,  # a finished trial's process runs the next (each new one imports for seconds)
            ),
            run_config=tune.RunConfig(
                name=path.name, storage_path=str(path.parent), verbose=1 if console.verbose() else 0,
                callbacks=[TrialLines(headlines)] if len(experiments) > 1 else None,
            ),
        )
    with ExitStack() as stack:
        # a signal to the whole process group ends Ray too: the grid's runs are marked KILLED all the same
        stack.enter_context(interrupts.on_stuck(lambda: end_interrupted(tracking_cfg, parent, settle_s=0)))
        if console.verbose():  # else the driver's log keeps the traceback, and the console shows none anyway
            quiet, tune_log = QuietUserErrors(), logging.getLogger(TUNE_CONTROLLER_LOGGER)
            tune_log.addFilter(quiet)
            stack.callback(tune_log.removeFilter, quiet)
        try:
            results = tuner.fit()
        except KeyboardInterrupt:  # a second Ctrl-C, while Tune was saving its state
            end_interrupted(tracking_cfg, parent)
            raise
        stopped = any(result.error is None and RUN_ID_KEY not in (result.metrics or {}) for result in results)
        if stopped:  # a trial that neither failed nor made its final report: Tune stopped it on Ctrl-C (TERMINATED)
            end_interrupted(tracking_cfg, parent)
            raise KeyboardInterrupt
    folders = {e.name: run_folder(e) for e in experiments}
    outcomes = [
        _with_run_id(_trial_outcome(result, headlines, folders), tracking_cfg, parent.run_id) for result in results
    ]
    if any(outcome.error is None for outcome in outcomes):
        report_into_parent(grid.name, tracking_cfg, parent, grid_folder(experiments[0].train.output_dir, grid.name),
                           view)
    parent.end(succeeded=all(o.error is None for o in outcomes))
    return GridOutcome(grid.name, parent.run_id, tracking_cfg.uri, tracking_cfg.experiment, path, outcomes, restored,
                       view)


def report_into_parent(grid: str, tracking_cfg: TrackingConfig, parent: TrackedRun, folder: Path, view: str) -> None:
    """`clozemath report` of the grid run into `<grid folder>/report/`, logged as the grid run's `report/`
    artifacts (tables, summary, plot, trials), and the experiment's description pointing at them. A report that
    cannot be made is a warning: the trials' results stay in their runs, and `clozemath report` makes it later."""
    out = folder / REPORT_DIR
    try:
        from clozemath.report.command import write_report

        made = write_report(tracking_cfg.experiment, tracking_cfg.uri, out, parent_run_ids=[parent.run_id])
        parent.log_artifacts(out, REPORT_DIR)
        tracking.describe_experiment(tracking_cfg, parent, grid, [path.name for path in made.files], view)
    except Exception as exc:  # noqa: BLE001 (the grid's work is done and tracked: the report is its summary only)
        console.warn(f"[{grid}] the report could not be made ({user_error_line(exc)}): run `clozemath report "
                     f"--experiment {tracking_cfg.experiment} --tracking-uri {tracking_cfg.uri}`")
        return
    console.phase(f"[{grid}] report: {out} (also the grid run's artifacts, {REPORT_DIR}/)")


def warn_local_store_on_a_cluster(uri: str) -> None:
    """Trials on several nodes need a tracking server or a database: a SQLite file's locks (or a folder store's
    files) on a network file system do not keep concurrent writers apart."""
    nodes = sum(1 for node in ray.nodes() if node["Alive"])
    if nodes > 1 and uri.startswith(("sqlite:", "file:")):
        console.warn(f"{nodes} Ray nodes log to the local store {uri}: on a cluster, track through a server "
                     "(`mlflow server`, then tracking.uri=http://<host>:<port>; see the README)")


INTERRUPT_SETTLE_S = 5.0
"""How long an interrupted grid's driver keeps its trials' runs KILLED: a trial still unwinding when the driver marks
them may end its own run FAILED just after (its status check and its write are two calls: 31 ms after the driver's
mark in the run that found it), and Tune has stopped every trial by then, so their last writes come within moments."""


def end_interrupted(tracking_cfg: TrackingConfig, parent: TrackedRun, settle_s: float = INTERRUPT_SETTLE_S) -> None:
    """Mark the grid's run KILLED, and every trial run not FINISHED: those still RUNNING (a trial stopped by Tune may
    never end its run) and those that ended FAILED (depending on when the signal lands, a trial's own cleanup, or its
    Train run dying of the shutdown, ends its run first, as a failure), again for `settle_s` (a trial that ends its
    run after the mark). Each resumes with the grid."""
    parent.end(status="KILLED")
    settled = time.monotonic() + settle_s
    while True:
        for run in tracking.find_runs(tracking_cfg, {PARENT_TAG: parent.run_id}):
            if run.info.status not in ("FINISHED", "KILLED"):
                TrackedRun(parent.uri, run.info.run_id).end(status="KILLED")
        if time.monotonic() >= settled:
            return
        time.sleep(0.5)


def check_models(experiments: list[ExperimentConfig]) -> None:
    """Every model's tokenizer loads: a wrong path or hub id is refused before any trial starts."""
    seen = set()
    for experiment in experiments:
        model = experiment.model.model_dump_json()
        if model not in seen:
            seen.add(model)
            load_tokenizer(experiment.model)


def config_key(*configs: ExperimentConfig) -> str:
    text = json.dumps([config.model_dump(mode="json") for config in configs], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def data_identities(experiments: list[ExperimentConfig]) -> list[str]:
    """Every file the grid reads problems from, with a hash of its content (a missing one is an error)."""
    return sorted(set(data_inputs(experiments).values()))


def grid_key(experiments: list[ExperimentConfig]) -> str:
    """Names the grid's Tune experiment: the same configs reading the same data resume it; any change to either (a
    data folder pointed elsewhere, a file edited) starts another."""
    text = json.dumps([config_key(*experiments), data_identities(experiments)])
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def trial_key(config: ExperimentConfig) -> str:
    """Names a trial's Ray Train run (`train-<key>`), whose checkpoints it resumes from: its config, the data it reads
    and the code that makes its samples, so that a checkpoint is never resumed on other data or samples."""
    inputs = run_inputs([config])
    text = json.dumps([config_key(config), inputs.data, inputs.code], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def concurrent_trials(grid: GridConfig, experiments: list[ExperimentConfig]) -> int:
    """`max_concurrent_trials`, else as many trials as the cluster's GPUs hold (`train.gpu_share` of one a worker); on CPU one at a time (a trial's
    workers use every core of the node)."""
    if grid.max_concurrent_trials:
        return grid.max_concurrent_trials
    gpus = ray.cluster_resources().get("GPU", 0)
    per_trial = max(experiment.train.num_workers * experiment.train.gpu_share for experiment in experiments)
    return max(1, int(gpus / per_trial + 1e-9))


def in_start_order(experiments: list[ExperimentConfig]) -> list[ExperimentConfig]:
    """The order Tune starts the trials in (its grid search's, the first `concurrent_trials` at once): the trials
    that train nothing (the base model's few-shot evaluation) first, so that they evaluate while the others train,
    instead of alone after the last of them; the others in the grid's order."""
    return sorted(experiments, key=lambda experiment: experiment.method.trains)


def parent_run(grid: GridConfig, tracking_cfg: TrackingConfig, key: str, num_trials: int) -> TrackedRun:
    """The grid's MLflow run: the one an earlier run of the same config opened, else a new one."""
    found = tracking.find_runs(tracking_cfg, {GRID_KEY_TAG: key, ROLE_TAG: GRID_ROLE})
    if found:
        return tracking.reopen_run(tracking_cfg.uri, found[0].info.run_id)
    run = tracking.start_run(tracking_cfg, grid.name, tags=grid_tags(grid.name, key))
    run.log_params(
        {"grid.name": grid.name, "grid.key": key, "grid.trials": num_trials, "grid.axes": json.dumps(grid.axes)}
    )
    run.log_text(dump_yaml(grid), GRID_ARTIFACT)
    return run


def trial_dirname(trial: Any) -> str:
    """The trial's folder under the Tune experiment: its point of the grid."""
    return _safe(trial.config["trial"].split("/", 1)[-1])[:120]


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=,-]+", "_", name)


def _trial_outcome(result: Any, headlines: dict[str, str], folders: dict[str, Path]) -> TrialOutcome:
    metrics = dict(result.metrics or {})
    name = result.config["trial"] if result.config else result.path
    error = None if result.error is None else storage_fault_advice(user_error_line(result.error), folders.get(name))
    status = "ERROR" if result.error is not None else "TERMINATED"
    error_file = Path(result.path) / TUNE_ERROR_FILE if result.error is not None else None
    return TrialOutcome(
        name, status, metrics.get(RUN_ID_KEY), metrics, error, headlines.get(name), folders.get(name), error_file
    )


def _with_run_id(outcome: TrialOutcome, tracking_cfg: TrackingConfig, parent_run_id: str) -> TrialOutcome:
    """A trial that failed reported no run id: its run, found by its tags."""
    if outcome.run_id is not None:
        return outcome
    found = tracking.find_runs(tracking_cfg, {PARENT_TAG: parent_run_id, TRIAL_TAG: outcome.name})
    return replace(outcome, run_id=found[0].info.run_id) if found else outcome


_RAISED_LINE = re.compile(r"(?:[\w.]+\.)?\w*(?:Error|Exception|Exit|Interrupt)(?:\([\w.]+\))?: \S")
"""A traceback's `SomeError: message` line (Ray writes a wrapped task's as `RayTaskError(SomeError): ...`)."""


def user_error_line(error: BaseException) -> str:
    """A trial's failure in one line: the ClozeMathError inside Ray's wrappers if there is one, else the last
    `SomeError: message` line of the remote traceback (Ray Data ends its errors with advice on retries, which says
    nothing of the cause), else its last line."""
    found = user_error(error)
    if found is not None:
        return str(found)
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    raised = [line for line in lines if _RAISED_LINE.match(line)]
    return (raised or lines or [type(error).__name__])[-1]


def print_grid_outcome(outcome: GridOutcome, logs: Path | None = None) -> None:
    """The closing summary: a line per trial (status, headline accuracy, MLflow run); for a single experiment its
    results table and files; where the logs and the MLflow runs are. A failed trial makes the command fail, in one
    line. `logs`: the command's log folder."""
    finished = len(outcome.trials) - len(outcome.failed)
    lines = [f"== {outcome.name}{' (restored)' if outcome.restored else ''}: "
             f"{finished} of {len(outcome.trials)} trials finished =="]
    width = max(len(trial.name) for trial in outcome.trials)
    for trial in outcome.trials:
        state = "failed: " + (trial.error or "") if trial.error else "finished"
        headline = headline_text(trial.headline, trial.metrics).strip()
        lines.append(f"  {trial.name:<{width}}  {state:<10}  {headline:<24}  run {trial.run_id or '-'}")
    if len(outcome.trials) == 1:
        lines += _experiment_summary(outcome.trials[0], outcome.experiment, outcome.tracking_uri)
    else:
        if len(outcome.trials) <= SIDE_BY_SIDE_TRIALS:
            lines += _side_by_side(outcome.trials, outcome.tracking_uri)
        lines.append(f"MLflow:       grid run {outcome.parent_run_id} (experiment '{outcome.experiment}')")
    if logs is not None:
        lines.append(f"logs:         {logs} ({', '.join(sorted(p.name for p in logs.glob('*.log')))})")
    lines += [f"traceback:    {trial.error_file}" for trial in outcome.failed if trial.error_file is not None]
    lines.append(f"tune:         {outcome.path}")
    lines.append(f"browse:       mlflow ui --backend-store-uri {outcome.tracking_uri}, then open "
                 f"{MLFLOW_UI}/{outcome.view}")
    if len(outcome.trials) > 1:
        default = TrackingConfig.model_fields["uri"].default  # `clozemath report`'s too
        store = "" if outcome.tracking_uri == default else f" --tracking-uri {outcome.tracking_uri}"
        lines.append(f"tables:       clozemath report --experiment {outcome.experiment}{store}")
    console.result("\n".join(lines))
    if outcome.failed:
        first = outcome.failed[0]
        failed = f"{len(outcome.failed)} of {len(outcome.trials)} trials failed"
        raise ClozeMathError(f"{failed}; {first.name}: {first.error}")


def _experiment_summary(trial: TrialOutcome, experiment: str, tracking_uri: str) -> list[str]:
    """A single experiment's results table, what shows it worked (its loss, an answer it gave), its adapter,
    predictions and MLflow run, and what one run cannot show."""
    lines = []
    if any(map(is_eval_metric, trial.metrics)):
        lines.append(results_table(trial.metrics))
    lines += _evidence(trial, tracking_uri)
    if trial.folder is not None and (trial.folder / ADAPTER_DIR).is_dir():
        lines.append(f"adapter:      {trial.folder / ADAPTER_DIR}")
    if trial.folder is not None and (trial.folder / PREDICTIONS_ARTIFACTS).is_dir():
        lines.append(f"predictions:  {trial.folder / PREDICTIONS_ARTIFACTS}")
    lines.append(f"MLflow:       run {trial.run_id or '-'} (experiment '{experiment}')")
    if trial.error is None:
        lines.append("note:         one run shows the pipeline working, not a method's gain: a grid of methods and seeds "
                     "(configs/grids/) and `clozemath report` compare them, with intervals")
    return lines


SIDE_BY_SIDE_TRIALS = 4
"""A grid this small (the quickstart: a method beside its base model) closes with its trials' results side by side,
each one's loss and a sample answer."""


def _side_by_side(trials: list[TrialOutcome], tracking_uri: str) -> list[str]:
    """A small grid's results table, a row per trial, then what shows each worked (its loss, an answer it gave)."""
    measured = {trial.name: trial.metrics for trial in trials if any(map(is_eval_metric, trial.metrics))}
    lines = [trials_results_table(measured)] if measured else []
    for trial in trials:
        lines += _evidence(trial, tracking_uri, of=trial.name)
    if len(measured) > 1:
        lines.append("note:         a seed on a few problems cannot tell these apart: their difference with its 95% "
                     "interval is in `clozemath report` (its command below)")
    return lines


def _evidence(trial: TrialOutcome, tracking_uri: str, of: str | None = None) -> list[str]:
    """A trial's loss (if it trained) and a sample answer (if it evaluated); `of`: the trial named in each line."""
    lines = []
    if trial.run_id is not None and trial.folder is not None and (trial.folder / ADAPTER_DIR).is_dir():
        lines += loss_line(tracking_uri, trial.run_id, of)
    if trial.folder is not None:
        lines += sample_line(trial.folder / PREDICTIONS_ARTIFACTS, of)
    return lines


def loss_line(tracking_uri: str, run_id: str, of: str | None = None) -> list[str]:
    """`loss:` the training loss over the run's first and last fifth of steps (each a mean: one step is noisy), and
    whether it fell; none for a run that logged fewer than two steps. `of`: the trial, named first."""
    losses = TrackedRun(tracking_uri, run_id).history(train_metric("loss"))
    if len(losses) < 2:
        return []
    k = max(1, len(losses) // 5)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    trend = "falling" if last < first else "not falling (every step: train/loss in MLflow)"
    return [f"loss:         {_of(of)}{first:.3f} -> {last:.3f}, {trend} (the mean of its first and of its last {k} "
            f"of {len(losses)} steps)"]


def sample_line(folder: Path, of: str | None = None) -> list[str]:
    """`sample:` the first prediction of the run's first evaluation set that says something (an empty generation
    shows nothing of the pipeline): the start of the model's answer, the answer found in it, the gold one, its
    verdict; none without predictions. `of`: the trial, named first."""
    files = sorted(path for path in folder.glob("*.jsonl") if not path.name.endswith(".partial.jsonl"))
    if not files:
        return []
    predictions = read_predictions(files[0])
    first = next((p for p in predictions if p.generation.strip()), predictions[0])
    text = " ".join(first.generation.split())
    shown = text if len(text) <= SAMPLE_CHARS else text[:SAMPLE_CHARS] + "…"
    cut = ", cut at eval.max_new_tokens" if first.finish_reason == "length" else ""
    verdict = "right" if first.correct else "wrong"
    return [f'sample:       {_of(of)}{first.dataset} {first.id} ({first.decoding}): "{shown}" -> '
            f'{first.extracted or "no answer"} (gold {first.gold}): {verdict}{cut}']


def _of(trial: str | None) -> str:
    return "" if trial is None else f"{trial}: "


SAMPLE_CHARS = 100
"""How much of a sample answer the closing summary shows."""


# --------------------------------------------------------------------------------------------------------------
# A trial


def run_trial(settings: dict[str, Any], trials: dict[str, dict[str, Any]], grid: str, parent_run_id: str,
              run_names: dict[str, str]) -> None:
    """Tune's function trainable: one point of the grid (`settings["trial"]`, a key of `trials`), end to end, in its
    child run of `parent_run_id`, named `run_names[trial]` (what varies: `records.trial_run_names`)."""
    config = from_wire(trials[settings["trial"]])
    earlier = tracking.find_runs(config.tracking, {PARENT_TAG: parent_run_id, TRIAL_TAG: config.name})
    if earlier and earlier[0].info.status == "FINISHED":  # done before the driver died: nothing to redo
        tune.report({**earlier[0].data.metrics, RUN_ID_KEY: earlier[0].info.run_id})
        return
    outcome = run_experiment(
        config,
        parent_run_id,
        trial_tags(config, grid),
        run_name=run_names.get(config.name),
        run_id=earlier[0].info.run_id if earlier else None,
        train_run_name=f"train-{trial_key(config)}",
        train_callbacks=[TuneProgress()],
    )
    tune.report({**outcome.eval_metrics, RUN_ID_KEY: outcome.run_id})
