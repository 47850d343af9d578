"""`clozemath run CONFIG`: one experiment end to end on Ray (preprocess, train, adapter, MLflow).

`run_experiment` is the unit a grid repeats: it joins whatever Ray is up (a Tune trial's) and can log as the child
of a grid's MLflow run.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from clozemath import tracking
from clozemath.config import ExperimentConfig, load_config
from clozemath.errors import ClozeMathError
from ray_jobs.cluster import init_ray
from ray_jobs.preprocess import Prepared, preprocess
from ray_jobs.train import fit

CACHE_DIR = "cache"


@dataclass(frozen=True)
class RunOutcome:
    run_id: str
    """The experiment's MLflow run."""
    adapter: Path
    prepared: Prepared


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_folder(config: ExperimentConfig) -> Path:
    """`<train.output_dir>/<experiment name>`: the adapter and Ray Train's checkpoints live here."""
    return Path(config.train.output_dir).resolve() / config.name


def run_experiment(
    config: ExperimentConfig, parent_run_id: str | None = None, tags: Mapping[str, str] | None = None
) -> RunOutcome:
    """Preprocess (cached), train on Ray Train, write `<run folder>/adapter`, track it all in MLflow."""
    if not config.method.trains:
        raise ClozeMathError(f"method '{config.method.name}' does not train: evaluate it instead")
    progress(f"[{config.name}] preparing {config.data.dataset}/{config.data.split} for method {config.method.name}")
    prepared = preprocess(config, Path(config.train.output_dir).resolve() / CACHE_DIR)
    kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(prepared.kinds.items()))
    progress(
        f"[{config.name}] {prepared.num_rows} samples ({kinds}; {prepared.dropped_for_length} too long)"
        f"{', from the cache' if prepared.from_cache else ''}"
    )
    init_ray()
    uri = config.tracking.uri
    run_id = tracking.start_run(config.tracking, config.name, parent_run_id, tags)
    succeeded = False
    try:
        tracking.log_config(uri, run_id, config)
        tracking.log_params(uri, run_id, {"data.num_samples": prepared.num_rows, "data.num_sentinels": prepared.num_sentinels})
        with user_errors_surfaced():
            adapter = fit(config, prepared, run_folder(config), run_id)
        tracking.log_artifacts(uri, run_id, adapter, "adapter")
        progress(f"[{config.name}] adapter written to {adapter}")
        # Evaluation of the trained adapter goes here (same run_id), once clozemath.eval lands.
        succeeded = True
    finally:
        tracking.end_run(uri, run_id, succeeded)
    return RunOutcome(run_id=run_id, adapter=adapter, prepared=prepared)


def run_command(config_path: str, overrides: list[str]) -> None:
    config = load_config(config_path, overrides)
    if not isinstance(config, ExperimentConfig):
        raise ClozeMathError(f"{config_path}: a grid; `clozemath run` takes one experiment until the grid runner lands")
    run_experiment(config)


def _user_error(exc: BaseException | None, seen: set[int]) -> ClozeMathError | None:
    """The ClozeMathError a worker raised, looked for through Ray's wrappers (causes, per-worker failures)."""
    if exc is None or id(exc) in seen:
        return None
    seen.add(id(exc))
    if type(exc) is ClozeMathError:
        return exc
    nested = [getattr(exc, "cause", None), getattr(exc, "controller_failure", None), exc.__cause__, exc.__context__]
    nested += list(getattr(exc, "worker_failures", {}).values())
    for inner in nested:
        found = _user_error(inner, seen)
        if found is not None:
            return found
    return None


@contextmanager
def user_errors_surfaced() -> Iterator[None]:
    """Re-raise a user mistake met inside a Ray worker as the one-line ClozeMathError it is."""
    try:
        yield
    except Exception as exc:
        found = _user_error(exc, set())
        if found is None:
            raise
        raise ClozeMathError(str(found)) from None
