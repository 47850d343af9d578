"""`clozemath run CONFIG`: one experiment end to end on Ray (preprocess, train, adapter, evaluation, MLflow).

`run_experiment` is the unit a grid repeats (`ray_jobs.grid`, which runs any config: an experiment is a grid of one):
it joins whatever Ray is up (a Tune trial's) and can log as the child of a grid's MLflow run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ray.train import UserCallback

from clozemath import console, tracking
from clozemath.config import ExperimentConfig
from clozemath.data.prepare import training_set_identity
from clozemath.plan import budget_reference
from clozemath.records import (
    ADAPTER_DIR,
    PLANNED_STEPS,
    PLANNED_TOKENS,
    TRAINED_STEPS,
    TRAINED_TOKENS,
    cache_folder,
    eval_folder,
    headline_percent,
    run_folder,
)
from clozemath.train.budget import Footprint, matched_epochs, planned_tokens
from clozemath.train.flops import MFU_CONVENTION
from ray_jobs.cluster import init_ray, user_errors_surfaced
from ray_jobs.eval_job import run_evaluation
from clozemath.train.layout import packs
from ray_jobs.preprocess import TokenizedSet, preprocess
from ray_jobs.train import fit, use_gpu


@dataclass(frozen=True)
class RunOutcome:
    run_id: str
    """The experiment's MLflow run."""
    adapter: Path | None
    """None for a method that does not train (`base`)."""
    prepared: TokenizedSet | None
    eval_metrics: dict[str, float]
    """`eval/<set>/<decoding>/accuracy` and counts; empty when `eval.sets` is."""


def run_experiment(
    config: ExperimentConfig,
    parent_run_id: str | None = None,
    tags: Mapping[str, str] | None = None,
    *,
    run_name: str | None = None,
    run_id: str | None = None,
    train_run_name: str | None = None,
    train_callbacks: Sequence[UserCallback] = (),
) -> RunOutcome:
    """Preprocess (cached), train on Ray Train into `<train.output_dir>/<name>/adapter`, evaluate on `eval.sets`,
    all tracked in one MLflow run (a child of `parent_run_id` when given). A method that does not train (`base`)
    is only evaluated. `run_name`: the MLflow run's name (default: the experiment's); `run_id`: log on into this run
    instead of a new one (a grid trial started again); `train_run_name`, `train_callbacks`: see `ray_jobs.train.fit`.
    The headline accuracy is also logged in percent (`records.HEADLINE_PERCENT`)."""
    prepared = _prepare(config) if config.method.trains else None
    init_ray()
    if run_id is None:
        run = tracking.start_run(config.tracking, run_name or config.name, parent_run_id, tags)
    else:
        run = tracking.reopen_run(config.tracking.uri, run_id)
    with run.ended_on_exit():
        run.log_config(config)
        adapter, steps = None, 0
        if prepared is not None:
            footprint = Footprint(prepared.num_rows, prepared.num_tokens)
            planned = planned_tokens(footprint, config.train, packs(config.train, use_gpu(config)))
            run.log_params({
                "data.num_samples": prepared.num_rows, "data.num_sentinels": prepared.num_sentinels,
                **({} if planned is None else {PLANNED_TOKENS: planned}), "train.mfu_convention": MFU_CONVENTION,
            })
            with user_errors_surfaced():
                trained = fit(config, prepared, run_folder(config).resolve(), run, train_run_name, train_callbacks,
                              eval_folder(config).resolve() if config.eval.sets else None)
            adapter, steps = trained.adapter, trained.steps
            run.log_params({PLANNED_STEPS: trained.planned_steps, TRAINED_STEPS: trained.steps,
                            **({} if trained.tokens is None else {TRAINED_TOKENS: trained.tokens})})
            run.log_artifacts(adapter, ADAPTER_DIR)
        eval_metrics = {}
        if config.eval.sets:
            eval_metrics = run_evaluation(config, adapter, tracked_run=run, step=steps).metrics
            run.log_metrics(steps, headline_percent(config, eval_metrics))
    return RunOutcome(run_id=run.run_id, adapter=adapter, prepared=prepared, eval_metrics=eval_metrics)


def _footprint(config: ExperimentConfig) -> Footprint:
    prepared = _prepare(config)
    return Footprint(prepared.num_rows, prepared.num_tokens)


def _matched(config: ExperimentConfig, reference: Footprint, mine: Footprint) -> ExperimentConfig:
    """The config with its matched `train.budget` turned into `train.epochs`."""
    train = config.train
    epochs = matched_epochs(train, reference, mine, packed=packs(train, use_gpu(config)))
    console.phase(f"[{config.name}] budget: the {train.budget} of {train.budget_reference} in {train.epochs} epochs: "
                  f"{epochs:.3f} epochs")
    resolved = train.model_copy(update={"budget": "epochs", "epochs": epochs,  # and what it was resolved from
                                        "budget_configured": train.budget, "epochs_configured": train.epochs})
    return config.model_copy(update={"train": resolved})


def with_budgets(experiments: list[ExperimentConfig], root: Path, parallel: int = 8) -> list[ExperimentConfig]:
    """The experiments with a matched `train.budget` turned into `train.epochs`: the steps or training tokens that
    `train.budget_reference` makes in `train.epochs` on the same data. The training sets are prepared here (then
    cached for the trials: `prepare_training_sets`)."""
    def matched(experiment: ExperimentConfig) -> bool:
        return experiment.train.budget != "epochs" and experiment.method.trains

    footprints = prepare_training_sets(run_training_sets(list(filter(matched, experiments)), root), parallel)
    return [
        _matched(e, footprints[training_set_identity(budget_reference(e, root))], footprints[training_set_identity(e)])
        if matched(e) else e
        for e in experiments
    ]


def run_training_sets(experiments: list[ExperimentConfig], root: Path) -> list[ExperimentConfig]:
    """What a run of `experiments` prepares: each trained trial's training set and, for a matched budget, its
    reference's."""
    return [config for experiment in experiments if experiment.method.trains
            for config in ((budget_reference(experiment, root),) if experiment.train.budget != "epochs" else ())
            + (experiment,)]


def prepare_training_sets(configs: list[ExperimentConfig], parallel: int = 8) -> dict[str, Footprint]:
    """Each distinct training set of `configs` (by `training_set_identity`: a reference is often another trial's
    own) prepared into its cache, `parallel` at a time rather than one after the other: Ray Data runs the pipelines
    side by side, each into a cache folder of its own. Their footprints, by identity."""
    needed: dict[str, ExperimentConfig] = {}
    for config in configs:
        needed.setdefault(training_set_identity(config), config)
    if not needed:
        return {}
    if len(needed) > 1:
        init_ray()  # once, before the threads: each would start it
    with ThreadPoolExecutor(max_workers=min(parallel, len(needed))) as pool:
        return dict(zip(needed, pool.map(_footprint, needed.values())))


def _prepare(config: ExperimentConfig) -> TokenizedSet:
    console.phase(
        f"[{config.name}] preparing data: {config.data.dataset}/{config.data.split} for method {config.method.name}"
    )
    prepared = preprocess(config, cache_folder(config.train.output_dir))
    kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(prepared.kinds.items()))
    console.phase(
        f"[{config.name}] data: {prepared.num_rows} samples ({kinds}; {prepared.dropped_for_length} too long), "
        f"{'from the cache' if prepared.from_cache else 'prepared afresh'}"
    )
    return prepared
