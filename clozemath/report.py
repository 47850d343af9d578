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

Printed first, per model and training set, so that a replication shows which differences are more than noise:
- Results: a row per method, a column per (eval set, decoding) its runs have, each cell "mean ± std (n)" over seeds.
- Comparisons: each trained method against IT and against base on every (eval set, decoding) both have: the
  difference in points with a 95% paired bootstrap interval over problems pooled over seeds (`clozemath.intervals`),
  from the per-problem predictions the trials logged as artifacts.
Every trial's tags, params and latest metrics are also written as JSON (`trials.json`).
"""

from __future__ import annotations

import gzip
import io
import json
import os
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from tempfile import TemporaryDirectory

from mlflow import MlflowClient
from mlflow.entities import Run

from clozemath import tracking
from clozemath.claims import PAPER_GSM8K, Comparison, orderings_paragraph, paper_pairs
from clozemath.config import TrackingConfig
from clozemath.data.sources import read_jsonl
from clozemath.errors import ClozeMathError
from clozemath.eval.predictions import Prediction, prediction_from_row
from clozemath.files import atomic_path, write_text_atomic
from clozemath.intervals import BySeed, Difference, hierarchical_difference, paired_difference
from clozemath.records import (
    ACCURACY,
    CORRECT,
    CURVE_PREFIX,
    CUT_SHARE,
    EVAL_PREFIX,
    FALLBACK_SHARE,
    FLEXIBLE_ACCURACY,
    GRID_ROLE,
    METHOD_TAG,
    MODEL_TAG,
    PARENT_TAG,
    PREDICTIONS_ARTIFACTS,
    ROLE_TAG,
    SEED_TAG,
    STRICT_ACCURACY,
    TOTAL,
    TRAIN_SET_TAG,
    TRIAL_TAG,
    UNCUT_ACCURACY,
    eval_metric,
    parse_eval_metric,
)
from clozemath.tasks import get_task, task_names

MODEL_NAMES = {
    "deepseek-math-7b": "DeepSeek-Math", "llama-3.1-8b": "Llama-3.1-8B", "llama-3.2-3b": "Llama-3.2-3B",
    "llama-3.2-1b": "Llama-3.2-1B", "smollm2-135m": "SmolLM2-135M-Instruct",
}
METHOD_NAMES = {
    "base": "Base", "mft": "MFT", "clozemath": "ClozeMath",
    "it_prefixlm": "W/o Text infilling", "clozemath_causal": "W/o PrefixLM",
    "it": "W/o Text-infilling & W/o PrefixLM",
    "random_span": "W/o Equation masking",
}
ABLATIONS = ("it_prefixlm", "clozemath_causal", "it", "random_span")
TRAIN_SETS = ("gsm8k", "math")
"""The paper's training sets, in its tables' order."""
SYMBOLIC_SETS = ("gsm_symbolic", "gsm_p1", "gsm_p2")
"""Table 3's evaluation sets."""
FIGURE_FILE = "accuracy_vs_steps.png"
BASE_DECODING = "greedy"
"""Base models are decoded as lm-evaluation-harness decodes them; their accuracy is its GSM8K strict-match."""
REPLICATION_METHODS = ("base", "it", "mft", "clozemath", "it_prefixlm", "clozemath_causal", "random_span")
"""The order of the results and comparisons tables: the baselines, the paper's methods, then the other ablations."""
REFERENCES = ("it", "base")
"""What each trained method is compared against."""
DECODINGS = ("greedy", "beam", "cot")
TRIALS_FILE = "trials.json"


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
    run_name: str = ""
    tags: dict[str, str] = field(default_factory=dict)
    """The run's own tags (MLflow's `mlflow.*` ones left out)."""
    params: dict[str, str] = field(default_factory=dict)


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
        parents = tracking.find_runs(TrackingConfig(uri=tracking_uri, experiment=experiment), {ROLE_TAG: GRID_ROLE})
        if not parents:
            raise ClozeMathError(f"MLflow experiment '{experiment}': no grid run in it (run `clozemath run` first)")
        parent = parents[0]
    else:
        parent = client.get_run(parent_run_id)
    children = _all_runs(client, found.experiment_id, f"tags.`{PARENT_TAG}` = '{parent.info.run_id}'")
    return parent, [_trial_result(run) for run in children if MODEL_TAG in run.data.tags]


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
    model, method = tags[MODEL_TAG], tags[METHOD_TAG]
    train_set, seed = tags.get(TRAIN_SET_TAG, ""), tags.get(SEED_TAG, "0")
    variant = _variant(tags.get(TRIAL_TAG, ""), model, method, train_set)
    return TrialResult(
        run.info.run_id, model, f"{method} ({variant})" if variant else method, train_set, seed,
        dict(run.data.metrics), None if steps is None else int(steps), None if tokens is None else int(tokens),
        run.info.run_name or "", {k: v for k, v in tags.items() if not k.startswith("mlflow.")}, dict(params),
    )


def _variant(trial: str, model: str, method: str, train_set: str) -> str:
    """The grid point's other axis values (`lr=0.0001` of `grid/method=it,lr=0.0001`): trials that differ in them are
    not seeds of one cell, so the method is reported as `it (lr=0.0001)`."""
    labels = {model, method, train_set}  # a bundle axis may carry another name (`train_set=gsm8k`)
    pairs = [pair.split("=", 1) for pair in trial.split("/", 1)[-1].split(",") if "=" in pair]
    known = {"model", "method", "dataset", "seed"}
    return ",".join(f"{key}={value}" for key, value in pairs if key not in known and value not in labels)


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
        keys = [(eval_metric(s, decoding, CORRECT), eval_metric(s, decoding, TOTAL)) for s in sets]
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
    for train_set in TRAIN_SETS:
        first = len(table.values)
        for method in (m for m in methods if m in ("base", "mft", "clozemath")):
            used = BASE_DECODING if method == "base" else decoding
            row = [cell(results, model, method, train_set, eval_metric(train_set, used, ACCURACY)) for model in models]
            if any(value is not None for value in row):
                table.labels.append([set_title(train_set), METHOD_NAMES[method]])
                table.values.append(row)
        table.groups += _columns_grouped(range(first, len(table.values)), len(models))
    return table


def table_cot(results: list[TrialResult], models: list[str], methods: list[str]) -> Table:
    shown = [m for m in methods if m != "base" and any(
        cell(results, model, m, "gsm8k", eval_metric("gsm8k", "cot", ACCURACY)) is not None for model in models)]
    table = Table("Table 2: GSM8K, CoT-decoding", ["Model", *map(_method_name, shown)], [], [])
    for model in models:
        row = [cell(results, model, method, "gsm8k", eval_metric("gsm8k", "cot", ACCURACY)) for method in shown]
        if any(value is not None for value in row):
            table.labels.append([_model_name(model)])
            table.values.append(row)
            table.groups.append([(len(table.values) - 1, column) for column in range(len(shown))])
    return table


def table_symbolic(results: list[TrialResult], models: list[str], methods: list[str], decoding: str) -> Table:
    header = ["Training set", "Evaluation", "Method", *map(_model_name, models)]
    table = Table("Table 3: GSM-Symbolic", header, [], [])
    evaluations: list[tuple[str, Callable[[str, str, str], float | None]]] = [
        (set_title(s), lambda model, method, train_set, s=s: cell(
            results, model, method, train_set, eval_metric(s, decoding, ACCURACY)))
        for s in SYMBOLIC_SETS
    ]
    evaluations.append(("Overall", lambda model, method, train_set: pooled_cell(
        results, model, method, train_set, list(SYMBOLIC_SETS), decoding)))
    for train_set in TRAIN_SETS:
        for evaluation, measure in evaluations:
            first = len(table.values)
            for method in (m for m in methods if m != "base"):
                row = [measure(model, method, train_set) for model in models]
                if any(value is not None for value in row):
                    table.labels.append([set_title(train_set), evaluation, _method_name(method)])
                    table.values.append(row)
            table.groups += _columns_grouped(range(first, len(table.values)), len(models))
    return table


def table_ablations(results: list[TrialResult], models: list[str], methods: list[str], decoding: str) -> Table:
    metric = eval_metric("gsm8k", decoding, ACCURACY)
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


def set_title(name: str) -> str:
    """The evaluation set as tables name it (its registry title; an unknown set by its own name)."""
    return get_task(name).title if name in task_names() else name


def _model_name(model: str) -> str:
    return MODEL_NAMES.get(model, model)


def _method_name(method: str, names: dict[str, str] = METHOD_NAMES) -> str:
    """The method's name in a table, with a grid variant's axis values (`IT (lr=0.0001)`)."""
    name, _, variant = method.partition(" (")
    return f"{names.get(name, name)} ({variant}" if variant else names.get(method, method)


# --------------------------------------------------------------------------------------------------------------
# Rendering


def _number(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


@dataclass
class TextTable:
    """A table of ready-made cells: the first `labels` columns are labels, the others values."""

    title: str
    header: list[str]
    labels: int
    rows: list[list[str]]


def _as_text(table: Table, bold: str) -> TextTable:
    """The table's cells as text, the best of each group through `bold` (a format string)."""
    best = table.bold()
    rows = [[*label, *(bold.format(_number(v)) if (r, c) in best else _number(v) for c, v in enumerate(values))]
            for r, (label, values) in enumerate(zip(table.labels, table.values))]
    labels = len(table.header) - len(table.values[0]) if table.values else len(table.header)
    return TextTable(table.title, table.header, labels, rows)


def to_markdown(table: Table | TextTable) -> str:
    text = table if isinstance(table, TextTable) else _as_text(table, "**{}**")
    lines = [f"**{text.title}**", "", "| " + " | ".join(text.header) + " |",
             "| " + " | ".join(["---"] * text.labels + ["---:"] * (len(text.header) - text.labels)) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in text.rows]
    if not text.rows:
        lines.append("| " + " | ".join(["(no runs)"] + [""] * (len(text.header) - 1)) + " |")
    return "\n".join(lines)


LATEX_CHARACTERS = {
    "&": r"\&", "%": r"\%", "_": r"\_", "–": "--", "±": r"$\pm$", "Δ": r"$\Delta$", "×": r"$\times$",
}


def _latex_escape(text: str) -> str:
    return "".join(LATEX_CHARACTERS.get(character, character) for character in text)


def to_latex(table: Table | TextTable) -> str:
    text = table if isinstance(table, TextTable) else _as_text(table, r"\textbf{{{}}}")
    spec = "l" * text.labels + "c" * (len(text.header) - text.labels)
    lines = [f"% {text.title}", rf"\begin{{tabular}}{{{spec}}}", r"\toprule",
             " & ".join(rf"\textbf{{{_latex_escape(h)}}}" for h in text.header) + r" \\", r"\midrule"]
    lines += [" & ".join(map(_latex_escape, row)) + r" \\" for row in text.rows]
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines)


def compute_table(results: list[TrialResult]) -> str:
    """Each trained trial's optimizer steps and training tokens (markdown): what a comparison of methods spent."""
    trained = sorted((r for r in results if r.steps is not None), key=lambda r: (r.train_set, r.model, r.method))
    lines = ["**Compute: steps and training tokens per trial**", "",
             "| Training set | Model | Method | Seed | Steps | Training tokens |",
             "| --- | --- | --- | --- | ---: | ---: |"]
    lines += [f"| {set_title(r.train_set)} | {_model_name(r.model)} | {_method_name(r.method)} | "
              f"{r.seed} | {r.steps:,} | {'–' if r.tokens is None else f'{r.tokens:,}'} |" for r in trained]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------
# Results and comparisons (a replication)


Column = tuple[str, str]
"""(eval set, decoding)."""
REPLICATION_NAMES = {**METHOD_NAMES, "it": "IT"}
"""Beside base, MFT and ClozeMath, `it` is the instruction-tuning baseline rather than Table 4's ablation."""


Block = tuple[str, str]
"""(training set, model)."""


def _blocks(results: list[TrialResult]) -> dict[Block, list[TrialResult]]:
    """The trials of each (training set, model), in the report's order."""
    train_sets = _ordered((r.train_set for r in results), list(TRAIN_SETS))
    models = _ordered((r.model for r in results), list(MODEL_NAMES))
    blocks = {(t, m): [r for r in results if (r.train_set, r.model) == (t, m)] for t in train_sets for m in models}
    return {block: trials for block, trials in blocks.items() if trials}


def _rank(name: str, preferred: Sequence[str]) -> tuple[int, str]:
    return (preferred.index(name) if name in preferred else len(preferred), name)


def _eval_columns(trials: list[TrialResult]) -> list[Column]:
    """Every (eval set, decoding) some trial has an accuracy of: the paper's sets first, greedy, beam, CoT first."""
    parsed = [parse_eval_metric(key) for r in trials for key in r.metrics]
    found = {(m.set_name, m.decoding) for m in parsed
             if m is not None and m.prefix == EVAL_PREFIX and m.stat == ACCURACY}
    return sorted(found, key=lambda c: (_rank(c[0], [*TRAIN_SETS, *SYMBOLIC_SETS]), _rank(c[1], DECODINGS)))


def _column_name(column: Column) -> str:
    return f"{set_title(column[0])} {column[1]}"


def _accuracy_metric(column: Column) -> str:
    return eval_metric(column[0], column[1], ACCURACY)


def _measured(trials: list[TrialResult], method: str, column: Column) -> list[TrialResult]:
    return [r for r in trials if r.method == method and _accuracy_metric(column) in r.metrics]


def _percents(trials: list[TrialResult], column: Column) -> list[float]:
    """The accuracy of each of these trials (all measured on `column`), in percent."""
    return [100 * r.metrics[_accuracy_metric(column)] for r in trials]


def _spread(values: list[float]) -> str:
    """The cell "mean ± std (n)" over seeds (the sample std; a single seed has none)."""
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.2f} (1)"
    return f"{statistics.fmean(values):.2f} ± {statistics.stdev(values):.2f} ({len(values)})"


def results_tables(results: list[TrialResult]) -> list[TextTable]:
    """Per training set and model: a row per method, a column per (eval set, decoding), the spread over seeds."""
    tables = []
    for (train_set, model), trials in _blocks(results).items():
        columns = _eval_columns(trials)
        rows = [[_method_name(method, REPLICATION_NAMES),
                 *(_spread(_percents(_measured(trials, method, column), column)) for column in columns)]
                for method in _ordered((r.method for r in trials), REPLICATION_METHODS)]
        title = (f"Results: {_model_name(model)} trained on {set_title(train_set)}, "
                 "accuracy (%), mean ± std over seeds (n)")
        tables.append(TextTable(title, ["Method", *map(_column_name, columns)], 1, rows))
    return tables


def _mean_cell(trials: list[TrialResult], column: Column, stat: str) -> str:
    """The mean over these trials of one statistic of `column`, in percent (– where none measured it)."""
    values = [100 * r.metrics[key] for r in trials if (key := eval_metric(*column, stat)) in r.metrics]
    return "–" if not values else f"{statistics.fmean(values):.{1 if stat.endswith('share') else 2}f}"


GRADING_STATS = (ACCURACY, STRICT_ACCURACY, FLEXIBLE_ACCURACY, FALLBACK_SHARE, CUT_SHARE, UNCUT_ACCURACY)
GRADING_HEADER = ["Accuracy", "Strict", "Flexible", "Fallback share", "Cut share", "Accuracy uncut"]


def grading_tables(results: list[TrialResult]) -> list[TextTable]:
    """Per training set and model: how each method's answers were graded, mean over seeds, in percent: its accuracy;
    strict (only answers after `####`; the harness's strict-match for base) and flexible (the last number too; the
    harness's flexible-extract); the share of answers the last-number fallback found; the share of generations cut at
    `max_new_tokens` and the accuracy of the others."""
    tables = []
    for (train_set, model), trials in _blocks(results).items():
        rows = []
        for column in _eval_columns(trials):
            for method in _ordered({r.method for r in trials}, REPLICATION_METHODS):
                measured = _measured(trials, method, column)
                if measured:
                    rows.append([_column_name(column), _method_name(method, REPLICATION_NAMES),
                                 *(_mean_cell(measured, column, stat) for stat in GRADING_STATS)])
        title = (f"Grading: {_model_name(model)} trained on {set_title(train_set)}, mean over seeds (%); strict counts "
                 "only `####` answers (base: the harness's strict-match), flexible the last number too (base: "
                 "flexible-extract)")
        tables.append(TextTable(title, ["Evaluation", "Method", *GRADING_HEADER], 2, rows))
    return tables


Predictions = dict[Column, dict[str, bool]]
"""(eval set, decoding) -> problem id -> correct."""
EXPORT_FILE = "predictions.jsonl.gz"
EXPORTS = ("full", "compact")
"""What `export_predictions` keeps of a prediction: everything but the prompt (`full`), or also not the generation
(`compact`: the answer, its rule and verdicts, how the generation ended)."""


class PredictionArtifacts:
    """Each run's predictions from its `eval/predictions/<set>.jsonl` artifacts, downloaded once; or all runs' from
    files `export_predictions` wrote (`exported`), which need no artifact store."""

    def __init__(self, tracking_uri: str, exported: Sequence[str | Path] = ()) -> None:
        self._client = tracking.client(tracking_uri)
        self._runs: dict[str, list[Prediction]] = {}
        self._exported = bool(exported)
        for path in exported:
            self._runs |= self._read_export(Path(path))

    def predictions(self, run_id: str) -> list[Prediction]:
        """The run's predictions, every set and decoding (none if it logged none)."""
        if run_id not in self._runs:
            self._runs[run_id] = [] if self._exported else self._download(run_id)
        return self._runs[run_id]

    def correctness(self, run_id: str, column: Column) -> dict[str, bool] | None:
        """None when the run logged no predictions of this set and decoding."""
        found = {p.id: p.correct for p in self.predictions(run_id) if (p.dataset, p.decoding) == column}
        return found or None

    def _download(self, run_id: str) -> list[Prediction]:
        files = [artifact.path for artifact in self._client.list_artifacts(run_id, PREDICTIONS_ARTIFACTS)
                 if artifact.path.endswith(".jsonl") and not artifact.path.endswith(".partial.jsonl")]
        os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"  # a bar per file would bury the tables
        found = []
        with TemporaryDirectory() as folder:
            for path in files:
                local = Path(self._client.download_artifacts(run_id, path, folder))
                # lines end at "\n" only: a generation may hold U+2028
                found += [prediction_from_row(row, where) for where, row in read_jsonl(local)]
        return found

    @staticmethod
    def _read_export(path: Path) -> dict[str, list[Prediction]]:
        if not path.is_file():
            raise ClozeMathError(f"{path}: no such predictions export (`clozemath report --export-predictions`)")
        runs: dict[str, list[Prediction]] = defaultdict(list)
        for where, row in read_jsonl(path):
            if not isinstance(row.get("run_id"), str):
                raise ClozeMathError(f"{where}: no 'run_id' (not a file `clozemath report --export-predictions` wrote)")
            runs[row["run_id"]].append(prediction_from_row({"generation": "", **row}, where))  # compact: none
        return dict(runs)


def export_predictions(results: list[TrialResult], artifacts: PredictionArtifacts, path: Path, keep: str) -> Path:
    """Every trial's predictions in one gzipped JSONL file, a line per prediction with its run (id, name, model,
    method, seed, training set); without the prompts (rebuilt from the problem), and in `compact` without the
    generations. Reproducible: the same runs give the same bytes."""
    if keep not in EXPORTS:
        raise ClozeMathError(f"--export-predictions: '{keep}' is none of {', '.join(EXPORTS)}")
    dropped = {"prompt"} | ({"generation"} if keep == "compact" else set())
    ordered = sorted(results, key=lambda r: (r.train_set, r.model, r.method, r.seed, r.run_id))
    with atomic_path(path) as temporary, temporary.open("wb") as file, \
            gzip.GzipFile(filename="", mode="wb", fileobj=file, mtime=0) as raw:  # no name nor time in the header
        with io.TextIOWrapper(raw, encoding="utf-8", newline="\n") as handle:
            for r in ordered:
                run = {"run_id": r.run_id, "run_name": r.run_name, "model": r.model, "method": r.method,
                       "seed": r.seed, "train_set": r.train_set}
                for prediction in artifacts.predictions(r.run_id):
                    row = {key: value for key, value in asdict(prediction).items() if key not in dropped}
                    handle.write(json.dumps({**run, **row}, ensure_ascii=False) + "\n")
    return path


def _by_seed(trials: list[TrialResult], column: Column, artifacts: PredictionArtifacts) -> BySeed | None:
    """Seed -> per-problem correctness of these trials; None when one of them has no predictions."""
    found = {}
    for r in trials:
        correctness = artifacts.correctness(r.run_id, column)
        if correctness is None:
            return None
        found[r.seed] = correctness
    return found


def _compared_pairs(measured: set[str]) -> list[tuple[str, str]]:
    """The (method, reference) pairs of one evaluation: every pair the paper's numbers order, its better method
    first (`clozemath.claims`); then each other trained method (a grid's variant) against IT and against base."""
    pairs = paper_pairs(measured, REPLICATION_METHODS)
    others = _ordered(measured - set(PAPER_GSM8K) - {"base"}, REPLICATION_METHODS)
    return pairs + [(method, reference) for method in others for reference in REFERENCES if reference in measured]


def _compare(trials: list[TrialResult], method: str, reference: str, column: Column,
             artifacts: PredictionArtifacts) -> Comparison:
    compared, against = _measured(trials, method, column), _measured(trials, reference, column)
    gap = statistics.fmean(_percents(compared, column)) - statistics.fmean(_percents(against, column))
    compared_seeds, against_seeds = _by_seed(compared, column, artifacts), _by_seed(against, column, artifacts)
    if compared_seeds is None or against_seeds is None:
        return Comparison(column, method, reference, gap, None, None, "no predictions")
    seeds = hierarchical_difference(compared_seeds, against_seeds)
    problems = paired_difference(compared_seeds, against_seeds)
    return Comparison(column, method, reference, gap, seeds, problems, "" if seeds else "no seeds or problems pair")


def comparisons(results: list[TrialResult], artifacts: PredictionArtifacts) -> dict[Block, list[Comparison]]:
    """Per training set and model, on every (eval set, decoding): each pair of methods the paper orders, and each
    other trained method against IT and base."""
    found: dict[Block, list[Comparison]] = {}
    for block, trials in _blocks(results).items():
        found[block] = []
        for column in _eval_columns(trials):
            measured = {r.method for r in trials if _accuracy_metric(column) in r.metrics}
            found[block] += [_compare(trials, method, reference, column, artifacts)
                             for method, reference in _compared_pairs(measured)]
    return found


def _interval(difference: Difference | None) -> str:
    return "–" if difference is None else f"[{difference.low:+.2f}, {difference.high:+.2f}]"


def _comparison_row(comparison: Comparison) -> list[str]:
    labels = [_column_name(comparison.evaluation), _method_name(comparison.method, REPLICATION_NAMES),
              _method_name(comparison.reference, REPLICATION_NAMES)]
    seeds, problems = comparison.seeds, comparison.problems
    if seeds is None or problems is None:
        return [*labels, f"{comparison.gap:+.2f}", f"– ({comparison.missing}: difference of the means)", "–", "–", "–"]
    return [*labels, f"{seeds.points:+.2f}", _interval(seeds), "yes" if seeds.excludes_zero else "no",
            _interval(problems), f"{seeds.pairs} × {seeds.problems:,}"]


def comparison_tables(found: dict[Block, list[Comparison]]) -> list[TextTable]:
    """Per training set and model, a row per comparison: the difference, its interval over seeds and problems (what
    "excludes 0" judges), and its interval over problems alone (`clozemath.intervals`)."""
    header = ["Evaluation", "Method", "vs", "Δ (pp)", "95% interval, seeds and problems", "Excludes 0",
              "95% interval, problems only", "Seed pairs × problems"]
    tables = []
    for (train_set, model), rows in found.items():
        if rows:
            title = (f"Comparisons: {_model_name(model)} trained on {set_title(train_set)}, method - reference in "
                     "accuracy points; the 95% interval resamples seeds, then problems (hierarchical bootstrap; "
                     "\"excludes 0\" judges it), beside the interval over problems with the trained models held fixed")
            tables.append(TextTable(title, header, 3, [_comparison_row(c) for c in rows]))
    return tables


def orderings(found: dict[Block, list[Comparison]], decoding: str) -> str:
    """The paper's orderings against this replication on GSM8K-trained runs evaluated on GSM8K with `decoding` (else
    greedy): a paragraph per model (`clozemath.claims.orderings_paragraph`)."""
    paragraphs = []
    for (train_set, model), rows in found.items():
        if train_set != "gsm8k":
            continue
        decodings = [d for d in (decoding, BASE_DECODING) if any(c.evaluation == ("gsm8k", d) for c in rows)]
        if not decodings:
            continue
        evaluation = ("gsm8k", decodings[0])
        paired = [c for c in rows if c.evaluation == evaluation and (c.method, c.reference) in
                  paper_pairs({c.method, c.reference}, REPLICATION_METHODS)]
        text = orderings_paragraph(paired, lambda m: _method_name(m, REPLICATION_NAMES),
                                   f"{_column_name(evaluation)} ({_model_name(model)})")
        if text:
            paragraphs.append(text)
    return "\n\n".join(paragraphs)


def trials_json(results: list[TrialResult]) -> str:
    """Every trial's run id and name, tags, params and latest metrics."""
    ordered = sorted(results, key=lambda r: (r.train_set, r.model, r.method, r.seed, r.run_id))
    trials = [{"run_id": r.run_id, "run_name": r.run_name, "tags": r.tags, "params": r.params, "metrics": r.metrics}
              for r in ordered]
    return json.dumps(trials, indent=1, sort_keys=True) + "\n"


# --------------------------------------------------------------------------------------------------------------
# Figure 3


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


def accuracy_curves(tracking_uri: str, results: list[TrialResult], decoding: str) -> Curves:
    """Model -> method -> its points, GSM8K-trained runs: the k-th point is the k-th evaluation of each seed that
    logged a curve (the first k that all of them reached), its accuracy averaged, with the seeds' range."""
    client = tracking.client(tracking_uri)
    histories: dict[str, dict[str, list[list[tuple[int, float]]]]] = defaultdict(lambda: defaultdict(list))
    for r in results:
        if r.train_set != "gsm8k" or r.method == "base":
            continue
        key = _curve_key(r.metrics, decoding)
        points = sorted((point.step, 100 * point.value) for point in client.get_metric_history(r.run_id, key)) \
            if key else []
        if points:
            histories[r.model][r.method].append(points)
    return {model: {method: _points(seeds) for method, seeds in methods.items()} for model, methods in histories.items()}


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


def plot_accuracy_vs_steps(curves: Curves, path: Path) -> Path:
    """A panel per model, a line per method: the mean over seeds, and a band from the lowest to the highest seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = _ordered(curves, list(MODEL_NAMES)) or ["(no runs)"]
    figure, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.4), squeeze=False)
    for axis, model in zip(axes[0], models):
        for method in _ordered(curves.get(model, {}), list(REPLICATION_METHODS)):
            points = curves[model][method]
            steps = [p.step for p in points]
            seeds = max(p.seeds for p in points)
            label = f"{_method_name(method, REPLICATION_NAMES)} ({seeds} seed{'s' if seeds > 1 else ''})"
            (line,) = axis.plot(steps, [p.mean for p in points], marker="o", markersize=3, label=label)
            if seeds > 1:
                axis.fill_between(steps, [p.low for p in points], [p.high for p in points], color=line.get_color(),
                                  alpha=0.2, linewidth=0)
        axis.set_title(_model_name(model))
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


# --------------------------------------------------------------------------------------------------------------
# The command

SUMMARY_FILE = "summary.md"


def experiments_runs(tracking_uri: str, experiments: Sequence[str], parent_run_id: str | None = None
                     ) -> list[tuple[Run, list[TrialResult]]]:
    """Each experiment's grid run and trials (`grid_runs`), to be reported as one: grids that share a trial (the
    same model, method, training set and seed) are refused, since their results would be pooled as if seeds."""
    if parent_run_id is not None and len(experiments) != 1:
        raise ClozeMathError("--parent names one grid's run: give one --experiment with it")
    grids = [grid_runs(tracking_uri, name, parent_run_id) for name in experiments]
    seen: dict[tuple[str, str, str, str], str] = {}
    for name, (_, runs) in zip(experiments, grids):
        for r in runs:
            key = (r.model, r.method, r.train_set, r.seed)
            if seen.setdefault(key, name) != name:
                raise ClozeMathError(f"experiments '{seen[key]}' and '{name}' both hold {r.method} seed {r.seed} of "
                                     f"{r.model} on {r.train_set}: report them apart")
    return grids


def report_folder(experiment: str | Sequence[str], out: str | Path | None) -> Path:
    """Where the report is written: `out`, by default `reports/<experiment>[+<experiment>...]`."""
    names = [experiment] if isinstance(experiment, str) else list(experiment)
    return Path(out) if out is not None else Path("reports") / "+".join(names)


def report(
    experiment: str | Sequence[str],
    tracking_uri: str = "sqlite:///mlruns.db",
    out: str | Path | None = None,
    latex: bool = False,
    parent_run_id: str | None = None,
    decoding: str = "beam",
    export: str | None = None,
    exported: Sequence[str | Path] = (),
) -> str:
    """Print the results, grading and comparisons tables and the paper's tables that have runs (markdown, or LaTeX)
    of one experiment's grid, or of several reported as one (Table 4's ablations beside the main grid's runs); write
    them, the paper's orderings against this replication (`summary.md`, markdown for the README), the trials' metrics
    (JSON) and Figure 3 under `out` (default `reports/<experiment>[+<experiment>...]`); returns the printed text.
    `export`: also write every trial's predictions (`export_predictions`, full or compact) there. `exported`: read
    the predictions from such files instead of the runs' artifacts."""
    names = [experiment] if isinstance(experiment, str) else list(experiment)
    grids = experiments_runs(tracking_uri, names, parent_run_id)
    results = [r for _, runs in grids for r in runs]
    folder = report_folder(names, out)
    folder.mkdir(parents=True, exist_ok=True)
    artifacts = PredictionArtifacts(tracking_uri, exported)
    found = comparisons(results, artifacts)
    render: Callable[[Table | TextTable], str] = to_latex if latex else to_markdown
    tables: list[Table | TextTable] = [
        *results_tables(results), *comparison_tables(found), *grading_tables(results),
        *(table for table in paper_tables(results, decoding) if table.values),
    ]
    text = "\n\n".join([*map(render, tables), compute_table(results)])
    tables_file = folder / ("tables.tex" if latex else "tables.md")
    write_text_atomic(tables_file, text + "\n")
    summary = orderings(found, decoding)
    write_text_atomic(folder / SUMMARY_FILE, summary + "\n")
    write_text_atomic(folder / TRIALS_FILE, trials_json(results))
    figure = plot_accuracy_vs_steps(accuracy_curves(tracking_uri, results, decoding), folder / FIGURE_FILE)
    written = [tables_file, folder / SUMMARY_FILE, folder / TRIALS_FILE, figure]
    if export is not None:
        written.append(export_predictions(results, artifacts, folder / EXPORT_FILE, export))
    for parent, runs in grids:
        print(f"grid run {parent.info.run_id} ({parent.info.run_name}): {len(runs)} trials")
    print()
    print("\n\n".join(filter(None, [summary, text])))
    sizes = ", ".join(f"{path} ({path.stat().st_size / 2**20:.1f} MiB)" if path.suffix == ".gz" else str(path)
                      for path in written)
    print(f"\nwritten: {sizes}")
    return text
