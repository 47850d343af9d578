"""On the Ray Train controller: what the workers report, forwarded to MLflow, the console and Tune.

Kept apart from `ray_jobs.train` (the workers' side, which imports torch's training stack, DeepSpeed and the
decoders): the controller imports the module of each callback it runs, and on a small machine every second it
spends importing delays the workers' start.
"""

from __future__ import annotations

from typing import Any

from ray.train import Checkpoint, UserCallback
from ray.tune.integration.ray_train import TuneReportCallback

from clozemath import console
from clozemath.records import ACCURACY, TRAIN_METRICS, is_curve_metric, is_step_metric, parse_eval_metric, train_metric
from clozemath.tracking import TrackedRun

STEPS_KEY = "steps"
"""A report's key holding the metrics of every step since the previous report (the report's own values are the
last step's)."""
RESUMED_KEY = "resumed_steps"
"""A report's key holding, in a run's first report after it resumed from a checkpoint, the metrics of the steps up
to that checkpoint (saved in it); empty in every other report."""


class ForwardMetrics(UserCallback):
    """On the Train controller: log rank 0's step metrics (and evaluations during training) to MLflow and move the
    training's progress bar.

    Each step is logged once: a run resumed from its checkpoint (after a worker failed, or in a trial started
    again) trains the steps after that checkpoint again, and those already in the run are not logged twice. Its
    first report also holds the steps up to the checkpoint (`RESUMED_KEY`), and those the run lacks are logged: a
    driver killed after a checkpoint was written but before its steps were logged leaves such a gap."""

    def __init__(self, run: TrackedRun, label: str) -> None:
        self.run = run
        self.label = label
        self.logged_through = run.last_step(TRAIN_METRICS[0])

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Checkpoint | None) -> None:
        reported = metrics[0]
        self.log_steps([*reported[RESUMED_KEY], *reported[STEPS_KEY]])
        values = {name: value for name, value in reported.items() if is_step_metric(name)}
        curve = {parse_eval_metric(name): value for name, value in values.items() if is_curve_metric(name)}
        accuracies = [f"{metric.measured} {value:.1%}" for metric, value in curve.items() if metric.stat == ACCURACY]
        console.progress(
            f"{self.label}/train", f"[{self.label}] training", reported["step"], reported["total_steps"],
            [f"loss {values[train_metric('loss')]:.4f}", f"{values[train_metric('tokens_per_s')]:.0f} tok/s",
             *([f"MFU {values[train_metric('mfu')]:.1%}"] if train_metric("mfu") in values else []), *accuracies],
        )

    def log_steps(self, steps: list[dict[str, Any]]) -> None:
        """Log the steps (in order) past the last one the run holds."""
        for step in steps:
            if step["step"] > self.logged_through:
                logged = {name: value for name, value in step.items() if is_step_metric(name)}
                self.run.log_metrics(step["step"], logged)
                self.logged_through = step["step"]


class TuneProgress(TuneReportCallback):
    """Forward to Tune the reports that carry a checkpoint or an evaluation during training, not every step's.

    Tune takes one result at a time, when its driver gets round to it (about every half second), and Ray Train's
    workers wait for that: forwarding every step kept each training step waiting. MLflow still logs every step.
    """

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        if checkpoint is not None or any(map(is_curve_metric, metrics[0])):
            last_steps = [{name: value for name, value in m.items() if name not in (STEPS_KEY, RESUMED_KEY)}
                          for m in metrics]
            super().after_report(run_context, last_steps, checkpoint)
