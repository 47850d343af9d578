"""Ray Train (V2): `TorchTrainer` workers around `clozemath.train.loop`, checkpoints through `ray.train.report`.

Each worker loads the model, takes its shard of the token ids (split in a fixed order so that a restarted worker
gets the same rows: Ray Data's streaming split, or for a small set a share of one object, `train.stream_above_mb`)
and runs the loop. Every step's metrics go through `ray.train.report`; a checkpoint (DeepSpeed state + step + data
position) goes with them every `checkpoint_every` steps and at the end, each rank's part marked complete first
(`clozemath.train.checkpoint.mark_complete`), written beside its place in the run's storage and renamed into it whole
(`whole_checkpoint_upload`). After a failure Ray restarts the workers (up to `max_failures` times)
and each resumes from `ray.train.get_checkpoint()`; a trial started again resumes, in a Ray Train run of its own,
from the newest whole checkpoint of its earlier runs (`resume_point`). The last checkpoint holds the adapter,
which the driver copies into the run's output folder. The metrics reach MLflow through a callback on the Train
controller, on the driver's node (`ray_jobs.reports`).
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray
import ray.train
from ray.data import ExecutionOptions
from ray.train import (
    Checkpoint,
    CheckpointConfig,
    DataConfig,
    FailureConfig,
    LoggingConfig,
    RunConfig,
    ScalingConfig,
    UserCallback,
)
from ray.train.torch import TorchTrainer

from clozemath import console
from clozemath.config import ExperimentConfig, from_wire, to_wire
from clozemath.errors import ClozeMathError
from clozemath.files import copy_folder_atomic
from clozemath.eval.during_training import evaluate_step, step_evaluation
from clozemath.eval.folder import evaluates_in_worker
from clozemath.records import ADAPTER_DIR, RAY_TRAIN_DIR, compile_cache_folder, is_curve_metric, train_metric
from clozemath.tracking import TrackedRun
from clozemath.train.checkpoint import (
    Checked,
    check_checkpoint,
    load_step_history,
    mark_complete,
    save_step_history,
    write_checkpoint_whole,
)
from clozemath.train.distributed import all_ranks_reduce, all_ranks_sum
from clozemath.train.layout import count_steps, packs, resolved_zero_stage
from clozemath.train.loop import StepMetrics
from ray_jobs.preprocess import TokenizedSet
from ray_jobs.reports import RESUMED_KEY, STEPS_KEY, ForwardMetrics

KEEP_CHECKPOINTS = 2
"""The latest and the one before it: a restart whose latest was damaged (a crash or a full disk during its write)
resumes from the one before (the last one holds the adapter)."""


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def worker_threads(cores: int, local_world_size: int, gpu_share: float | None, node_gpus: float) -> int:
    """torch's intra-op threads for a Train worker. Ray starts a 1-CPU worker with one thread (OMP_NUM_THREADS=1).
    On CPU the node's cores are the accelerator: split among the node's workers. On a GPU the host still prepares
    each step, and one thread slowed SmolLM2's uncompiled training by about a tenth
    (`bench/results/train_throughput_host_fixes_h200.md`): each worker gets the cores in proportion to its share of
    the node's GPUs (`gpu_share` None: a CPU worker)."""
    if gpu_share is None:
        return max(1, cores // local_world_size)
    return max(1, int(cores * gpu_share / max(node_gpus, 1.0)))


def node_gpus() -> float:
    """The GPUs Ray counts on this worker's node (a worker sees only its own through CUDA_VISIBLE_DEVICES)."""
    node = ray.get_runtime_context().get_node_id()
    return next(n["Resources"].get("GPU", 0.0) for n in ray.nodes() if n["NodeID"] == node)


def worker_rows(table: ray.ObjectRef | None) -> list[dict[str, Any]]:
    """This worker's training rows: its Ray Data shard, or its share of `table` (a small set's, in Ray's object
    store)."""
    context = ray.train.get_context()
    if table is None:
        return list(ray.train.get_dataset_shard("train").iter_rows())
    return rows_of_rank(ray.get(table), context.get_world_rank(), context.get_world_size())


def rows_of_rank(table: pa.Table, rank: int, world_size: int) -> list[dict[str, Any]]:
    """Every `world_size`-th row from `rank` on, as many for each rank as Ray Data's equal split gives."""
    end = table.num_rows - table.num_rows % world_size
    return table.take(list(range(rank, end, world_size))).to_pylist()


def streams(config: ExperimentConfig, prepared: TokenizedSet) -> bool:
    """Whether the workers read the training set through Ray Data (`train.stream_above_mb`)."""
    size = sum(file.stat().st_size for file in prepared.files())
    return size > config.train.stream_above_mb * 2**20


def train_worker(settings: dict[str, Any]) -> None:
    """One Ray Train worker: model, shard, loop; resumes from the run's latest checkpoint when there is one."""
    import torch
    import torch.distributed as dist
    import ray.train.torch

    from clozemath.model.load import load_model
    from clozemath.model.memory import share_gpu
    from clozemath.train.compilation import use_compile_cache
    from clozemath.train.determinism import use_deterministic_kernels
    from clozemath.train.loop import train

    # DeepSpeed's gloo path calls torch.distributed functions torch has deprecated: nothing a user can act on.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    config = from_wire(settings["experiment"])
    if config.train.deterministic:
        use_deterministic_kernels()  # before anything runs on the card (cuBLAS reads its workspace setting once)
    compile_cache = compile_cache_folder(config)
    use_compile_cache(compile_cache)  # before anything compiles: every trial and node shares it
    device = ray.train.torch.get_device()
    share_gpu(config.train.gpu_share)
    gpu = device.type == "cuda"
    torch.set_num_threads(worker_threads(usable_cores(), ray.train.get_context().get_local_world_size(),
                                         config.train.gpu_share if gpu else None, node_gpus() if gpu else 0.0))
    torch.manual_seed(config.train.seed)  # whatever loading the model draws (LoRA's initialisation: `seed` below)
    if ray.train.get_context().get_world_rank() == 0:
        console.phase(f"[{config.name}] loading the model ({config.model.name}) on {device.type}")
    loaded = load_model(config.model, settings["num_sentinels"], device, training=True, seed=config.train.seed)
    config = resolved_zero_stage(config, loaded.model, device)  # once: the evaluation during training decodes by it
    rows = worker_rows(settings["rows"])
    evaluation = step_evaluation(config)
    context = ray.train.get_context()

    history: list[dict[str, Any]] = []  # every step's metrics from step 1, saved in each checkpoint
    pending: list[dict[str, Any]] = []
    resumed: list[dict[str, Any]] = []  # the steps up to the checkpoint resumed from: with the first report only
    pace = ReportPace(config.train.report_every)
    upload = whole_checkpoint_upload(device)

    def report(metrics: StepMetrics, checkpoint: Path | None) -> None:
        """Every step's metrics, reported to Ray in batches (a report waits for the controller's poll), paced by
        `ReportPace`: this run's first step at once, then about every `REPORT_EVERY_S` (at most
        `train.report_every` steps apart)."""
        values = metrics.as_dict()
        if evaluation is not None and evaluation.due(metrics.step, metrics.total_steps):
            values |= evaluate_step(
                evaluation, loaded, config, context.get_world_rank(), context.get_world_size(),
                lambda counts: all_ranks_sum(counts, device),
            )
        pending.append(values)
        history.append(values)
        due = pace.due(metrics.step) or metrics.step == metrics.total_steps
        if checkpoint is not None:  # whole once written: a resume can tell it from one a crash cut short
            if context.get_world_rank() == 0:
                save_step_history(checkpoint, history)
            mark_complete(checkpoint, context.get_world_rank(), context.get_world_size(), metrics.step,
                          metrics.total_steps, metrics.trained_tokens)
            if evaluated is not None and metrics.step == metrics.total_steps:  # the adapter `fit` will copy there
                copy_folder_atomic(checkpoint / ADAPTER_DIR, evaluated.adapter)
        if checkpoint is not None or due or any(map(is_curve_metric, values)):
            ray.train.report(
                {**values, STEPS_KEY: list(pending), RESUMED_KEY: list(resumed)},
                checkpoint=Checkpoint.from_directory(checkpoint) if checkpoint else None,
                checkpoint_upload_fn=upload,
            )
            pending.clear()
            resumed.clear()
            pace.reported(metrics.step, lambda seconds: all_ranks_reduce(round(1000 * seconds), dist.ReduceOp.MAX,
                                                                         device) / 1000)

    evaluated = EvaluatedHere.of(settings["evaluate_here"], config)
    latest = ray.train.get_checkpoint()  # this run's latest (its workers restarted), else the one `fit` chose
    with latest.as_directory() if latest is not None else nullcontext(settings["resume_from"]) as resume_from:
        if resume_from is not None:  # the steps before it go with the first report: the store may lack some
            resumed.extend(load_step_history(Path(resume_from)))
            history.extend(resumed)
        engine = train(
            loaded.model,
            rows,
            config,
            specials=loaded.specials,
            pad_id=loaded.tokenizer.pad_token_id,
            report=report,
            resume_from=Path(resume_from) if resume_from is not None else None,
            compile_cache=compile_cache,
        )
    if evaluated is not None and evaluated.adapter.is_dir():
        del engine  # the optimizer's state and the gradients
        evaluated.evaluate(config, loaded)


@dataclass(frozen=True)
class EvaluatedHere:
    """A trial evaluated in its training worker as training ends (`clozemath.eval.folder.evaluates_in_worker`):
    its adapter and evaluation folders, the driver's (whose evaluation then finds every prediction made)."""

    adapter: Path
    folder: Path

    @classmethod
    def of(cls, folders: dict[str, str] | None, config: ExperimentConfig) -> EvaluatedHere | None:
        """None where the driver did not ask for it, or the worker's resolved ZeRO stage is 3."""
        if folders is None or config.train.zero_stage == 3:
            return None
        return cls(Path(folders["adapter"]), Path(folders["folder"]))

    def evaluate(self, config: ExperimentConfig, loaded: Any) -> None:
        """Free what training held, uncompile the layers, evaluate (`clozemath.eval.folder.evaluate_trained`)."""
        import gc

        import torch

        from clozemath.eval.folder import evaluate_trained
        from clozemath.train.compilation import uncompile_decoder_layers

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        uncompile_decoder_layers(loaded.model)
        try:
            with torch.no_grad():
                evaluate_trained(config, loaded, self.adapter, self.folder)
        except Exception as exc:  # the training stands; the trial's evaluation on actors takes up what was made
            console.warn(f"[{config.name}] the evaluation in the training worker failed ({type(exc).__name__}: "
                         f"{exc}); the trial's evaluation actors take it up")


def whole_checkpoint_upload(device: Any) -> Callable[[Checkpoint, str], Checkpoint] | None:
    """How a worker hands Ray Train its part of a checkpoint on a local (or mounted) storage: written beside its
    place and renamed into it whole (`write_checkpoint_whole`), where Ray's own upload would copy it file by file
    into its place. None (Ray's upload) on remote storage (`s3://`...), which has no rename; the marks of
    completeness tell a partial checkpoint there."""
    storage = ray.train.get_context().get_storage()
    if storage.storage_filesystem.type_name != "local":
        return None

    def upload(checkpoint: Checkpoint, dir_name: str) -> Checkpoint:
        target = Path(storage.experiment_fs_path) / dir_name
        write_checkpoint_whole(Path(checkpoint.path), target, device)
        return Checkpoint(path=str(target), filesystem=storage.storage_filesystem)

    return upload


REPORT_EVERY_S = 15.0
"""About how often a worker reports its steps to Ray Train (and the console's training bar moves), however slow its
steps: off a terminal the bar prints a line at least every `console.SPARSE_EVERY_S`."""


class ReportPace:
    """When a worker's steps are reported: at the run's first step (the console shows it at once), then every `n`
    steps, `n` set at each report from the slowest rank's pace since the previous one (about `REPORT_EVERY_S` apart,
    at most `report_every` steps: a report waits for the controller, too many slow fast steps). Every rank reports at
    the same steps: a report is collective, and so is the reduction each one makes."""

    def __init__(self, report_every: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.report_every = report_every
        self.clock = clock
        self.last_step: int | None = None
        self.last_time = clock()
        self.every = 1

    def due(self, step: int) -> bool:
        return self.last_step is None or step - self.last_step >= self.every

    def reported(self, step: int, slowest: Callable[[float], float]) -> None:
        """`slowest`: a rank's seconds since its previous report -> the longest of every rank's."""
        now = self.clock()
        seconds = slowest(now - self.last_time)
        steps = step - (self.last_step if self.last_step is not None else step - 1)
        per_step = seconds / max(steps, 1)
        self.every = max(1, min(self.report_every, int(REPORT_EVERY_S / per_step) if per_step > 0 else 1))
        self.last_step, self.last_time = step, now


def use_gpu(config: ExperimentConfig) -> bool:
    if config.train.use_gpu == "auto":
        gpus = config.train.num_workers * config.train.gpu_share
        return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= gpus
    return config.train.use_gpu


def preflight_checks(config: ExperimentConfig, prepared: TokenizedSet) -> None:
    """Refuse, before any worker starts, what would fail in every worker (and again after each restart)."""
    rows = prepared.num_rows // config.train.num_workers
    packed = packs(config.train, use_gpu(config))
    count_steps(rows if packed else rows // config.train.micro_batch_size, config.train)  # a packed row: >= 1 sample
    fail_at = config.train.fail_at_step
    if fail_at is not None and fail_at <= config.train.checkpoint_every:
        raise ClozeMathError(
            f"train.fail_at_step={fail_at} must come after the first checkpoint "
            f"(train.checkpoint_every={config.train.checkpoint_every}), or the restarted run fails again"
        )


@dataclass(frozen=True)
class Trained:
    """What a training run did."""

    adapter: Path
    """`<run_folder>/adapter`."""
    planned_steps: int
    steps: int
    """The optimizer steps trained (all of the plan's: a resumed run ends there too)."""
    tokens: int | None
    """The real (non-padding) tokens those steps trained on, all workers' (`StepMetrics.trained_tokens`); None for a
    training that had ended before whose checkpoint predates that record."""


def fit(
    config: ExperimentConfig,
    prepared: TokenizedSet,
    run_folder: Path,
    run: TrackedRun,
    run_name: str | None = None,
    callbacks: Sequence[UserCallback] = (),
    eval_folder: Path | None = None,
) -> Trained:
    """Train on Ray; returns the adapter folder (`<run_folder>/adapter`) and what the training did.

    `run_name`: names the trial's Ray Train runs (`<run_name>-<n>` under `<run_folder>/ray` or `train.storage`); a
    trial started again under it resumes from the newest whole checkpoint of its runs (`resume_point`), in a run of
    its own (a grid trial restarted after its driver died). Default: a new, time-stamped one.
    `callbacks`: more Train callbacks (a Tune trial's `TuneReportCallback`). `eval_folder`: the trial's evaluation
    folder, where a worker that evaluates as training ends writes (`eval.in_worker`; the driver's evaluation then
    finds its predictions made)."""
    preflight_checks(config, prepared)
    storage = config.train.storage or str(run_folder / RAY_TRAIN_DIR)
    local = run_name is not None and "://" not in storage  # elsewhere Ray's own latest checkpoint is resumed
    resume = resume_point(Path(storage), run_name, config.name) if local else None
    adapter = run_folder / ADAPTER_DIR
    if resume is not None and (resume.folder / ADAPTER_DIR).is_dir():  # its training had ended
        console.phase(f"[{config.name}] training: finished before, at step {resume.step} ({resume.folder})")
        copy_folder_atomic(resume.folder / ADAPTER_DIR, adapter)
        ForwardMetrics(run, config.name).log_steps(load_step_history(resume.folder))
        step = int(resume.step or 0)
        return Trained(adapter, resume.total_steps or step, step, resume.trained_tokens)
    gpu = use_gpu(config)
    streamed = streams(config, prepared)
    table = None if streamed else ray.put(prepared.table())
    stage = config.train.zero_stage
    zero = "ZeRO auto (2 where the model fits a card)" if stage == "auto" else f"ZeRO-{stage}"
    console.phase(
        f"[{config.name}] training: starting {config.train.num_workers} {'GPU' if gpu else 'CPU'} worker(s), {zero}"
        + (f", from the checkpoint of step {resume.step}" if resume is not None else "")
    )
    name = next_run(Path(storage), run_name) if local else run_name or time.strftime("train-%Y%m%d-%H%M%S")
    trainer = TorchTrainer(
        train_worker,
        train_loop_config={"experiment": to_wire(config), "num_sentinels": prepared.num_sentinels, "rows": table,
                           "resume_from": None if resume is None else str(resume.folder),
                           "evaluate_here": {"adapter": str(adapter), "folder": str(eval_folder)}
                           if eval_folder is not None and evaluates_in_worker(config) else None},
        scaling_config=ScalingConfig(
            num_workers=config.train.num_workers, use_gpu=gpu,
            resources_per_worker={"GPU": config.train.gpu_share} if gpu else None,
        ),
        run_config=RunConfig(
            name=name,
            storage_path=storage,
            failure_config=FailureConfig(max_failures=config.train.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=KEEP_CHECKPOINTS),
            callbacks=[ForwardMetrics(run, config.name), *callbacks],
            logging_config=LoggingConfig(log_level="WARNING"),  # our progress line replaces Ray's per-report logs
        ),
        datasets={"train": prepared.dataset()} if streamed else None,
        dataset_config=DataConfig(execution_options=ExecutionOptions(preserve_order=True)),
    )
    result = trainer.fit()
    with result.checkpoint.as_directory() as final:
        copy_folder_atomic(Path(final) / ADAPTER_DIR, adapter)  # a failed copy leaves an earlier adapter whole
    if local:
        remove_earlier_runs(Path(storage), run_name, name)
    last = result.metrics
    return Trained(adapter, int(last["total_steps"]), int(last["step"]), int(last[train_metric("trained_tokens")]))


def trial_runs(storage: Path, run_name: str) -> list[Path]:
    """The Ray Train runs of a trial (`<run_name>-<n>`), oldest first."""
    numbered = []
    for path in storage.glob(f"{run_name}-*"):
        number = path.name.removeprefix(f"{run_name}-")
        if number.isdigit() and path.is_dir():
            numbered.append((int(number), path))
    return [path for _, path in sorted(numbered)]


def next_run(storage: Path, run_name: str) -> str:
    """The name of the trial's next Ray Train run."""
    runs = trial_runs(storage, run_name)
    return f"{run_name}-{int(runs[-1].name.rsplit('-', 1)[1]) + 1 if runs else 1}"


def resume_point(storage: Path, run_name: str, label: str) -> Checked | None:
    """The newest whole checkpoint of the trial's runs (`check_checkpoint`), saying which newer ones it skipped and
    why; None where there is no checkpoint. Checkpoints none of which is whole are an error naming them and the way
    to train the trial afresh."""
    skipped = []
    for trial_run in reversed(trial_runs(storage, run_name)):
        for folder in sorted((path for path in trial_run.glob("checkpoint_*") if path.is_dir()), reverse=True):
            checked = check_checkpoint(folder)
            if checked.problem is None:
                for bad in skipped:
                    console.warn(f"[{label}] skipped the checkpoint {bad.folder}: {bad.problem}")
                return checked
            skipped.append(checked)
    if skipped:
        first = skipped[0]
        raise ClozeMathError(
            f"{storage}: no whole checkpoint of this trial to resume from ({len(skipped)} damaged; the newest, "
            f"{first.folder.relative_to(storage)}: {first.problem}): remove {storage / run_name}-* to train it afresh"
        )
    return None


def remove_earlier_runs(storage: Path, run_name: str, kept: str) -> None:
    """After a run that trained to the end, the trial's earlier runs and their checkpoints are spent."""
    for trial_run in trial_runs(storage, run_name):
        if trial_run.name != kept:
            shutil.rmtree(trial_run, ignore_errors=True)
