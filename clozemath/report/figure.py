"""Figure 3: GSM8K accuracy against training steps, a panel per model, a line per method (mean and range over
seeds)."""

from __future__ import annotations

import statistics
import textwrap
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from clozemath.files import atomic_path
from clozemath.records import ACCURACY, CURVE_PREFIX, eval_metric, parse_eval_metric
from clozemath.report.history import Histories
from clozemath.report.names import MODEL_NAMES, REPLICATION_METHODS, REPLICATION_NAMES, method_name, model_name, ordered
from clozemath.report.runs import TrialResult

FIGURE_FILE = "accuracy_vs_steps.png"


@dataclass(frozen=True)
class CurvePoint:
    """The k-th evaluation during training of every seed of one method: where and how accurate, over the seeds."""

    step: float
    """Mean over the seeds of the step it was taken at (at a matched budget and `eval.during_training.every_share`,
    every seed of every method evaluates at the same shares of nearly the same steps)."""
    mean: float
    low: float
    high: float
    """The lowest and highest seed's accuracy (percent): the band."""
    seeds: int


Curves = dict[str, dict[str, list[CurvePoint]]]


def accuracy_curves(histories: Histories, results: list[TrialResult], decoding: str) -> Curves:
    """Model -> method -> its points, GSM8K-trained runs: the k-th point is the k-th evaluation of each seed that
    logged a curve (the first k that all of them reached), its accuracy averaged, with the seeds' range. The
    histories come from the store or from a report's exported steps (`clozemath.report.history`)."""
    found: dict[str, dict[str, list[list[tuple[int, float]]]]] = defaultdict(lambda: defaultdict(list))
    for r in results:
        if r.train_set == "gsm8k" and r.method != "base" and (key := _curve_key(r.metrics, decoding)):
            points = [(step, 100 * value) for step, value in histories.history(r, key)]
            if points:
                found[r.model][r.method].append(points)
    return {model: {method: _points(seeds) for method, seeds in methods.items()} for model, methods in found.items()}


def _points(seeds: list[list[tuple[int, float]]]) -> list[CurvePoint]:
    found = []
    for k in range(min(map(len, seeds))):
        steps, values = zip(*(curve[k] for curve in seeds))
        found.append(CurvePoint(statistics.fmean(steps), statistics.fmean(values), min(values), max(values), len(seeds)))
    return found


def _curve_key(metrics: dict[str, float], decoding: str) -> str | None:
    """The run's GSM8K curve metric in `decoding` if it logged one, else the one it logged: evaluation during training
    decodes as the run's config says (greedy in the replication), whatever the report's tables use."""
    logged = sorted(k for k in metrics if (m := parse_eval_metric(k)) is not None
                    and (m.prefix, m.set_name, m.stat) == (CURVE_PREFIX, "gsm8k", ACCURACY))
    preferred = eval_metric("gsm8k", decoding, ACCURACY, CURVE_PREFIX)
    return preferred if preferred in logged else next(iter(logged), None)


def no_curve_reason(results: list[TrialResult]) -> str:
    """Why no trial has a point to plot, in words."""
    trained = [r for r in results if r.train_set == "gsm8k" and r.method != "base"]
    if not trained:
        return "no trial was trained on GSM8K"
    return (f"none of the {len(trained)} GSM8K-trained trial{'s' if len(trained) > 1 else ''} evaluated during "
            "training (eval.every_steps or eval.every_share set it going)")


def plot_accuracy_vs_steps(curves: Curves, path: Path, empty_because: str = "") -> Path:
    """A panel per model, a line per method: the mean over seeds, and a band from the lowest to the highest seed.
    Without curves, one panel saying why (`empty_because`, `no_curve_reason`'s)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = ordered(curves, list(MODEL_NAMES)) or ["(no curves)"]
    figure, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.4), squeeze=False)
    if not curves:
        axes[0][0].text(0.5, 0.5, f"Nothing to plot:\n{textwrap.fill(empty_because, 40)}", ha="center",
                        va="center", transform=axes[0][0].transAxes, wrap=True)
    for axis, model in zip(axes[0], models):
        for method in ordered(curves.get(model, {}), list(REPLICATION_METHODS)):
            points = curves[model][method]
            steps = [p.step for p in points]
            seeds = max(p.seeds for p in points)
            label = f"{method_name(method, REPLICATION_NAMES)} ({seeds} seed{'s' if seeds > 1 else ''})"
            (line,) = axis.plot(steps, [p.mean for p in points], marker="o", markersize=3, label=label)
            if seeds > 1:
                axis.fill_between(steps, [p.low for p in points], [p.high for p in points], color=line.get_color(),
                                  alpha=0.2, linewidth=0)
        axis.set_title(model_name(model))
        axis.set_xlabel("training step (mean over seeds)")
        axis.set_ylabel("GSM8K accuracy (%)")
        axis.text(0.01, 0.01, "band: lowest to highest seed", transform=axis.transAxes, fontsize="x-small",
                  color="gray")
        axis.grid(alpha=0.3)
        if curves.get(model):
            axis.legend(fontsize="small")
    figure.tight_layout()
    with atomic_path(path) as temporary:
        figure.savefig(temporary, dpi=120)
    plt.close(figure)
    return path
