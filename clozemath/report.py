"""The paper's tables and Figure 3 from the tracked runs of a grid (`clozemath report`).

The child runs of a grid's MLflow run carry the tags `model`, `method`, `train_set` and `seed` and the metrics
`eval/<set>/<decoding>/{accuracy,correct,total}`; a cell is the mean over seeds of one accuracy, in percent.

- Table 1 (overall): training set x {Base, MFT, ClozeMath} rows, a column per model; each model evaluated on the set
  it was trained on, with `decoding` (beam search); base models few-shot, greedy, as lm-evaluation-harness runs them.
- Table 2 (CoT-decoding): a row per model, a column per method; GSM8K-trained, GSM8K test, CoT-decoding.
- Table 3 (GSM-Symbolic): training set x {GSM-Sym, GSM-P1, GSM-P2, Overall} x method rows, a column per model;
  Overall is the pooled accuracy of the three sets (their correct answers over their problems).
- Table 4 (ablations): ClozeMath and its ablations on GSM8K, a column per model that has ablations.
- Figure 3: GSM8K accuracy against training steps (`eval.every_steps`, every point on the same subset of GSM8K test),
  a panel per model, a line per method.

The best cell of each comparison is bold: per column within a block (Tables 1, 3, 4), per model (Table 2's rows).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import Run

from clozemath import tracking
from clozemath.config import TrackingConfig
from clozemath.errors import ClozeMathError
from clozemath.eval.during_training import CURVE
from clozemath.files import atomic_path, write_text_atomic

MODEL_NAMES = {
    "deepseek-math-7b": "DeepSeek-Math", "llama-3.1-8b": "Llama-3.1-8B", "llama-3.2-3b": "Llama-3.2-3B",
    "llama-3.2-1b": "Llama-3.2-1B",
}
METHOD_NAMES = {
    "base": "Base", "mft": "MFT", "clozemath": "ClozeMath",
    "it_prefixlm": "W/o Text infilling", "clozemath_causal": "W/o PrefixLM",
    "it": "W/o Text-infilling & W/o PrefixLM",
    "random_span": "W/o Equation masking",
}
ABLATIONS = ("it_prefixlm", "clozemath_causal", "it", "random_span")
TRAIN_SETS = {"gsm8k": "GSM8K", "math": "MATH"}
SYMBOLIC_SETS = {"gsm_symbolic": "GSM-Sym", "gsm_p1": "GSM-P1", "gsm_p2": "GSM-P2"}
FIGURE_FILE = "accuracy_vs_steps.png"
BASE_DECODING = "greedy"
"""Base models are decoded as lm-evaluation-harness decodes them; their accuracy is its GSM8K strict-match."""


@dataclass(frozen=True)
class TrialResult:
    """One child run: what it trained, and its metrics' latest values."""

    run_id: str
    model: str
    method: str
    train_set: str
    seed: str
    metrics: dict[str, float]
    steps: int | None = None
    """The optimizer steps the trial planned (None: it trained nothing, or predates this record)."""
    tokens: int | None = None
    """The training tokens those steps see."""


@dataclass
class Table:
    title: str
    header: list[str]
    labels: list[list[str]]
    """The label cells of each row (training set, method, ...)."""
    values: list[list[float | None]]
    """Accuracy in percent per row and value column; None where no run measured it."""
    groups: list[list[tuple[int, int]]] = field(default_factory=list)
    """Cells (row, value column) compared with each other: the best of each group is bold."""

    def bold(self) -> set[tuple[int, int]]:
        best = set()
        for group in self.groups:
            present = [((r, c), self.values[r][c]) for r, c in group if self.values[r][c] is not None]
            if present:
                top = max(round(value, 2) for _, value in present)
                best |= {cell for cell, value in present if round(value, 2) == top}
        return best


# --------------------------------------------------------------------------------------------------------------
# Runs


def grid_runs(tracking_uri: str, experiment: str, parent_run_id: str | None = None) -> tuple[Run, list[TrialResult]]:
    """The grid's parent run (the latest of the experiment unless chosen) and its child runs."""
    client = tracking.client(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise ClozeMathError(f"MLflow experiment '{experiment}' not found in {tracking.resolved_uri(tracking_uri)}")
    if parent_run_id is None:
        parents = tracking.find_runs(TrackingConfig(uri=tracking_uri, experiment=experiment), {"role": "grid"})
        if not parents:
            raise ClozeMathError(f"MLflow experiment '{experiment}': no grid run in it (run `clozemath run` first)")
        parent = parents[0]
    else:
        parent = client.get_run(parent_run_id)
    children = _all_runs(client, found.experiment_id, f"tags.`{tracking.PARENT_TAG}` = '{parent.info.run_id}'")
    return parent, [_trial_result(run) for run in children if "model" in run.data.tags]


def _all_runs(client: MlflowClient, experiment_id: str, query: str) -> list[Run]:
    runs, token = [], None
    while True:
        page = client.search_runs([experiment_id], filter_string=query, max_results=1000, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def _trial_result(run: Run) -> TrialResult:
    tags, params = run.data.tags, run.data.params
    steps, tokens = (params.get(f"train.planned_{name}") for name in ("steps", "tokens"))
    return TrialResult(
        run.info.run_id, tags["model"], tags["method"], tags.get("train_set", ""), tags.get("seed", "0"),
        dict(run.data.metrics), None if steps is None else int(steps), None if tokens is None else int(tokens),
    )


# --------------------------------------------------------------------------------------------------------------
# Cells


def _ordered(names: Iterable[str], preferred: Sequence[str]) -> list[str]:
    present = set(names)
    return [name for name in preferred if name in present] + sorted(present - set(preferred))


def _mean(values: list[float]) -> float | None:
    return 100 * statistics.fmean(values) if values else None


def cell(results: list[TrialResult], model: str, method: str, train_set: str, metric: str) -> float | None:
    """Mean over seeds of one metric, in percent."""
    return _mean([r.metrics[metric] for r in results
                  if (r.model, r.method, r.train_set) == (model, method, train_set) and metric in r.metrics])


def pooled_cell(results: list[TrialResult], model: str, method: str, train_set: str, sets: Sequence[str],
                decoding: str) -> float | None:
    """Mean over seeds of the pooled accuracy of several sets (all of them measured)."""
    pooled = []
    for r in results:
        if (r.model, r.method, r.train_set) != (model, method, train_set):
            continue
        keys = [(f"eval/{s}/{decoding}/correct", f"eval/{s}/{decoding}/total") for s in sets]
        if all(c in r.metrics and t in r.metrics for c, t in keys):
            total = sum(r.metrics[t] for _, t in keys)
            pooled.append(sum(r.metrics[c] for c, _ in keys) / total if total else 0.0)
    return _mean(pooled)


def _columns_grouped(rows: Sequence[int], columns: int) -> list[list[tuple[int, int]]]:
    return [[(row, column) for row in rows] for column in range(columns)]


# --------------------------------------------------------------------------------------------------------------
# The tables


def table_overall(results: list[TrialResult], models: list[str], methods: list[str], decoding: str) -> Table:
    table = Table("Table 1: overall accuracy", ["Training set", "Method", *map(_model_name, models)], [], [])
    for train_set, set_name in TRAIN_SETS.items():
        first = len(table.values)
        for method in (m for m in methods if m in ("base", "mft", "clozemath")):
            used = BASE_DECODING if method == "base" else decoding
            row = [cell(results, model, method, train_set, f"eval/{train_set}/{used}/accuracy") for model in models]
            if any(value is not None for value in row):
                table.labels.append([set_name, METHOD_NAMES[method]])
                table.values.append(row)
        table.groups += _columns_grouped(range(first, len(table.values)), len(models))
    return table


def table_cot(results: list[TrialResult], models: list[str], methods: list[str]) -> Table:
    shown = [m for m in methods if m != "base" and any(
        cell(results, model, m, "gsm8k", "eval/gsm8k/cot/accuracy") is not None for model in models)]
    table = Table("Table 2: GSM8K, CoT-decoding", ["Model", *map(_method_name, shown)], [], [])
    for model in models:
        row = [cell(results, model, method, "gsm8k", "eval/gsm8k/cot/accuracy") for method in shown]
        if any(value is not None for value in row):
            table.labels.append([_model_name(model)])
            table.values.append(row)
            table.groups.append([(len(table.values) - 1, column) for column in range(len(shown))])
    return table


def table_symbolic(results: list[TrialResult], models: list[str], methods: list[str], decoding: str) -> Table:
    header = ["Training set", "Evaluation", "Method", *map(_model_name, models)]
    table = Table("Table 3: GSM-Symbolic", header, [], [])
    evaluations: list[tuple[str, Callable[[str, str, str], float | None]]] = [
        (name, lambda model, method, train_set, s=s: cell(
            results, model, method, train_set, f"eval/{s}/{decoding}/accuracy"))
        for s, name in SYMBOLIC_SETS.items()
    ]
    evaluations.append(("Overall", lambda model, method, train_set: pooled_cell(
        results, model, method, train_set, list(SYMBOLIC_SETS), decoding)))
    for train_set, set_name in TRAIN_SETS.items():
        for evaluation, measure in evaluations:
            first = len(table.values)
            for method in (m for m in methods if m != "base"):
                row = [measure(model, method, train_set) for model in models]
                if any(value is not None for value in row):
                    table.labels.append([set_name, evaluation, _method_name(method)])
                    table.values.append(row)
            table.groups += _columns_grouped(range(first, len(table.values)), len(models))
    return table


def table_ablations(results: list[TrialResult], models: list[str], methods: list[str], decoding: str) -> Table:
    metric = f"eval/gsm8k/{decoding}/accuracy"
    ablated = [m for m in models if any(cell(results, m, method, "gsm8k", metric) is not None for method in ABLATIONS)]
    columns = ablated or models
    table = Table("Table 4: ablations (GSM8K)", ["Method", *map(_model_name, columns)], [], [])
    for method in (m for m in methods if m == "clozemath" or m in ABLATIONS):
        row = [cell(results, model, method, "gsm8k", metric) for model in columns]
        if any(value is not None for value in row):
            table.labels.append([METHOD_NAMES[method]])
            table.values.append(row)
    table.groups = _columns_grouped(range(len(table.values)), len(columns))
    return table


def paper_tables(results: list[TrialResult], decoding: str = "beam") -> list[Table]:
    models = _ordered((r.model for r in results), list(MODEL_NAMES))
    methods = _ordered((r.method for r in results), list(METHOD_NAMES))
    return [
        table_overall(results, models, methods, decoding),
        table_cot(results, models, methods),
        table_symbolic(results, models, methods, decoding),
        table_ablations(results, models, methods, decoding),
    ]


def _model_name(model: str) -> str:
    return MODEL_NAMES.get(model, model)


def _method_name(method: str) -> str:
    return METHOD_NAMES.get(method, method)


# --------------------------------------------------------------------------------------------------------------
# Rendering


def _number(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def to_markdown(table: Table) -> str:
    bold = table.bold()
    labels = len(table.header) - len(table.values[0]) if table.values else len(table.header)
    lines = [f"**{table.title}**", "", "| " + " | ".join(table.header) + " |",
             "| " + " | ".join(["---"] * labels + ["---:"] * (len(table.header) - labels)) + " |"]
    for r, (label, row) in enumerate(zip(table.labels, table.values)):
        cells = [f"**{_number(v)}**" if (r, c) in bold else _number(v) for c, v in enumerate(row)]
        lines.append("| " + " | ".join([*label, *cells]) + " |")
    if not table.values:
        lines.append("| " + " | ".join(["(no runs)"] + [""] * (len(table.header) - 1)) + " |")
    return "\n".join(lines)


def _latex_escape(text: str) -> str:
    return text.replace("&", r"\&").replace("%", r"\%").replace("_", r"\_")


def to_latex(table: Table) -> str:
    bold = table.bold()
    labels = len(table.labels[0]) if table.labels else 1
    spec = "l" * labels + "c" * (len(table.header) - labels)
    lines = [f"% {table.title}", rf"\begin{{tabular}}{{{spec}}}", r"\toprule",
             " & ".join(rf"\textbf{{{_latex_escape(h)}}}" for h in table.header) + r" \\", r"\midrule"]
    for r, (label, row) in enumerate(zip(table.labels, table.values)):
        cells = [rf"\textbf{{{_number(v)}}}" if (r, c) in bold else _number(v) for c, v in enumerate(row)]
        lines.append(" & ".join([*map(_latex_escape, label), *cells]).replace("–", "--") + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines)


def compute_table(results: list[TrialResult]) -> str:
    """Each trained trial's optimizer steps and training tokens (markdown): what a comparison of methods spent."""
    trained = sorted((r for r in results if r.steps is not None), key=lambda r: (r.train_set, r.model, r.method))
    lines = ["**Compute: steps and training tokens per trial**", "",
             "| Training set | Model | Method | Seed | Steps | Training tokens |",
             "| --- | --- | --- | --- | ---: | ---: |"]
    lines += [f"| {TRAIN_SETS.get(r.train_set, r.train_set)} | {_model_name(r.model)} | {_method_name(r.method)} | "
              f"{r.seed} | {r.steps:,} | {'–' if r.tokens is None else f'{r.tokens:,}'} |" for r in trained]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------
# Figure 3


Curves = dict[str, dict[str, list[tuple[int, float]]]]


def accuracy_curves(tracking_uri: str, results: list[TrialResult], decoding: str) -> Curves:
    """Model -> method -> [(step, accuracy in percent)], GSM8K-trained runs, mean over seeds at each step."""
    client = tracking.client(tracking_uri)
    by_step: dict[str, dict[str, dict[int, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in results:
        if r.train_set != "gsm8k" or r.method == "base":
            continue
        for point in client.get_metric_history(r.run_id, f"{CURVE}/gsm8k/{decoding}/accuracy"):
            by_step[r.model][r.method][point.step].append(100 * point.value)
    return {
        model: {method: sorted((step, statistics.fmean(v)) for step, v in by.items()) for method, by in methods.items()}
        for model, methods in by_step.items()
    }


def plot_accuracy_vs_steps(curves: Curves, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = _ordered(curves, list(MODEL_NAMES)) or ["(no runs)"]
    figure, axes = plt.subplots(1, len(models), figsize=(4 * len(models), 3.2), squeeze=False)
    for axis, model in zip(axes[0], models):
        for method in _ordered(curves.get(model, {}), list(METHOD_NAMES)):
            steps, accuracy = zip(*curves[model][method])
            axis.plot(steps, accuracy, marker="o", label=_method_name(method))
        axis.set_title(_model_name(model))
        axis.set_xlabel("training step")
        axis.set_ylabel("GSM8K accuracy (%)")
        axis.grid(alpha=0.3)
        if curves.get(model):
            axis.legend()
    figure.tight_layout()
    with atomic_path(path) as temporary:
        figure.savefig(temporary, dpi=120)
    plt.close(figure)
    return path


# --------------------------------------------------------------------------------------------------------------
# The command


def report(
    experiment: str,
    tracking_uri: str = "sqlite:///mlruns.db",
    out: str | Path | None = None,
    latex: bool = False,
    parent_run_id: str | None = None,
    decoding: str = "beam",
) -> str:
    """Print the four tables (markdown, or LaTeX), write them and Figure 3 under `out` (default
    `reports/<experiment>`); returns the printed text."""
    parent, results = grid_runs(tracking_uri, experiment, parent_run_id)
    render = to_latex if latex else to_markdown
    text = "\n\n".join([*(render(table) for table in paper_tables(results, decoding)), compute_table(results)])
    folder = Path(out) if out is not None else Path("reports") / experiment
    folder.mkdir(parents=True, exist_ok=True)
    write_text_atomic(folder / ("tables.tex" if latex else "tables.md"), text + "\n")
    figure = plot_accuracy_vs_steps(accuracy_curves(tracking_uri, results, decoding), folder / FIGURE_FILE)
    print(f"grid run {parent.info.run_id} ({parent.info.run_name}): {len(results)} trials\n")
    print(text)
    print(f"\nwritten: {folder / ('tables.tex' if latex else 'tables.md')}, {figure}")
    return text
