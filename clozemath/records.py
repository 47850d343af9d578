"""The names a run leaves behind, in one place: its folder's layout, its MLflow metric keys, tags and params.

Writers (training, evaluation, the grid) and readers (the summary, `clozemath report`) go through this module, so
that a name cannot drift between them. Committed results and users' MLflow stores depend on every string here:
change none of them.
"""

from __future__ import annotations

import ast
import fcntl
import hashlib
import json
import os
import socket
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from clozemath.config import ExperimentConfig
from clozemath.errors import ClozeMathError
from clozemath.files import check_writable_folder, write_text_atomic

# --------------------------------------------------------------------------------------------------------------
# The run folder: `<train.output_dir>/<experiment name>/` and its neighbours under `train.output_dir`

ADAPTER_DIR = "adapter"
"""The LoRA adapter and special-token rows: in the run folder, in every checkpoint, among the MLflow artifacts."""
EVAL_DIR = "eval"
"""`predictions/<set>.jsonl` and `metrics.json` (also the MLflow artifact folder)."""
PREDICTIONS_DIR = "predictions"
METRICS_FILE = "metrics.json"
LOGS_DIR = "logs"
"""The log files of the command that ran: what its own process printed, and what Ray's workers printed."""
DRIVER_LOG, WORKERS_LOG = "driver.log", "workers.log"
RAY_TRAIN_DIR = "ray"
"""Ray Train's runs and checkpoints, unless `train.storage` puts them elsewhere."""
CACHE_DIR = "cache"
"""Under `train.output_dir`: preprocessed token ids, shared by the runs that make the same ones."""
TUNE_DIR = "tune"
"""Under `train.output_dir`: the grids' Tune experiments."""
COMPILE_CACHE_DIR = "compile_cache"
"""Under `train.output_dir`: torch.compile's artifacts, shared by every trial and node of a grid (the default of
`train.compile_cache`)."""
PREDICTIONS_ARTIFACTS = f"{EVAL_DIR}/{PREDICTIONS_DIR}"
"""Where a run's predictions files are among its MLflow artifacts."""
REPORT_DIR = "report"
"""In a grid's folder, and among its grid run's MLflow artifacts: `clozemath report` of the grid, made as it ends."""
CONFIG_ARTIFACT = "config.yaml"
GRID_ARTIFACT = "grid.yaml"
RUN_RECORD = "run.json"
"""In a run's folder (a grid's: the folder of its trials' folders): the fingerprint of the config it belongs to."""
RUN_LOCK = "run.lock"
"""In a run's folder: locked (and naming its process) while a command runs in it."""


def run_folder(config: ExperimentConfig) -> Path:
    """`<train.output_dir>/<experiment name>`: the run's output folder."""
    return Path(config.train.output_dir) / config.name


def eval_folder(config: ExperimentConfig) -> Path:
    return run_folder(config) / EVAL_DIR


def compile_cache_folder(config: ExperimentConfig) -> Path:
    """`train.compile_cache`, else `compile_cache/` under `train.output_dir`."""
    return Path(config.train.compile_cache or Path(config.train.output_dir) / COMPILE_CACHE_DIR)


EVALS_DIR = "evals"
"""Under `train.output_dir`: a folder per `clozemath eval` of a config, apart from its run's (`evaluation_folder`)."""


def evaluation_folder(config: ExperimentConfig, inputs: RunInputs) -> Path:
    """`<train.output_dir>/evals/<name>-<key>`: where `clozemath eval` of `config` writes (its predictions in `eval/`,
    its logs), never in the run's own folder. The key hashes the config and its inputs (the adapter's files among
    them): the same evaluation again finds its folder, another gets one of its own."""
    record = run_record([config], inputs)
    key = hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()[:10]
    return Path(config.train.output_dir).resolve() / EVALS_DIR / f"{config.name}-{key}"


def cache_folder(output_dir: str) -> Path:
    """`<train.output_dir>/cache`: where a run's training sets are prepared (`ray_jobs.preprocess`)."""
    return Path(output_dir).resolve() / CACHE_DIR


def grid_folder(output_dir: str, grid: str) -> Path:
    """`<train.output_dir>/<grid>`: an experiment's run folder, or the folder of a grid's trials' run folders."""
    return Path(output_dir).resolve() / grid


def flatten(config: BaseModel | dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys -> scalar values (lists become their string form): a config's MLflow params and its record."""
    data = config.model_dump() if isinstance(config, BaseModel) else config
    flat: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{dotted}."))
        else:
            flat[dotted] = value if isinstance(value, (int, float, str, bool, type(None))) else str(value)
    return flat


def readable_params(config: BaseModel) -> dict[str, str]:
    """A config's MLflow params, as a person reads them in the UI's columns and compare view: dotted keys, scalars as
    `flatten` writes them (`True`, `None`, `0.001`), lists of plain values as `beam, cot`, a list of settings
    (`eval.sets`) as the names it holds (`gsm8k, gsm_p1`) with each one's settings under its name
    (`eval.sets.gsm8k.limit`) or, unnamed, its position (`method.shapes.0.length`). No Python reprs."""
    return _readable(config.model_dump(), "")


_NAME_KEYS = ("dataset", "name")
"""The field that names an item of a list of settings (an evaluation set by its dataset)."""


def _readable(data: dict[str, Any], prefix: str) -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_readable(value, f"{dotted}."))
        elif isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
            name_key = next((k for k in _NAME_KEYS if all(isinstance(item.get(k), str) for item in value)), None)
            names = [item[name_key] for item in value] if name_key else []
            if name_key and len(set(names)) == len(names):
                flat[dotted] = ", ".join(names)
                for name, item in zip(names, value):
                    flat.update(_readable({k: v for k, v in item.items() if k != name_key}, f"{dotted}.{name}."))
            else:
                for index, item in enumerate(value):
                    flat.update(_readable(item, f"{dotted}.{index}."))
        elif isinstance(value, (list, tuple)):
            flat[dotted] = ", ".join(map(str, value)) or "(none)"
        else:
            flat[dotted] = str(value)
    return flat


# --------------------------------------------------------------------------------------------------------------
# Which config a run folder belongs to, and which command runs in it


@dataclass(frozen=True)
class RunInputs:
    """What a run's results depend on besides its settings (`clozemath.plan.run_inputs`)."""

    data: dict[str, str]
    """Each file it reads problems from, by what it is (`training set gsm8k/train`): where it is and a hash of it."""
    code: dict[str, str]
    """A hash of each module that makes its training samples, by module (empty where nothing trains)."""

    def changes(self, old: dict[str, Any]) -> list[str]:
        """What differs from the inputs recorded as `old` (`{"data": ..., "code": ...}`), in words."""
        found = [f"{what}: its data changed" for what in sorted(self.data) if old.get("data", {}).get(what,
                 self.data[what]) != self.data[what]]
        code = sorted(module for module in self.code if old.get("code", {}).get(module, self.code[module])
                      != self.code[module])
        if code:
            found.append(f"the code that makes the training samples changed ({', '.join(code[:2])})")
        return found


def run_record(experiments: Iterable[ExperimentConfig], inputs: RunInputs) -> dict[str, object]:
    """The fingerprint of a run's configs (every setting of every trial), the settings themselves and its inputs."""
    settings = {experiment.name: flatten(experiment) for experiment in experiments}
    text = json.dumps(settings, sort_keys=True, default=str)
    fingerprint = hashlib.sha256(text.encode()).hexdigest()[:16]
    return {"fingerprint": fingerprint, "settings": settings, "inputs": {"data": inputs.data, "code": inputs.code}}


def _holds_work(folder: Path) -> bool:
    """Whether a run folder (or a trial's folder in it) holds an adapter, checkpoints or an evaluation."""
    outputs = (ADAPTER_DIR, EVAL_DIR, RAY_TRAIN_DIR)
    return any((folder / name).exists() or any(folder.glob(f"*/{name}")) for name in outputs)


def _as_path(value: object) -> Path | None:
    """A setting that reads as a local path (or a local store's URI), resolved; else None."""
    if not isinstance(value, str) or not value:
        return None
    for scheme in ("sqlite:///", "file://"):
        if value.startswith(scheme):
            value = value.removeprefix(scheme)
    return None if "://" in value else Path(value).expanduser().resolve()


def _same_setting(old: object, new: object) -> bool:
    """Equal, or two spellings of one path (`./runs` and its absolute path), or a list of settings recorded before a
    newer clozemath gave its items a field that is off (`None`: an evaluation set's `ids`)."""
    if old == new or (_as_path(old) is not None and _as_path(old) == _as_path(new)):
        return True
    if not (isinstance(old, str) and isinstance(new, str)):
        return False
    try:
        old_value, new_value = ast.literal_eval(old), ast.literal_eval(new)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return False
    return _without_fields_added_off(new_value, old_value) == old_value


def _without_fields_added_off(new: object, old: object) -> object:
    """`new` less the `None` fields its dicts hold where `old`'s do not (item by item in lists)."""
    if isinstance(new, dict) and isinstance(old, dict):
        return {key: _without_fields_added_off(value, old.get(key)) for key, value in new.items()
                if key in old or value is not None}
    if isinstance(new, list) and isinstance(old, list) and len(new) == len(old):
        return [_without_fields_added_off(n, o) for n, o in zip(new, old)]
    return new


def _changes(old: dict[str, dict[str, object]], new: dict[str, dict[str, object]]) -> str:
    """The first few settings that differ between two runs' configs, as `key: old -> new`; empty if none."""
    if old.keys() != new.keys():
        gone, added = sorted(old.keys() - new.keys()), sorted(new.keys() - old.keys())
        return "; ".join(part for part in (f"trials gone: {', '.join(gone[:2])}" if gone else "",
                                           f"trials added: {', '.join(added[:2])}" if added else "") if part)
    for name in new:
        keys = sorted(key for key in old[name].keys() | new[name].keys()
                      if not _same_setting(old[name].get(key), new[name].get(key)))
        if keys:
            shown = ", ".join(f"{key}: {old[name].get(key)!r} -> {new[name].get(key)!r}" for key in keys[:3])
            return shown + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
    return ""


def _held_record(file: Path, folder: Path) -> dict[str, Any] | None:
    """The record in `file` (None where there is none); a damaged one (not JSON, not a record, a folder in its
    place) is an error naming it while the folder holds work, else it is replaced."""
    if not file.exists() and not file.is_symlink():
        return None
    problem = None
    try:
        held = json.loads(file.read_text(encoding="utf-8"))
        if not _is_record(held):
            problem = "not a run record"
    except IsADirectoryError:
        problem = "a folder, not a file"
    except UnicodeDecodeError:
        problem = "not text"
    except ValueError:
        problem = "not JSON"
    except OSError as exc:
        problem = f"cannot be read ({exc.strerror})"
    if problem is None:
        return held
    if _holds_work(folder) or file.is_dir():
        raise ClozeMathError(
            f"{file}: damaged ({problem}), so which config this folder's run belongs to is unknown: if it is this "
            f"config's, remove {file} and run again (it is recorded afresh); else give this run a folder of its own "
            "with name=<new name>"
        )
    return None


def _is_record(held: object) -> bool:
    """A dict of a run's settings by trial, and of its inputs (if recorded) by kind."""
    if not isinstance(held, dict):
        return False
    settings, inputs = held.get("settings"), held.get("inputs") or {}
    return (isinstance(settings, dict) and all(isinstance(trial, dict) for trial in settings.values())
            and isinstance(inputs, dict) and all(isinstance(inputs.get(kind, {}), dict) for kind in ("data", "code")))


def claim_run_folder(folder: Path, experiments: list[ExperimentConfig], inputs: RunInputs) -> None:
    """Record in `folder` the config its run belongs to and its inputs (the data it reads, the code that makes its
    samples); refuse a config or inputs that differ from the ones recorded there while the folder holds that run's
    work (adapter, checkpoints, predictions), so that it is never overwritten, nor resumed on other data. Paths
    compare resolved. A folder of a run from before the record existed is taken as this config's, one from before
    inputs were recorded as made from these."""
    record = run_record(experiments, inputs)
    file = folder / RUN_RECORD
    held = _held_record(file, folder)
    if held is not None and _holds_work(folder):
        settings = held["settings"]
        changed = _changes(settings, record["settings"])
        changed_inputs = inputs.changes(held.get("inputs") or {})
        if changed or changed_inputs:
            other_trials = settings.keys() != record["settings"].keys()
            own_folder = ("give the new trials a folder of their own with train.output_dir=<folder> (`clozemath report "
                          "--parent` twice reports both grid runs as one)" if other_trials
                          else "give this one a folder of its own with name=<new name>")
            if changed:
                raise ClozeMathError(f"{folder} holds the run of another config ({changed}): it is left as it is; "
                                     f"{own_folder}, or run the config it holds")
            raise ClozeMathError(f"{folder} holds a run made from other inputs ({'; '.join(changed_inputs[:2])}): it is "
                                 f"left as it is; {own_folder} to run on these")
    write_text_atomic(file, json.dumps(record, indent=1, sort_keys=True, default=str) + "\n")


@contextmanager
def run_lock(folder: Path) -> Iterator[None]:
    """Hold `folder` for this command: a second command on it is refused at once, naming the process that holds
    it. The lock is the kernel's (`flock`) on the folder itself, held through an open descriptor: it ends with its
    process, however that ends (a lock left by a killed run is never in the way), and removing a file cannot lift
    it. `run.lock` names the holder (pid, host) while it is held."""
    folder.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ClozeMathError(
                f"{folder}: another run is live in this folder ({_lock_holder(folder)}); wait for it to end, or give "
                "this one a folder of its own with name=<new name>"
            ) from None
        holder = folder / RUN_LOCK
        _name_holder(holder)
        try:
            yield
        finally:
            holder.unlink(missing_ok=True)
    finally:
        os.close(descriptor)


def _name_holder(file: Path) -> None:
    """Write this process into `file` (who holds the lock); a folder or a file in its place that cannot be written
    is an error naming it."""
    try:
        if file.is_dir():
            raise IsADirectoryError(21, "a folder in its place")
        write_text_atomic(file, f"pid {os.getpid()} on {socket.gethostname()}\n")
    except OSError as exc:
        raise ClozeMathError(f"{file}: cannot be written ({exc.strerror}): remove it and run again") from None


def _lock_holder(folder: Path) -> str:
    """Who holds the folder's lock, as `run.lock` names it (if it can be read)."""
    try:
        with open(folder / RUN_LOCK, encoding="utf-8", errors="replace") as file:
            text = file.read(200).strip()
    except OSError:
        text = ""
    return text if text.startswith("pid ") else "another process"


def check_run_outputs(experiments: Iterable[ExperimentConfig]) -> None:
    """Every folder a run writes (its output folder, a local tracking store and its artifacts) can be written."""
    for experiment in experiments:
        check_writable_folder(experiment.train.output_dir, "train.output_dir")
        output_dir, run = Path(experiment.train.output_dir), run_folder(experiment)
        grid = output_dir / Path(experiment.name).parts[0]  # a grid's trials' folders are in the grid's
        for folder in (run / EVAL_DIR / PREDICTIONS_DIR, run / ADAPTER_DIR, run / LOGS_DIR, grid / LOGS_DIR,
                       output_dir / CACHE_DIR, output_dir / TUNE_DIR):
            check_writable_folder(folder, "train.output_dir")
        if experiment.train.storage is not None and "://" not in experiment.train.storage:
            check_writable_folder(experiment.train.storage, "train.storage")
        if experiment.train.compile_cache is not None:
            check_writable_folder(experiment.train.compile_cache, "train.compile_cache")
        tracking = experiment.tracking
        locations = (("tracking.uri", tracking.uri), ("tracking.artifact_location", tracking.artifact_location))
        for key, location in locations:
            folder = _local_folder(location)
            if folder is not None:
                check_writable_folder(folder, f"{key} '{location}'")


def _local_folder(location: str | None) -> Path | None:
    """The folder a local store or artifact location writes in (a SQLite file's folder); None for a remote one."""
    if location is None:
        return None
    if location.startswith("sqlite:///"):
        return Path(location.removeprefix("sqlite:///")).parent
    if location.startswith("file://"):
        return Path(location.removeprefix("file://"))
    return None if "://" in location else Path(location)


def predictions_file(eval_dir: Path, set_name: str) -> Path:
    return eval_dir / PREDICTIONS_DIR / f"{set_name}.jsonl"


def partial_predictions_file(eval_dir: Path, set_name: str) -> Path:
    """Predictions appended as they stream in, before the set is complete."""
    return eval_dir / PREDICTIONS_DIR / f"{set_name}.partial.jsonl"


# --------------------------------------------------------------------------------------------------------------
# Metric keys

TRAIN_METRICS = ("train/loss", "train/lr", "train/tokens_per_s", "train/pad_share", "train/seconds",
                 "train/peak_memory_gib", "train/grad_norm", "train/tokens", "train/trained_tokens", "train/epoch")
"""What every training step logs; also `train/mfu` on a card whose bf16 peak is known (`clozemath.train.flops`)."""
TRAIN_PREFIX = "train"
EVAL_PREFIX = "eval"
"""`eval/<set>/<decoding>/<stat>`: an evaluation after (or without) training."""
CURVE_PREFIX = "curve"
"""`curve/<set>/<decoding>/<stat>`: an evaluation during training, a point per `eval.every_steps` (or
`eval.every_share`)."""
EVAL_SECONDS = f"{EVAL_PREFIX}/seconds"
"""An evaluation's wall time, from its request (its sets read) to its last prediction: `EVAL_STARTUP_S` and
`EVAL_DECODE_S` add up to it."""
EVAL_STARTUP_S = f"{EVAL_PREFIX}/startup_s"
"""Of an evaluation's wall time, from its request to the first model ready to decode (an actor started, its model
loaded; or the training worker's model, its adapter merged: `eval.in_worker`); an engine that captures its graphs as
it decodes counts that as decoding."""
EVAL_DECODE_S = f"{EVAL_PREFIX}/decode_s"
"""Of an evaluation's wall time, from the first model ready to decode to the last prediction in."""
EVAL_LOAD_S = f"{EVAL_PREFIX}/load_s"
"""Of `EVAL_STARTUP_S`, the seconds the first model ready took to load (the base model, the adapter merged in); the
rest is the actor's start (Ray Data's pipeline, its scheduling, the process and its imports). An evaluation in the
training worker (`eval.in_worker`) has only this: its model is the one it trained, its adapter merged."""
ACCURACY, CORRECT, TOTAL = "accuracy", "correct", "total"
CUT_SHARE, PROBLEMS_PER_S = "cut_share", "problems_per_s"
STRICT_ACCURACY, FLEXIBLE_ACCURACY = "strict_accuracy", "flexible_accuracy"
"""Accuracy counting only answers where the format marks them (`####`, `\\boxed{}`; lm-evaluation-harness's
strict-match for base models), and counting the last-number fallback too (the harness's flexible-extract)."""
UNCUT_ACCURACY, FALLBACK_SHARE = "uncut_accuracy", "fallback_share"
"""Accuracy over the generations that ended before `max_new_tokens`; the share of answers the fallback found."""
LENIENT_ACCURACY = "lenient_accuracy"
"""Accuracy had the last-number fallback read generations cut at `max_new_tokens` too (the rule before 2026-12-02,
kept beside `accuracy` to show what the cut rule changed)."""


def train_metric(name: str) -> str:
    return f"{TRAIN_PREFIX}/{name}"


def eval_metric(set_name: str, decoding: str, stat: str, prefix: str = EVAL_PREFIX) -> str:
    return f"{prefix}/{set_name}/{decoding}/{stat}"


@dataclass(frozen=True)
class EvalMetric:
    prefix: str
    set_name: str
    decoding: str
    stat: str

    @property
    def measured(self) -> str:
        """`gsm8k/beam`: what it measured, as the console names it."""
        return f"{self.set_name}/{self.decoding}"


def is_eval_metric(key: str) -> bool:
    return key.startswith(f"{EVAL_PREFIX}/")


def is_curve_metric(key: str) -> bool:
    return key.startswith(f"{CURVE_PREFIX}/")


def is_step_metric(key: str) -> bool:
    """A metric logged at every training step, or at a step that evaluated during training."""
    return key.startswith((f"{TRAIN_PREFIX}/", f"{CURVE_PREFIX}/"))


def parse_eval_metric(key: str) -> EvalMetric | None:
    """The parts of an `eval/...` or `curve/...` key; None for any other metric."""
    parts = key.split("/")
    if len(parts) != 4 or parts[0] not in (EVAL_PREFIX, CURVE_PREFIX):
        return None
    return EvalMetric(*parts)


def tally_metrics(
    set_name: str, decoding: str, correct: float, total: float, prefix: str = EVAL_PREFIX
) -> dict[str, float]:
    """Accuracy, correct and total of one set and decoding."""
    return {
        eval_metric(set_name, decoding, ACCURACY, prefix): correct / total if total else 0.0,
        eval_metric(set_name, decoding, CORRECT, prefix): correct,
        eval_metric(set_name, decoding, TOTAL, prefix): total,
    }


def headline_metric(config: ExperimentConfig) -> str | None:
    """The accuracy shown first: the first evaluation set's, with its first decoding (None without sets)."""
    first = config.eval.first_evaluation()
    return None if first is None else eval_metric(first[0].dataset, first[1], ACCURACY)


HEADLINE_PERCENT = "accuracy_pct"
"""A trial's headline accuracy (`headline_metric`) in percent, under a name short enough for the MLflow UI's column
header; the run's `HEADLINE_TAG` says what it measured (`gsm8k/beam`)."""


def headline_percent(config: ExperimentConfig, metrics: dict[str, float]) -> dict[str, float]:
    """`{HEADLINE_PERCENT: 41.2}` from the run's evaluation metrics (empty when it measured no headline)."""
    key = headline_metric(config)
    return {HEADLINE_PERCENT: 100 * metrics[key]} if key in metrics else {}


# --------------------------------------------------------------------------------------------------------------
# MLflow tags

PARENT_TAG = "mlflow.parentRunId"
NOTE_TAG = "mlflow.note.content"
"""A run's or an experiment's description, as the MLflow UI shows and edits it (markdown)."""
EXPERIMENT_KIND_TAG, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"
"""An experiment's kind as the MLflow UI reads it (3.x: `custom_model_development` or `genai_development`): ours are
model-training experiments, whose page is the runs table."""
ROLE_TAG = "role"
GRID_ROLE, TRIAL_ROLE = "grid", "trial"
OPENING_TAG = "opening"
"""How many times a run has been opened: absent when started (1), bumped by each driver that reopens it to log on
(`tracking.reopen_run`); a process of an earlier opening no longer ends it."""
GRID_TAG, GRID_KEY_TAG, TRIAL_TAG = "grid", "grid_key", "trial"
MODEL_TAG, METHOD_TAG, TRAIN_SET_TAG, SEED_TAG = "model", "method", "train_set", "seed"
ABLATION_TAG, LR_TAG, HEADLINE_TAG = "ablation", "lr", "accuracy_of"
"""A trial's row in the paper's tables (`ClozeMath`, `W/o PrefixLM`), its learning rate (trained methods only), and
what its `HEADLINE_PERCENT` measured: labels for the MLflow UI's columns, which `clozemath report` does not read."""


def trial_tags(config: ExperimentConfig, grid: str) -> dict[str, str]:
    """A grid trial's run: which grid, which point, the labels `clozemath report` groups by, and those a person
    compares trials by in the MLflow UI."""
    from clozemath.report.names import METHOD_NAMES  # the paper's row names: the report's, one home

    method = config.method.name
    headline = parse_eval_metric(headline_metric(config) or "")
    return {
        GRID_TAG: grid,
        TRIAL_TAG: config.name,
        ROLE_TAG: TRIAL_ROLE,
        MODEL_TAG: config.model.name,
        METHOD_TAG: method,
        TRAIN_SET_TAG: config.data.dataset,
        SEED_TAG: str(config.train.seed),
        ABLATION_TAG: METHOD_NAMES.get(method, method),
        **({LR_TAG: short_number(config.train.lr)} if config.method.trains else {}),
        **({HEADLINE_TAG: headline.measured} if headline is not None else {}),
    }


def short_number(value: float) -> str:
    """`3e-4`, `5e-5`, `0.1`, `2`: a rate as a person writes it."""
    if value != 0 and abs(value) < 1e-2:
        mantissa, exponent = f"{value:.2e}".split("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    return f"{value:g}"


RUN_NAME_SEPARATOR = " · "
SPELLED_AXES = ("model", "method", "dataset")
"""Axes whose values name themselves in a run's name (`clozemath`); any other axis is written `lr 3e-4`."""


def trial_run_names(points: list[dict[str, Any]], grid: str) -> list[str]:
    """Each trial's MLflow run name, by what varies between the grid's points (`points`: each one's axis -> value,
    `plan.grid_points`' labels): the method first, then the other axes whose values differ, the seed last, e.g.
    `clozemath · seed 0`, `it · lr 3e-4 · seed 1`. Short enough for the UI's name column; the full trial name stays
    in the `trial` tag. A grid of one is named by the grid."""
    axes = list(points[0]) if points else []
    varying = [axis for axis in axes if len({repr(point[axis]) for point in points}) > 1]
    short = {axis: axis.split(".")[-1] for axis in axes}
    first = [axis for axis in axes if short[axis] == "method"]
    last = [axis for axis in axes if short[axis] == "seed"]
    shown = first + [axis for axis in varying if axis not in first + last] + last
    names = []
    for point in points:
        parts = [_axis_value(short[axis], point[axis]) for axis in shown]
        names.append(RUN_NAME_SEPARATOR.join(parts) or grid)
    return names


def _axis_value(axis: str, value: Any) -> str:
    text = short_number(value) if isinstance(value, float) else str(value)
    return text if axis in SPELLED_AXES else f"{axis} {text}"


def grid_tags(grid: str, key: str) -> dict[str, str]:
    return {GRID_TAG: grid, GRID_KEY_TAG: key, ROLE_TAG: GRID_ROLE}


# --------------------------------------------------------------------------------------------------------------
# MLflow params beside the config's own (`flatten`)

PLANNED_STEPS, PLANNED_TOKENS = "train.planned_steps", "train.planned_tokens"
"""The optimizer steps and training tokens a trial's budget planned."""
TRAINED_STEPS, TRAINED_TOKENS = "train.trained_steps", "train.trained_tokens"
"""What its training did: the optimizer steps it trained and the real (non-padding) tokens they held, all workers'."""
