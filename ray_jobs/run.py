"""`clozemath run CONFIG`: one experiment end to end on Ray (preprocess, train, adapter, evaluation, MLflow).

`run_experiment` is the unit a grid repeats: it joins whatever Ray is up (a Tune trial's) and can log as the child
of a grid's MLflow run. `run_command` runs any config as a grid (`ray_jobs.grid`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ray.train import UserCallback

from clozemath import tracking
from clozemath.config import ExperimentConfig, as_grid, configs_root, load_config
from clozemath.errors import ClozeMathError
from clozemath.train.loop import plan_steps
from ray_jobs.cluster import init_ray
from ray_jobs.evaluate import run_evaluation
from ray_jobs.preprocess import Prepared, preprocess
from ray_jobs.train import fit

CACHE_DIR = "cache"


@dataclass(frozen=True)
class RunOutcome:
    run_id: str
    """The experiment's MLflow run."""
    adapter: Path | None
    """None for a method that trains nothing (`base`)."""
    prepared: Prepared | None
    metrics: dict[str, float]
    """The evaluation's (`eval/<set>/<decoding>/accuracy`, ...)."""


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_folder(config: ExperimentConfig) -> Path:
    """`<train.output_dir>/<experiment name>`: the adapter and Ray Train's checkpoints live here."""
    return Path(config.train.output_dir).resolve() / config.name


def run_experiment(
    config: ExperimentConfig,
    parent_run_id: str | None = None,
    tags: Mapping[str, str] | None = None,
    *,
    run_id: str | None = None,
    train_run_name: str | None = None,
    train_callbacks: Sequence[UserCallback] = (),
) -> RunOutcome:
    """Preprocess (cached), train on Ray Train, write `<run folder>/adapter`, evaluate it, track it all in MLflow.

    A method that trains nothing (`base`) is only evaluated (few-shot). `run_id`: log into this existing run instead
    of a new one (a grid trial started again); `train_run_name`, `train_callbacks`: see `ray_jobs.train.fit`.
    """
    uri = config.tracking.uri
    if run_id is None:
        run_id = tracking.start_run(config.tracking, config.name, parent_run_id, tags)
    else:
        tracking.reopen_run(uri, run_id)
    succeeded = False
    try:
        tracking.log_config(uri, run_id, config)
        adapter, prepared, final_step = None, None, 0
        if config.method.trains:
            prepared = _prepare(config)
            tracking.log_params(
                uri, run_id, {"data.num_samples": prepared.num_rows, "data.num_sentinels": prepared.num_sentinels}
            )
            init_ray()
            with user_errors_surfaced():
                adapter = fit(config, prepared, run_folder(config), run_id, train_run_name, train_callbacks)
            tracking.log_artifacts(uri, run_id, adapter, "adapter")
            progress(f"[{config.name}] adapter written to {adapter}")
            final_step = plan_steps(prepared.num_rows // config.train.num_workers, config.train).total_steps
        progress(f"[{config.name}] evaluating {'the adapter' if adapter else 'the base model, few-shot'}")
        evaluation = run_evaluation(config, adapter, tracking_run_id=run_id, step=final_step)
        progress(f"[{config.name}] evaluation written to {evaluation.folder}")
        succeeded = True
    finally:
        tracking.end_run(uri, run_id, succeeded)
    return RunOutcome(run_id=run_id, adapter=adapter, prepared=prepared, metrics=evaluation.metrics)


def _prepare(config: ExperimentConfig) -> Prepared:
    progress(f"[{config.name}] preparing {config.data.dataset}/{config.data.split} for method {config.method.name}")
    prepared = preprocess(config, Path(config.train.output_dir).resolve() / CACHE_DIR)
    kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(prepared.kinds.items()))
    progress(
        f"[{config.name}] {prepared.num_rows} samples ({kinds}; {prepared.dropped_for_length} too long)"
        f"{', from the cache' if prepared.from_cache else ''}"
    )
    return prepared


def run_command(config_path: str, overrides: list[str]) -> None:
    """`clozemath run`: an experiment (a grid of one) or a grid, on Ray Tune; an interrupted grid resumes."""
    from ray_jobs.grid import print_grid_outcome, run_grid

    config = load_config(config_path, overrides)
    print_grid_outcome(run_grid(as_grid(config), configs_root(Path(config_path)), source=config_path))


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
