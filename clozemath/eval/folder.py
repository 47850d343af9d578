"""An evaluation into a folder: every set with each of its decodings, whatever makes the predictions (a Ray Data
actor pool, `ray_jobs.eval_job`; the training worker's own model, `evaluate_loaded`), with one behaviour for files,
metrics and resuming.

Predictions are appended to `<set>.partial.jsonl` as they arrive (a crash loses nothing that was decoded: the next
evaluation of the same takes them up, and skips the sets finished before), and when a set is complete its
predictions are written in order to `predictions/<set>.jsonl` and its metrics to `metrics.json`; the wall time is
split into the start-up (the request to a model ready to decode) and the decoding.

Ray-free: the caller hands in `Predict`, which turns the problems left into batches of rows.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clozemath import console
from clozemath.config import EvalConfig, ExperimentConfig
from clozemath.data.sources import Problem, fingerprint, read_jsonl
from clozemath.errors import ClozeMathError
from clozemath.eval.evaluate import Prompting, eval_problems, evaluate_batch, prompting
from clozemath.eval.predictions import Prediction, metrics, prediction_from_row, write_predictions
from clozemath.files import write_text_atomic
from clozemath.records import (
    EVAL_DECODE_S,
    EVAL_LOAD_S,
    EVAL_SECONDS,
    EVAL_STARTUP_S,
    METRICS_FILE,
    PROBLEMS_PER_S,
    eval_metric,
    flatten,
    partial_predictions_file,
    predictions_file,
)

if TYPE_CHECKING:
    from clozemath.eval.decoding import DecodeProgress, Engine
    from clozemath.model.load import Loaded

CALLS_PER_BATCH = 4
"""A batch of problems holds this many of decode's batches (`eval.batch_size` prompts each): enough to sort by length
and keep a GPU busy, small enough to spread a set over an actor pool and to show progress."""
AUTO_BATCH = 1024
"""Problems per batch under `eval.batch_size: auto` (decode sizes its own batches inside it)."""
PREDICTION_FIELDS = tuple(field.name for field in fields(Prediction))
SECONDS, READY_AT, LOAD_S = "seconds", "ready_at", "load_s"
"""A row holds a prediction's fields and: the seconds its decoding took (its share of the batch's), when the model
that made it was ready to decode (seconds since the epoch) and how long that model took to load."""

TIMES = (EVAL_SECONDS, EVAL_STARTUP_S, EVAL_DECODE_S, EVAL_LOAD_S)
"""An evaluation's seconds: an evaluation that finds every prediction made keeps those of the one that made them."""
Rows = list[dict[str, Any]]
Take = Callable[[Rows], None]
"""Takes rows (`predict_rows`') as they are made."""
Predict = Callable[[list[Problem], Take], None]
"""Makes the rows of the problems left, each handed to the `Take` as it is made: an actor pool's batches as they come
back, or a model of this process's predictions one by one as their decoding ends (the console's bar moves with them)."""


def problems_per_batch(eval_cfg: EvalConfig) -> int:
    """How many problems a batch of `Predict` holds (the actors' and the worker's alike: the same prompts decode
    together, so the same tokens come out)."""
    return AUTO_BATCH if eval_cfg.batch_size == "auto" else eval_cfg.batch_size * CALLS_PER_BATCH


@dataclass(frozen=True)
class ReadyModel:
    """A model ready to decode an evaluation's sets: the actor's or the worker's."""

    loaded: Loaded
    config: ExperimentConfig
    prompting: Prompting
    ready_at: float
    """When it could decode (seconds since the epoch): an evaluation's start-up ends with the first one's."""
    load_s: float
    """The seconds its loading took (the base model, the adapter merged in)."""
    engine: Engine = "auto"


def set_bar(run: str, set_name: str) -> str:
    """The console's key for the bar of an evaluation set of the run (or `clozemath eval`) named `run`."""
    return f"{run}/evaluation/{set_name}"


def decoding_status(decoding: str, where: DecodeProgress) -> str:
    """What a set's bar says of a batch decoding between its predictions."""
    problems = "problem" if where.running == 1 else "problems"
    return f"{decoding} decoding {where.running} {problems}, token {where.tokens}/{where.max_new_tokens}"


def predict_rows(model: ReadyModel, problems: Sequence[Problem], take: Take) -> None:
    """Decode a batch of problems with every decoding of its set and grade them: one row a prediction, each to `take`
    as soon as its decoding ends (in the order they end), its `SECONDS` the time since the one before. Between
    predictions, where the decoding is goes to its set's bar as its status (`console.status`, from this process,
    whichever it is: an actor's, a training worker's or the driver's)."""
    eval_cfg = model.config.eval
    decodings = {set_cfg.dataset: eval_cfg.decodings_of(set_cfg) for set_cfg in eval_cfg.sets}
    last = time.perf_counter()

    def made(prediction: Prediction) -> None:
        nonlocal last
        now = time.perf_counter()
        row = {**asdict(prediction), SECONDS: now - last, READY_AT: model.ready_at, LOAD_S: model.load_s}
        last = now
        take([row])

    def looked(decoding: str, dataset: str, where: DecodeProgress) -> None:
        console.status(set_bar(model.config.name, dataset), decoding_status(decoding, where))

    for decoding in dict.fromkeys(eval_cfg.decodings):
        chosen = [problem for problem in problems if decoding in decodings[problem.dataset]]
        if chosen:
            evaluate_batch(model.loaded, chosen, decoding, eval_cfg, model.prompting, model.engine, made,
                           partial(looked, decoding))


def predict_here(model: ReadyModel) -> Predict:
    """`Predict` with a model of this process, in the batches an actor pool would get (the same prompts decode
    together), each prediction taken as it is made."""
    def predict(problems: list[Problem], take: Take) -> None:
        size = problems_per_batch(model.config.eval)
        for start in range(0, len(problems), size):
            predict_rows(model, problems[start:start + size], take)

    return predict


@dataclass
class _SetProgress:
    """The predictions of one set as they arrive, and those an earlier evaluation of the same left."""

    name: str
    problems: list[Problem]
    decodings: list[str]
    partial: Path
    predictions: list[Prediction]
    seconds: dict[str, float]
    """Model-seconds of the predictions made now, by decoding."""
    made: dict[str, int]
    """Predictions made now (not restored), by decoding."""
    finished_before: bool = False
    """Its predictions file was complete: nothing to do, nothing to write."""
    held: set[tuple[str, str]] = field(default_factory=set)
    """(problem, decoding) of `predictions`, kept with them: rows arrive one by one, each looked up here."""
    correct: int = 0
    """Of `predictions`, the correct ones (the bar's running accuracy)."""

    @property
    def expected(self) -> int:
        return len(self.problems) * len(self.decodings)

    def pending(self) -> list[Problem]:
        """The problems some decoding of which has no prediction yet."""
        return [problem for problem in self.problems
                if any((problem.id, d) not in self.held for d in self.decodings)]

    def _hold(self, predictions: list[Prediction]) -> None:
        self.predictions.extend(predictions)
        self.held.update((prediction.id, prediction.decoding) for prediction in predictions)
        self.correct += sum(prediction.correct for prediction in predictions)

    def restore(self, folder: Path) -> None:
        """Take up what an earlier evaluation of the same left (`evaluate_into_folder` checks it was): the set's
        complete predictions file, else the predictions appended to its partial file."""
        expected = {(problem.id, decoding) for problem in self.problems for decoding in self.decodings}
        finished = predictions_file(folder, self.name)
        if finished.is_file():
            predictions = read_restored(finished)
            if {(p.id, p.decoding) for p in predictions} == expected and len(predictions) == len(expected):
                self._hold(predictions)
                self.finished_before = True
                return
        kept: dict[tuple[str, str], Prediction] = {}
        for prediction in read_restored(self.partial, cut_tail=True):
            if (prediction.id, prediction.decoding) in expected:
                kept.setdefault((prediction.id, prediction.decoding), prediction)
        self._hold(list(kept.values()))

    def add(self, rows: list[dict]) -> None:
        """Predictions made now (those of a decoding restored before, remade with a problem's others, are dropped)."""
        rows = [row for row in rows if (row["id"], row["decoding"]) not in self.held]
        predictions = [Prediction(**{k: v for k, v in row.items() if k in PREDICTION_FIELDS}) for row in rows]
        write_predictions(self.partial, predictions, append=True)
        self._hold(predictions)
        for row in rows:
            self.seconds[row["decoding"]] += row[SECONDS]
            self.made[row["decoding"]] += 1

    def show(self, label: str) -> None:
        """Move the set's progress bar: predictions made, running accuracy."""
        done = len(self.predictions)
        unit = "problems" if len(self.decodings) == 1 else "predictions"
        accuracy = f"accuracy {self.correct / done:.1%}" if done else "accuracy -"
        console.progress(set_bar(label, self.name), f"[{label}] eval {self.name}", done, self.expected, [accuracy],
                         rate_unit=unit)

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


def read_restored(file: Path, cut_tail: bool = False) -> list[Prediction]:
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


IN_WORKER = "eval.in_worker"
"""Where the predictions are made, not what they are: an evaluation takes up another's whichever made them."""
SOURCE_FILE = "source.json"
"""In an evaluation folder: what its predictions are of (the settings that decide them, the adapter's files). A
later evaluation takes them up (a killed one's, a set finished before) only when it is of the same."""


def _source(config: ExperimentConfig, adapter: Path | None) -> dict[str, object]:
    """The settings, the adapter's files, and the kernels a model loaded for inference on a GPU decodes with
    (`INFERENCE_LEVERS`: a change of them changes bf16 tokens, so one set's predictions never mix two)."""
    from clozemath.model.speed import INFERENCE_LEVERS

    settings = {key: value for key, value in flatten(config).items()
                if not key.startswith(("train.", "tracking.")) and key not in ("name", IN_WORKER)}
    files = [] if adapter is None else sorted(path for path in adapter.rglob("*") if path.is_file())
    return {"settings": settings, "adapter": None if adapter is None else fingerprint(files),
            "gpu_kernels": INFERENCE_LEVERS.describe()}


def _read_json(file: Path) -> object:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _take_up(sets: dict[str, _SetProgress], folder: Path, source: dict[str, object]) -> dict[str, float]:
    """Restore what an earlier evaluation of the same left in `folder`, else start afresh there (what another left is
    removed); the metrics the earlier one wrote (for the speeds of sets finished then)."""
    if _read_json(folder / SOURCE_FILE) == json.loads(json.dumps(source, default=str)):
        for progress in sets.values():
            progress.restore(folder)
        earlier = _read_json(folder / METRICS_FILE)
        return earlier if isinstance(earlier, dict) else {}
    # every file of the other source goes before the new source is written: a set it finished, kept until this one
    # rewrote it, would be taken up as this source's by an evaluation after this one is killed
    for progress in sets.values():
        progress.partial.unlink(missing_ok=True)
        predictions_file(folder, progress.name).unlink(missing_ok=True)
    (folder / METRICS_FILE).unlink(missing_ok=True)
    write_text_atomic(folder / SOURCE_FILE, json.dumps(source, indent=1, sort_keys=True, default=str) + "\n")
    return {}


def evaluate_into_folder(config: ExperimentConfig, adapter: Path | None, folder: Path, predict: Predict,
                         requested: float | None = None) -> dict[str, float]:
    """Evaluate every set with every decoding (`predict` makes the predictions); write predictions and
    `metrics.json` under `folder`; the metrics (`eval/<set>/<decoding>/{accuracy,correct,total,problems_per_s}`).
    What an earlier evaluation of the same (model, adapter, settings) left there is taken up: its finished sets are
    not evaluated again, nor the predictions a killed one had appended; its seconds (`EVAL_SECONDS`, from
    `requested`, default now), those it took to start (`EVAL_STARTUP_S`, of which loading the model `EVAL_LOAD_S`)
    and to decode (`EVAL_DECODE_S`) when it had problems left; when it had none, those of the evaluation that made
    the predictions (one in the training worker: the driver's evaluation after it finds them all)."""
    requested = time.time() if requested is None else requested
    sets = _sets(config, folder)
    if not any(progress.problems for progress in sets.values()):
        raise ClozeMathError("eval.sets: no problems to evaluate")
    earlier = _take_up(sets, folder, _source(config, adapter))
    values: dict[str, float] = {}
    problems = [problem for progress in sets.values() for problem in progress.pending()]
    console.phase(f"[{config.name}] {'evaluating' if problems else 'evaluated before, taken up'}: " + ", ".join(
        f"{name} ({len(progress.problems)} problems, {'/'.join(progress.decodings)}"
        + (f"; {len(progress.predictions)} predictions from before" if progress.predictions and problems else "")
        + ")" for name, progress in sets.items()
    ))
    for progress in sets.values():
        if problems:  # the bars' clocks start now: a rate counts the whole evaluation, model loading too
            progress.show(config.name)
        if len(progress.predictions) == progress.expected:
            values.update(progress.finish(folder, earlier))
    write_metrics(folder, values)
    if problems:
        intake = _Intake(config, folder, sets, earlier, values, requested)
        predict(problems, intake.take)
        first = intake.first
        finished = time.time()
        values[EVAL_SECONDS] = finished - requested  # its sets read, its start-up and its decoding
        values.update(startup_and_decoding(requested, first[READY_AT], finished))
        values[EVAL_LOAD_S] = min(first[LOAD_S], values[EVAL_STARTUP_S])
    elif isinstance(earlier.get(EVAL_SECONDS), (int, float)):  # all made before (in the training worker, say)
        values.update({key: earlier[key] for key in TIMES if isinstance(earlier.get(key), (int, float))})
    else:
        values[EVAL_SECONDS] = time.time() - requested
    write_metrics(folder, values)
    return values


def startup_and_decoding(requested: float, first_ready: float, finished: float) -> dict[str, float]:
    """An evaluation's wall time (seconds since the epoch: `requested`, the first model ready, `finished`) split into
    its start-up and its decoding (`EVAL_STARTUP_S`, `EVAL_DECODE_S`)."""
    ready = min(max(first_ready, requested), finished)  # another node's clock may be a little off
    return {EVAL_STARTUP_S: ready - requested, EVAL_DECODE_S: finished - ready}


class _Intake:
    """Takes in the rows of the problems not yet evaluated as they come (`take`, a `Take`): each set's predictions
    appended to its partial file and its bar moved, its metrics into `values` (and `metrics.json`) as it completes."""

    def __init__(self, config: ExperimentConfig, folder: Path, sets: dict[str, _SetProgress],
                 earlier: dict[str, float], values: dict[str, float], requested: float) -> None:
        self.config, self.folder, self.sets, self.earlier, self.values = config, folder, sets, earlier, values
        self.requested = requested
        self.first: dict[str, Any] = {READY_AT: float("inf"), LOAD_S: 0.0}
        """The row of the model first ready to decode (its `READY_AT`, `LOAD_S`)."""
        self.shown = False

    def take(self, rows: Rows) -> None:
        for row in rows:
            if row[READY_AT] < self.first[READY_AT]:
                self.first = {READY_AT: row[READY_AT], LOAD_S: row[LOAD_S]}
        if not self.shown and rows:
            self.shown = True
            console.phase(f"[{self.config.name}] evaluation: a model was ready to decode "
                          f"{max(0.0, self.first[READY_AT] - self.requested):.1f} s after the request "
                          f"(its loading {self.first[LOAD_S]:.1f} s of them)")
        for name, progress in self.sets.items():
            mine = [row for row in rows if row["dataset"] == name]
            if not mine:
                continue
            progress.add(mine)
            progress.show(self.config.name)
            if len(progress.predictions) == progress.expected:
                self.values.update(progress.finish(self.folder, self.earlier))
                write_metrics(self.folder, self.values)


def write_metrics(folder: Path, values: dict[str, float]) -> None:
    write_text_atomic(folder / METRICS_FILE, json.dumps(values, indent=1, sort_keys=True) + "\n")


def evaluates_in_worker(config: ExperimentConfig) -> bool:
    """Whether a trial is evaluated in its training worker (`eval.in_worker`): one worker holds the whole model
    (ZeRO-3 spreads it, over one card too: the worker checks the stage it resolved), it trains the adapter that is
    evaluated (not `eval.adapter`'s) in the fine-tuned format (a few-shot evaluation is of the base model)."""
    return (config.eval.in_worker == "auto" and bool(config.eval.sets) and config.method.trains
            and config.train.num_workers == 1 and config.train.zero_stage != 3 and config.eval.adapter is None
            and not prompting(config).few_shot)


def evaluate_trained(config: ExperimentConfig, trained: Loaded, adapter: Path, folder: Path) -> dict[str, float]:
    """`evaluate_into_folder` with the model a training worker has just trained (its optimizer gone, its layers
    uncompiled), made the model an evaluation actor loads from `adapter` (`trained_for_inference`) once the sets are
    read, as an actor starts once they are: the same predictions and metrics, less the actor's start and the second
    model load. `trained` is spent."""
    from clozemath.model.load import trained_for_inference

    def predict(problems: list[Problem], take: Take) -> None:
        merging = time.time()
        loaded = trained_for_inference(config.model, trained, adapter)
        ready_at = time.time()
        predict_here(ReadyModel(loaded, config, prompting(config), ready_at, ready_at - merging))(problems, take)

    console.phase(f"[{config.name}] evaluating in the training worker (the model it trained, the adapter merged)")
    return evaluate_into_folder(config, adapter, folder, predict)
