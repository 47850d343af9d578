"""The evaluation job: Ray Data batch inference over the evaluation sets, then files, metrics and MLflow.

Every problem of every set goes into one dataset; `map_batches` sends batches to an actor pool holding one model per
GPU (or a single actor on CPU), and each actor decodes a batch with every decoding of `eval.decodings` and grades it
(`clozemath.eval.evaluate.evaluate_batch`). The driver streams the predictions back: they are appended to
`<set>.partial.jsonl` as they arrive (a crash loses nothing that was decoded: the next evaluation of the same takes
them up, and skips the sets finished before), and when a set is complete its predictions are written in order to
`predictions/<set>.jsonl` and its metrics to `metrics.json`.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray
from ray.data import ActorPoolStrategy, DataContext

from clozemath import console
from clozemath.config import ExperimentConfig, from_wire, to_wire
from clozemath.data.sources import Problem, fingerprint, read_jsonl
from clozemath.errors import ClozeMathError
from clozemath.files import write_text_atomic
from clozemath.eval.evaluate import eval_problems, evaluate_batch, load_evaluated_model, prompting, resolve_adapter
from clozemath.eval.predictions import Prediction, metrics, prediction_from_row, results_table, write_predictions
from clozemath.model.memory import share_gpu
from clozemath.records import (
    EVAL_DECODE_S,
    EVAL_DIR,
    EVAL_SECONDS,
    EVAL_STARTUP_S,
    METRICS_FILE,
    PREDICTIONS_DIR,
    PROBLEMS_PER_S,
    eval_folder,
    eval_metric,
    flatten,
    partial_predictions_file,
    predictions_file,
)
from clozemath.tasks.harness import FILTERS as HARNESS_FILTERS
from clozemath.tracking import TrackedRun, start_run
from ray_jobs.cluster import init_ray, user_errors_surfaced

CALLS_PER_BATCH = 4
"""A Ray Data batch holds this many of decode's batches (`eval.batch_size` prompts each): enough to sort by length
and keep a GPU busy, small enough to spread a set over the pool and to show progress."""
AUTO_RAY_BATCH = 1024
"""Problems per Ray Data batch under `eval.batch_size: auto` (decode sizes its own batches inside it)."""
_PREDICTION_TYPES = {
    "id": pa.string(), "dataset": pa.string(), "decoding": pa.string(), "prompt": pa.string(),
    "generation": pa.string(), "extracted": pa.string(), "gold": pa.string(), "correct": pa.bool_(),
    "confidence": pa.float64(), "harness": pa.struct([(name, pa.bool_()) for name in HARNESS_FILTERS]),
    "finish_reason": pa.string(), "generated_tokens": pa.int64(), "rule": pa.string(), "lenient": pa.bool_(),
}
SCHEMA = pa.schema([(field.name, _PREDICTION_TYPES[field.name]) for field in fields(Prediction)]
                   + [("seconds", pa.float64()), ("ready_at", pa.float64())])
"""A prediction per row, plus the actor-seconds its decoding took (its share of the batch's) and when the actor that
made it was ready to decode (`Evaluator.ready_at`, seconds since the epoch)."""


class Evaluator:
    """A Ray Data actor: one model (on this actor's GPU, else on CPU), built once and
    shared by every set and decoding of each batch of problems."""

    def __init__(self, experiment: dict[str, Any], adapter: Path | None, cpu_threads: int):
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            torch.set_num_threads(cpu_threads)
        config = from_wire(experiment)
        share_gpu(config.train.gpu_share)
        self.config = config
        self.decodings = {set_cfg.dataset: config.eval.decodings_of(set_cfg) for set_cfg in config.eval.sets}
        self.prompting = prompting(config)
        with_adapter = f" with the adapter {adapter}" if adapter is not None else " (few-shot)"
        console.phase(f"[{config.name}] loading the model ({config.model.name}) on {device} for evaluation{with_adapter}",
                      once=True)
        self.loaded = load_evaluated_model(config, adapter, device)
        self.ready_at = time.time()
        """When this actor could decode (its model loaded): the evaluation's start-up ends with the first actor's."""

    def __call__(self, batch: pa.Table) -> pa.Table:
        problems = [Problem(**row) for row in batch.to_pylist()]
        rows = []
        for decoding in dict.fromkeys(self.config.eval.decodings):
            chosen = [problem for problem in problems if decoding in self.decodings[problem.dataset]]
            if not chosen:
                continue
            started = time.perf_counter()
            predictions = evaluate_batch(self.loaded, chosen, decoding, self.config.eval, self.prompting)
            share = (time.perf_counter() - started) / len(predictions)
            rows.extend({**asdict(prediction), "seconds": share, "ready_at": self.ready_at}
                        for prediction in predictions)
        return pa.Table.from_pylist(rows, schema=SCHEMA)


def _actor_pool(config: ExperimentConfig, adapter: Path | None) -> dict[str, object]:
    """`map_batches` arguments for the actors: one per GPU of the cluster (per `train.gpu_share` of one), else one
    using this machine's cores."""
    resources = ray.cluster_resources()
    share = config.train.gpu_share
    actors = int(resources.get("GPU", 0) / share)
    if actors:  # from one actor up: GPUs that other work (a Tune trial's training) holds join the pool when freed
        pool, threads = {"compute": ActorPoolStrategy(min_size=1, max_size=actors), "num_gpus": share}, 1
    else:
        threads = max(1, min(os.cpu_count() or 1, int(resources.get("CPU", 1)) - 1))
        pool = {"compute": ActorPoolStrategy(size=1), "num_cpus": threads}
    return pool | {"fn_constructor_kwargs": {"experiment": to_wire(config), "adapter": adapter, "cpu_threads": threads}}


@contextlib.contextmanager
def _without_ray_progress_bars() -> Iterator[None]:
    """The driver draws one bar over all sets; Ray Data's per-operator bars would only interleave with it."""
    context = DataContext.get_current()
    before = context.enable_progress_bars
    context.enable_progress_bars = False
    try:
        yield
    finally:
        context.enable_progress_bars = before


@dataclass
class _SetProgress:
    """The predictions of one set as they arrive, and those an earlier evaluation of the same left."""

    name: str
    problems: list[Problem]
    decodings: list[str]
    partial: Path
    predictions: list[Prediction]
    seconds: dict[str, float]
    """Actor-seconds of the predictions made now, by decoding."""
    made: dict[str, int]
    """Predictions made now (not restored), by decoding."""
    finished_before: bool = False
    """Its predictions file was complete: nothing to do, nothing to write."""

    @property
    def expected(self) -> int:
        return len(self.problems) * len(self.decodings)

    def held(self) -> set[tuple[str, str]]:
        return {(prediction.id, prediction.decoding) for prediction in self.predictions}

    def pending(self) -> list[Problem]:
        """The problems some decoding of which has no prediction yet."""
        held = self.held()
        return [problem for problem in self.problems if any((problem.id, d) not in held for d in self.decodings)]

    def restore(self, folder: Path) -> None:
        """Take up what an earlier evaluation of the same left (`evaluate_on_ray` checks it was): the set's complete
        predictions file, else the predictions appended to its partial file."""
        expected = {(problem.id, decoding) for problem in self.problems for decoding in self.decodings}
        finished = predictions_file(folder, self.name)
        if finished.is_file():
            predictions = _read_restored(finished)
            if {(p.id, p.decoding) for p in predictions} == expected and len(predictions) == len(expected):
                self.predictions, self.finished_before = predictions, True
                return
        kept: dict[tuple[str, str], Prediction] = {}
        for prediction in _read_restored(self.partial, cut_tail=True):
            if (prediction.id, prediction.decoding) in expected:
                kept.setdefault((prediction.id, prediction.decoding), prediction)
        self.predictions = list(kept.values())

    def add(self, rows: list[dict]) -> None:
        """Predictions made now (those of a decoding restored before, remade with a problem's others, are dropped)."""
        held = self.held()
        rows = [row for row in rows if (row["id"], row["decoding"]) not in held]
        predictions = [Prediction(**{k: v for k, v in row.items() if k in _PREDICTION_TYPES}) for row in rows]
        write_predictions(self.partial, predictions, append=True)
        self.predictions.extend(predictions)
        for row in rows:
            self.seconds[row["decoding"]] += row["seconds"]
            self.made[row["decoding"]] += 1

    def show(self, label: str) -> None:
        """Move the set's progress bar: predictions made, running accuracy."""
        correct = sum(prediction.correct for prediction in self.predictions)
        done = len(self.predictions)
        unit = "problems" if len(self.decodings) == 1 else "predictions"
        accuracy = f"accuracy {correct / done:.1%}" if done else "accuracy -"
        console.progress(f"{label}/evaluation/{self.name}", f"[{label}] eval {self.name}", done, self.expected,
                         [accuracy], rate_unit=unit)

    def finish(self, folder: Path, earlier: dict[str, float]) -> dict[str, float]:
        """Write the predictions in order (decoding, then problem), drop the partial file; the set's metrics (the
        speed of its decodings: of the predictions made now, else as the earlier evaluation measured it)."""
        if not self.finished_before:
            order = {problem.id: i for i, problem in enumerate(self.problems)}
            self.predictions.sort(key=lambda p: (self.decodings.index(p.decoding), order[p.id]))
            write_predictions(predictions_file(folder, self.name), self.predictions)
        self.partial.unlink(missing_ok=True)
        values = metrics(self.predictions)
        for decoding in self.decodings:
            key = eval_metric(self.name, decoding, PROBLEMS_PER_S)
            if self.made[decoding]:
                values[key] = self.made[decoding] / max(self.seconds[decoding], 1e-9)
            elif isinstance(earlier.get(key), (int, float)):
                values[key] = earlier[key]
        return values


def _read_restored(file: Path, cut_tail: bool = False) -> list[Prediction]:
    """The predictions in `file` (none if there is none); `cut_tail`: a last line that a killed process left
    unfinished (no newline) is cut off the file first. A damaged file is an error naming it and the way out."""
    if not file.is_file():
        return []
    if cut_tail:
        size = file.stat().st_size
        with file.open("rb") as handle:
            handle.seek(max(0, size - 1))
            if size and handle.read(1) != b"\n":
                handle.seek(0)
                whole = handle.read().rfind(b"\n") + 1
                os.truncate(file, whole)
    try:
        return [prediction_from_row(row, where) for where, row in read_jsonl(file)]
    except ClozeMathError as exc:
        raise ClozeMathError(f"{exc}: a damaged predictions file; remove {file} and run again (the set is "
                             "evaluated afresh)") from None


def _sets(config: ExperimentConfig, folder: Path) -> dict[str, _SetProgress]:
    names = [set_cfg.dataset for set_cfg in config.eval.sets]
    repeated = next((name for name in names if names.count(name) > 1), None)
    if repeated is not None:
        raise ClozeMathError(f"eval.sets: '{repeated}' appears twice (metrics are named by set)")
    sets = {}
    for set_cfg in config.eval.sets:
        decodings = config.eval.decodings_of(set_cfg)
        sets[set_cfg.dataset] = _SetProgress(
            name=set_cfg.dataset, problems=eval_problems(set_cfg), decodings=decodings,
            partial=partial_predictions_file(folder, set_cfg.dataset), predictions=[],
            seconds=dict.fromkeys(decodings, 0.0), made=dict.fromkeys(decodings, 0),
        )
    return sets


SOURCE_FILE = "source.json"
"""In an evaluation folder: what its predictions are of (the settings that decide them, the adapter's files). A
later evaluation takes them up (a killed one's, a set finished before) only when it is of the same."""


def _source(config: ExperimentConfig, adapter: Path | None) -> dict[str, object]:
    settings = {key: value for key, value in flatten(config).items()
                if not key.startswith(("train.", "tracking.")) and key != "name"}
    files = [] if adapter is None else sorted(path for path in adapter.rglob("*") if path.is_file())
    return {"settings": settings, "adapter": None if adapter is None else fingerprint(files)}


def _read_json(file: Path) -> object:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _take_up(sets: dict[str, _SetProgress], folder: Path, source: dict[str, object]) -> dict[str, float]:
    """Restore what an earlier evaluation of the same left in `folder`, else start afresh there; the metrics the
    earlier one wrote (for the speeds of sets finished then)."""
    if _read_json(folder / SOURCE_FILE) == json.loads(json.dumps(source, default=str)):
        for progress in sets.values():
            progress.restore(folder)
        earlier = _read_json(folder / METRICS_FILE)
        return earlier if isinstance(earlier, dict) else {}
    for progress in sets.values():
        progress.partial.unlink(missing_ok=True)
    write_text_atomic(folder / SOURCE_FILE, json.dumps(source, indent=1, sort_keys=True, default=str) + "\n")
    return {}


def evaluate_on_ray(config: ExperimentConfig, adapter: Path | None, folder: Path) -> dict[str, float]:
    """Evaluate every set with every decoding on the Ray cluster (which must be up); write predictions and
    `metrics.json` under `folder`; the metrics (`eval/<set>/<decoding>/{accuracy,correct,total,problems_per_s}`).
    What an earlier evaluation of the same (model, adapter, settings) left there is taken up: its finished sets are
    not evaluated again, nor the predictions a killed one had appended; its seconds (`EVAL_SECONDS`), those it took
    to start (`EVAL_STARTUP_S`) and to decode (`EVAL_DECODE_S`) when it had problems left."""
    requested = time.time()
    sets = _sets(config, folder)
    if not any(progress.problems for progress in sets.values()):
        raise ClozeMathError("eval.sets: no problems to evaluate")
    earlier = _take_up(sets, folder, _source(config, adapter))
    values: dict[str, float] = {}
    console.phase(f"[{config.name}] evaluating: " + ", ".join(
        f"{name} ({len(progress.problems)} problems, {'/'.join(progress.decodings)}"
        + (f"; {len(progress.predictions)} predictions from before" if progress.predictions else "") + ")"
        for name, progress in sets.items()
    ))
    for progress in sets.values():
        progress.show(config.name)  # the bars' clocks start now: a rate counts the whole evaluation, model loading too
        if len(progress.predictions) == progress.expected:
            values.update(progress.finish(folder, earlier))
    _write_metrics(folder, values)
    problems = [problem.to_dict() for progress in sets.values() for problem in progress.pending()]
    first_ready = _evaluate_pending(config, adapter, folder, sets, problems, earlier, values) if problems else None
    finished = time.time()
    values[EVAL_SECONDS] = finished - requested  # its sets read, its start-up and its decoding
    if first_ready is not None:
        values.update(startup_and_decoding(requested, first_ready, finished))
    _write_metrics(folder, values)
    return values


def startup_and_decoding(requested: float, first_ready: float, finished: float) -> dict[str, float]:
    """An evaluation's wall time (seconds since the epoch: `requested`, the first actor ready, `finished`) split into
    its start-up and its decoding (`EVAL_STARTUP_S`, `EVAL_DECODE_S`)."""
    ready = min(max(first_ready, requested), finished)  # another node's clock may be a little off
    return {EVAL_STARTUP_S: ready - requested, EVAL_DECODE_S: finished - ready}


def _evaluate_pending(config: ExperimentConfig, adapter: Path | None, folder: Path, sets: dict[str, _SetProgress],
                      problems: list[dict[str, Any]], earlier: dict[str, float], values: dict[str, float]) -> float:
    """The problems not yet evaluated, through the actor pool; each set's metrics into `values` (and
    `metrics.json`) as it completes. When the first actor was ready to decode (seconds since the epoch)."""
    first_ready = float("inf")
    dataset = ray.data.from_items(problems).map_batches(
        Evaluator, batch_format="pyarrow",
        batch_size=AUTO_RAY_BATCH if config.eval.batch_size == "auto" else config.eval.batch_size * CALLS_PER_BATCH,
        **_actor_pool(config, adapter),
    )
    with _without_ray_progress_bars():
        for batch in dataset.iter_batches(batch_size=None, batch_format="pyarrow"):
            rows = batch.to_pylist()
            first_ready = min([first_ready, *(row["ready_at"] for row in rows)])
            for name, progress in sets.items():
                mine = [row for row in rows if row["dataset"] == name]
                if not mine:
                    continue
                progress.add(mine)
                progress.show(config.name)
                if len(progress.predictions) == progress.expected:
                    values.update(progress.finish(folder, earlier))
                    _write_metrics(folder, values)
    return first_ready


def _write_metrics(folder: Path, values: dict[str, float]) -> None:
    write_text_atomic(folder / METRICS_FILE, json.dumps(values, indent=1, sort_keys=True) + "\n")


@dataclass
class EvalResult:
    metrics: dict[str, float]
    folder: Path
    """Holds `predictions/<set>.jsonl` and `metrics.json`."""
    run_id: str
    """The MLflow run the metrics and files were logged to."""


def run_evaluation(
    config: ExperimentConfig,
    adapter_folder: str | Path | None = None,
    tracked_run: TrackedRun | None = None,
    step: int = 0,
    folder: Path | None = None,
) -> EvalResult:
    """Evaluate `config`'s model on `eval.sets` x `eval.decodings` and log the results to MLflow.

    `adapter_folder`: the adapter to merge into the base model (default: `resolve_adapter(config)`, which gives none for
    few-shot prompting). `tracked_run`: log into this run (a training run, a Tune trial's run) at `step`; else a run
    `<name>/eval` of its own is made and ended. `folder`: where the predictions and metrics go (default: the run
    folder's `eval/`). Joins Ray, or starts it locally, only when Ray is not up.
    """
    adapter = Path(adapter_folder) if adapter_folder is not None else resolve_adapter(config)
    folder = folder if folder is not None else eval_folder(config)
    if tracked_run is not None:
        return _evaluate_into(config, adapter, tracked_run, step, folder)
    run = start_run(config.tracking, f"{config.name}/eval")
    with run.ended_on_exit():
        run.log_config(config)
        return _evaluate_into(config, adapter, run, step, folder)


def _evaluate_into(config: ExperimentConfig, adapter: Path | None, run: TrackedRun, step: int,
                   folder: Path) -> EvalResult:
    """Evaluate into `folder`, log the metrics at `step`, and the folder as the run's `eval` artifacts (also after a
    failure: the predictions made so far)."""
    try:
        init_ray()
        with user_errors_surfaced():
            values = evaluate_on_ray(config, adapter, folder)
        run.log_metrics(step, values)
    finally:
        if folder.is_dir():
            run.log_artifacts(folder, EVAL_DIR)
    return EvalResult(values, folder, run.run_id)


def print_results(result: EvalResult, logs: Path | None = None, tracking_uri: str | None = None) -> None:
    """The results table, where the predictions and logs are, the MLflow run and how to browse it."""
    lines = [results_table(result.metrics), f"predictions:  {result.folder / PREDICTIONS_DIR} ({METRICS_FILE} beside)"]
    if logs is not None:
        lines.append(f"logs:         {logs}")
    lines.append(f"MLflow:       run {result.run_id}")
    if tracking_uri is not None:
        lines.append(f"browse:       mlflow ui --backend-store-uri {tracking_uri}")
    console.result("\n".join(lines))
