"""The seeds of each method side by side: which lie far below the method's other seeds (a collapsed run, as Qwen's IT
seed 2 of 2026-11-28 at 40.11% beside 54.81 and 55.12), beside what its training did step by step (the loss at its
end, the gradient norm's peak and spikes), so that a report says how often a seed collapses, for which methods, and
whether the training showed it (issue 46, item 7)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from clozemath.config import TrainConfig
from clozemath.records import train_metric
from clozemath.report.history import Histories, Steps
from clozemath.report.names import (
    REPLICATION_METHODS, Column, column_name, method_name, model_name, ordered, set_title,
)
from clozemath.report.render import TextTable
from clozemath.report.runs import TrialResult, blocks, eval_columns, measured_on, percents
from clozemath.train.divergence import Divergence, find_divergence

FAR_BELOW_POINTS = 5.0
"""A seed lies far below its method when its accuracy is more than this many points below the median of the method's
other seeds (at least two of them). Two seeds of one method differ by ~2 points on GSM8K test's 1,319 problems from
the problems alone (a binomial standard error of 1.4 points each near 50%); Qwen's IT seed 2 lay 14.8 below."""
EDGE_SHARE = 0.1
"""The loss at a run's end is its mean over the last tenth of its steps; its gradient norms are read past the first
tenth (warm-up's large norms at the start are no sign of trouble)."""
SPIKE_FACTOR = 10.0
"""A step's gradient norm (before clipping) is a spike past this multiple of the run's median norm."""
LOSS, GRAD_NORM = train_metric("loss"), train_metric("grad_norm")
DIVERGENCE_FACTOR: float = TrainConfig.model_fields["divergence_factor"].default
"""What a run from before `train.divergence_factor` was recorded is judged by."""


@dataclass(frozen=True)
class TrainingSignals:
    """What a run's steps show of its training (None: the run logged no such metric)."""

    final_loss: float | None
    peak_grad_norm: float | None
    spikes: int
    """Steps past the first tenth whose gradient norm passed `SPIKE_FACTOR` times the run's median."""
    first_spike: int | None
    """The step of the first of them."""
    diverged: Divergence | None = None
    """Where its smoothed loss climbed to its `train.divergence_factor` times the lowest, and where it came back, if it
    did (`clozemath.train.divergence`)."""


def divergence_factor(trial: TrialResult) -> float:
    """The trial's `train.divergence_factor`; for a run from before it was recorded, the default."""
    return float(trial.params.get("train.divergence_factor", DIVERGENCE_FACTOR))


def run_divergence(steps: Steps, factor: float) -> Divergence | None:
    """Where one run's logged losses diverged (`clozemath.train.divergence`), None: they did not."""
    losses = [(step, value) for step, value in zip(steps.get("step", []), steps.get(LOSS, [])) if value is not None]
    return find_divergence(losses, factor)


def training_signals(steps: Steps, factor: float = DIVERGENCE_FACTOR) -> TrainingSignals:
    """`TrainingSignals` of one run's steps (`clozemath.report.history`)."""
    numbers = steps.get("step", [])
    losses = [value for value in steps.get(LOSS, []) if value is not None]
    tail = losses[len(losses) - max(1, round(EDGE_SHARE * len(losses))):] if losses else []
    final = statistics.fmean(tail) if tail else None
    diverged = run_divergence(steps, factor)
    norms = [(step, value) for step, value in zip(numbers, steps.get(GRAD_NORM, [])) if value is not None]
    if not norms:
        return TrainingSignals(final, None, 0, None, diverged)
    median = statistics.median(value for _, value in norms)
    past_warmup = norms[round(EDGE_SHARE * len(norms)):] or norms
    spikes = [step for step, value in past_warmup if value > SPIKE_FACTOR * median]
    return TrainingSignals(final, max(value for _, value in past_warmup), len(spikes), spikes[0] if spikes else None,
                           diverged)


@dataclass(frozen=True)
class SeedRow:
    method: str
    seed: str
    accuracy: float
    """Percent, on the block's first evaluation column."""
    gap: float | None
    """Points from the median of the method's other seeds (None: fewer than two others)."""
    signals: TrainingSignals

    @property
    def far_below(self) -> bool:
        return self.gap is not None and self.gap < -FAR_BELOW_POINTS


def headline_column(trials: list[TrialResult], train_set: str) -> Column | None:
    """The evaluation the seeds are compared on: the training set's own test (its first decoding in the registry's
    order, greedy where it ran), else the trials' first evaluation."""
    columns = eval_columns(trials)
    own = [column for column in columns if column[0] == train_set]
    return (own or columns or [None])[0]


def seed_rows(trials: list[TrialResult], histories: Histories, column: Column) -> list[SeedRow]:
    """Every trained seed of the methods with two or more of them measured on `column`."""
    rows = []
    for method in ordered({r.method for r in trials}, REPLICATION_METHODS):
        runs = sorted((r for r in measured_on(trials, method, column) if r.steps is not None), key=lambda r: r.seed)
        if len(runs) < 2:
            continue
        accuracies = percents(runs, column)
        for index, (run, accuracy) in enumerate(zip(runs, accuracies)):
            others = accuracies[:index] + accuracies[index + 1:]
            gap = accuracy - statistics.median(others) if len(others) >= 2 else None
            signals = training_signals(histories.steps(run), divergence_factor(run))
            rows.append(SeedRow(method, run.seed, accuracy, gap, signals))
    return rows


def _number(value: float | None, digits: int, signed: bool = False) -> str:
    return "–" if value is None else f"{value:{'+' if signed else ''}.{digits}f}"


def _diverged_cell(divergence: Divergence | None) -> str:
    if divergence is None:
        return ""
    return f"yes ({divergence.step})" if divergence.ended_diverged else f"{divergence.step}, back {divergence.back}"


def seed_tables(results: list[TrialResult], histories: Histories) -> list[TextTable]:
    """Per training set and model with a method of two or more trained seeds: each seed's accuracy, its distance from
    the median of the method's other seeds and its training signals; the title names the seeds far below."""
    tables = []
    for (train_set, model), trials in blocks(results).items():
        column = headline_column(trials, train_set)
        rows = seed_rows(trials, histories, column) if column is not None else []
        if not rows:
            continue
        judged = [row for row in rows if row.gap is not None]
        far = [f"{method_name(row.method)} seed {row.seed}" for row in rows if row.far_below]
        diverged, came_back = ([f"{method_name(row.method)} seed {row.seed}" for row in rows
                                if row.signals.diverged and row.signals.diverged.ended_diverged == ended]
                               for ended in (True, False))
        verdict = (f"far below: {', '.join(far) or 'none'}, of {len(judged)} seeds of methods with three or more"
                   if judged else "no method has three seeds: none judged")
        title = (f"Seeds: {model_name(model)} trained on {set_title(train_set)}, {column_name(column)} accuracy (%) "
                 f"and training ({verdict}; diverged in training: {', '.join(diverged) or 'none'}, of {len(rows)}"
                 f"{'; diverged and came back: ' + ', '.join(came_back) if came_back else ''}); "
                 f"far below: more than {FAR_BELOW_POINTS:g} points below the median of its method's other seeds; "
                 f"final loss: the mean of the last tenth of the steps; gradient norms past the first tenth, a spike "
                 f"past {SPIKE_FACTOR:g}x the run's median; diverged: the step where the smoothed loss reached "
                 f"train.divergence_factor (default {DIVERGENCE_FACTOR:g}) times its lowest, and where it came back "
                 f"under it to stay")
        tables.append(TextTable(title, [
            "Method", "Seed", "Accuracy", "vs others' median", "Final loss", "Peak grad norm", "Spikes (first)",
            "Diverged (step)", "Far below",
        ], 2, [[
            method_name(row.method), row.seed, f"{row.accuracy:.2f}", _number(row.gap, 2, signed=True),
            _number(row.signals.final_loss, 3), _number(row.signals.peak_grad_norm, 2),
            f"{row.signals.spikes} (step {row.signals.first_spike})" if row.signals.spikes else "0",
            _diverged_cell(row.signals.diverged),
            "yes" if row.far_below else "",
        ] for row in rows]))
    return tables
