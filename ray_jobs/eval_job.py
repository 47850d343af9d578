"""The evaluation job: Ray Data batch inference over the evaluation sets, then files, metrics and MLflow.

Every problem left to evaluate goes into one dataset; `map_batches` sends batches to an actor pool holding one model
per GPU (or a single actor on CPU), and each actor decodes a batch with every decoding of `eval.decodings` and grades
it (`clozemath.eval.folder.predict_rows`), sending its predictions back as their decodings end (a block each time).
The driver streams the predictions into the evaluation's folder (`clozemath.eval.folder.evaluate_into_folder`: files,
metrics, the bar, what an earlier evaluation of the same left).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from functools import partial
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray
from ray.data import ActorPoolStrategy, DataContext

from clozemath import console
from clozemath.config import ExperimentConfig, from_wire, to_wire
from clozemath.data.sources import Problem
from clozemath.eval.evaluate import load_evaluated_model, prompting, resolve_adapter
from clozemath.eval.folder import LOAD_S, READY_AT, SECONDS, ReadyModel, Rows, Take, evaluate_into_folder, \
    predict_rows, problems_per_batch
from clozemath.eval.predictions import Prediction, results_table
from clozemath.model.memory import share_gpu
from clozemath.records import EVAL_DIR, METRICS_FILE, PREDICTIONS_DIR, eval_folder
from clozemath.tasks.harness import FILTERS as HARNESS_FILTERS
from clozemath.tracking import TrackedRun, start_run
from ray_jobs.cluster import init_ray, user_errors_surfaced

_PREDICTION_TYPES = {
    "id": pa.string(), "dataset": pa.string(), "decoding": pa.string(), "prompt": pa.string(),
    "generation": pa.string(), "extracted": pa.string(), "gold": pa.string(), "correct": pa.bool_(),
    "confidence": pa.float64(), "harness": pa.struct([(name, pa.bool_()) for name in HARNESS_FILTERS]),
    "finish_reason": pa.string(), "generated_tokens": pa.int64(), "rule": pa.string(), "lenient": pa.bool_(),
}
SCHEMA = pa.schema([(field.name, _PREDICTION_TYPES[field.name]) for field in fields(Prediction)]
                   + [(SECONDS, pa.float64()), (READY_AT, pa.float64()), (LOAD_S, pa.float64())])
"""A row of `clozemath.eval.folder.predict_rows`: a prediction, the actor-seconds its decoding took, when the actor
that made it was ready to decode and how long its model took to load."""
PACKED = pa.schema([("rows", pa.list_(pa.struct(list(SCHEMA))))])
"""What an actor yields: one row holding the rows made since its last yield, so that Ray Data sends each yield back
as one block of its own (`STREAMED_BLOCK_BYTES`) and never slices it into one block a prediction."""


def packed(rows: Rows) -> pa.Table:
    return pa.Table.from_pylist([{"rows": rows}], schema=PACKED)


def unpacked(batch: pa.Table) -> Rows:
    """The rows of the yields a batch of `PACKED` tables holds, in order."""
    return [row for rows in batch.column("rows").to_pylist() for row in rows]


class Evaluator:
    """A Ray Data actor: one model (on this actor's GPU, else on CPU), built once and
    shared by every set and decoding of each batch of problems."""

    def __init__(self, experiment: dict[str, Any], adapter: Path | None, cpu_threads: int,
                 requested: float | None = None):
        """`requested`: when the evaluation was asked for (seconds since the epoch), for the console's account of
        the actor's start."""
        entered = time.time()
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            torch.set_num_threads(cpu_threads)
        config = from_wire(experiment)
        share_gpu(config.train.gpu_share)
        with_adapter = f" with the adapter {adapter}" if adapter is not None else " (few-shot)"
        started = "" if requested is None else f" (the actor started {max(0.0, entered - requested):.1f} s after the " \
            "request: Ray Data's start, its scheduling, its process and imports)"
        console.phase(f"[{config.name}] loading the model ({config.model.name}) on {device} for evaluation"
                      f"{with_adapter}{started}", once=True)
        loading = time.time()
        loaded = load_evaluated_model(config, adapter, device)
        ready_at = time.time()
        self.model = ReadyModel(loaded, config, prompting(config), ready_at, ready_at - loading)

    @property
    def ready_at(self) -> float:
        return self.model.ready_at

    def __call__(self, batch: pa.Table) -> Iterator[pa.Table]:
        """The batch's rows, those made since the last yield `packed` (Ray Data sends each back as a block)."""
        problems = [Problem(**row) for row in batch.to_pylist()]
        for rows in as_made(partial(predict_rows, self.model, problems)):
            yield packed(rows)


_DONE = object()


def as_made(make: Callable[[Take], object]) -> Iterator[Rows]:
    """The rows `make` hands its `Take` (decoding calls back), as a generator (what Ray Data's batch functions stream
    back): `make` runs in a thread of its own; each item is the rows made since the last one; its error is raised
    here."""
    made: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def run() -> None:
        try:
            make(made.put)
        except BaseException as exc:  # noqa: BLE001 (raised again in the caller's thread)
            made.put(exc)
        else:
            made.put(_DONE)

    threading.Thread(target=run, name="clozemath-predict", daemon=True).start()
    while True:
        items = [made.get()]
        while not made.empty():
            items.append(made.get())
        rows = [row for item in items if isinstance(item, list) for row in item]
        if rows:
            yield rows
        ended = next((item for item in items if not isinstance(item, list)), None)
        if isinstance(ended, BaseException):
            raise ended
        if ended is _DONE:
            return


def _actor_pool(config: ExperimentConfig, adapter: Path | None, requested: float | None = None) -> dict[str, object]:
    """`map_batches` arguments for the actors: one per GPU of the cluster (per `train.gpu_share` of one), else one
    using this machine's cores; `requested`: `Evaluator`'s."""
    resources = ray.cluster_resources()
    share = config.train.gpu_share
    actors = int(resources.get("GPU", 0) / share)
    if actors:  # from one actor up: GPUs that other work (a Tune trial's training) holds join the pool when freed
        pool, threads = {"compute": ActorPoolStrategy(min_size=1, max_size=actors), "num_gpus": share}, 1
    else:
        threads = max(1, min(os.cpu_count() or 1, int(resources.get("CPU", 1)) - 1))
        pool = {"compute": ActorPoolStrategy(size=1), "num_cpus": threads}
    return pool | {"fn_constructor_kwargs": {"experiment": to_wire(config), "adapter": adapter, "cpu_threads": threads,
                                             "requested": requested}}


STREAMED_BLOCK_BYTES = 1
"""The evaluation dataset's `target_max_block_size`: each table an actor yields is a block of its own, sent back as it
comes (Ray Data's default, 128 MiB, gathers a batch's tables into one block, and the bar would wait for the batch).
A yield is one row (`PACKED`), which no target slices: a yield of many rows sliced into one block a prediction (until
2026-12-04) made Ray's handling of each block (~0.1 s) set the pace: Qwen2.5-Coder-1.5B's base model, few-shot on
MATH-500 and GSM-Symbolic beside two training trials on one H200, came back at 9-10 problems/s while the card sat idle;
1,200 few-shot problems of a tiny model on 2 cores took 146 s end to end, 52 s with blocks of 1 MiB. Packed, a yield
holds what the actor made while the last one was on its way, so a fast decoding sends few blocks."""


@contextlib.contextmanager
def _evaluation_context() -> Iterator[None]:
    """Ray Data as the evaluation needs it: no per-operator bars (the driver draws one bar a set; Ray's would only
    interleave with it), and the actors' predictions back as they are made (`STREAMED_BLOCK_BYTES`)."""
    context = DataContext.get_current()
    before = context.enable_progress_bars, context.target_max_block_size
    context.enable_progress_bars, context.target_max_block_size = False, STREAMED_BLOCK_BYTES
    try:
        yield
    finally:
        context.enable_progress_bars, context.target_max_block_size = before


def evaluate_on_ray(config: ExperimentConfig, adapter: Path | None, folder: Path) -> dict[str, float]:
    """`clozemath.eval.folder.evaluate_into_folder` with the predictions of an actor pool on the Ray cluster (which
    must be up)."""
    requested = time.time()

    def on_actors(problems: list[Problem], take: Take) -> None:
        with _evaluation_context():
            dataset = ray.data.from_items([problem.to_dict() for problem in problems]).map_batches(
                Evaluator, batch_format="pyarrow", batch_size=problems_per_batch(config.eval),
                **_actor_pool(config, adapter, requested),
            )
            for batch in dataset.iter_batches(batch_size=None, batch_format="pyarrow"):
                for row in unpacked(batch):  # one by one, as a model of this process hands them over
                    take([row])

    return evaluate_into_folder(config, adapter, folder, on_actors, requested)


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
