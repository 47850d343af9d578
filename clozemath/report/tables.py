"""The report's tables: the paper's Tables 1-4, compute, and per training set and model the results (spread over
seeds), the grading and the comparisons (`clozemath.report.compare`)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from clozemath.claims import Comparison, provisional_label
from clozemath.data.training_sets import training_set_names
from clozemath.intervals import MIN_SEEDS, Difference
from clozemath.records import (
    ACCURACY,
    CORRECT,
    CUT_SHARE,
    EVAL_DECODE_S,
    EVAL_SECONDS,
    EVAL_STARTUP_S,
    FALLBACK_SHARE,
    FLEXIBLE_ACCURACY,
    LENIENT_ACCURACY,
    STRICT_ACCURACY,
    TOTAL,
    UNCUT_ACCURACY,
    eval_metric,
)
from clozemath.report.compare import NoiseFloor
from clozemath.report.names import (
    ABLATIONS,
    BASE_DECODING,
    METHOD_NAMES,
    MODEL_NAMES,
    REPLICATION_METHODS,
    REPLICATION_NAMES,
    SYMBOLIC_SETS,
    Block,
    Column,
    column_name,
    method_name,
    model_name,
    ordered,
    set_title,
)
from clozemath.report.render import Table, TextTable, spread
from clozemath.report.runs import TrialResult, blocks, eval_columns, measured_on, percents
from clozemath.tasks.base import ACCURACY_RULE_SHORT


def cell(results: list[TrialResult], model: str, method: str, train_set: str, metric: str) -> list[float]:
    """Each seed's value of one metric, in percent."""
    return [100 * r.metrics[metric] for r in results
            if (r.model, r.method, r.train_set) == (model, method, train_set) and metric in r.metrics]


def pooled_cell(results: list[TrialResult], model: str, method: str, train_set: str, sets: Sequence[str],
                decoding: str) -> list[float]:
    """Each seed's pooled accuracy of several sets (all of them measured), in percent."""
    pooled = []
    for r in results:
        if (r.model, r.method, r.train_set) != (model, method, train_set):
            continue
        keys = [(eval_metric(s, decoding, CORRECT), eval_metric(s, decoding, TOTAL)) for s in sets]
        if all(c in r.metrics and t in r.metrics for c, t in keys):
            total = sum(r.metrics[t] for _, t in keys)
            pooled.append(100 * sum(r.metrics[c] for c, _ in keys) / total if total else 0.0)
    return pooled


def _columns_grouped(rows: Sequence[int], columns: int) -> list[list[tuple[int, int]]]:
    return [[(row, column) for row in rows] for column in range(columns)]


def table_overall(results: list[TrialResult], models: list[str], methods: list[str], decoding: str) -> Table:
    table = Table(f"Table 1: overall accuracy ({ACCURACY_RULE_SHORT})", ["Training set", "Method", *map(model_name, models)], [], [])
    for train_set in training_set_names():
        first = len(table.cells)
        for method in (m for m in methods if m in ("base", "mft", "clozemath")):
            used = BASE_DECODING if method == "base" else decoding
            row = [cell(results, model, method, train_set, eval_metric(train_set, used, ACCURACY)) for model in models]
            if any(row):
                table.labels.append([set_title(train_set), METHOD_NAMES[method]])
                table.cells.append(row)
        table.groups += _columns_grouped(range(first, len(table.cells)), len(models))
    return table


def table_cot(results: list[TrialResult], models: list[str], methods: list[str]) -> Table:
    shown = [m for m in methods if m != "base" and any(
        cell(results, model, m, "gsm8k", eval_metric("gsm8k", "cot", ACCURACY)) for model in models)]
    table = Table(f"Table 2: GSM8K, CoT-decoding ({ACCURACY_RULE_SHORT})", ["Model", *map(method_name, shown)], [], [])
    for model in models:
        row = [cell(results, model, method, "gsm8k", eval_metric("gsm8k", "cot", ACCURACY)) for method in shown]
        if any(row):
            table.labels.append([model_name(model)])
            table.cells.append(row)
            table.groups.append([(len(table.cells) - 1, column) for column in range(len(shown))])
    return table


def pooled_sizes(results: list[TrialResult], sets: Sequence[str], decoding: str) -> str:
    """"GSM-Sym 500 + GSM-P1 500 + GSM-P2 500 problems": what Overall pools a run (a range where runs differ); the
    paper's 5,000 were drawn in other shares, so its Overall weighs the sets otherwise."""
    sizes = []
    for s in sets:
        totals = sorted({int(r.metrics[key]) for r in results if (key := eval_metric(s, decoding, TOTAL)) in r.metrics})
        if not totals:
            return ""
        sizes.append(f"{set_title(s)} {totals[0]:,}" + (f"-{totals[-1]:,}" if len(totals) > 1 else ""))
    return " + ".join(sizes) + " problems"


def table_symbolic(results: list[TrialResult], models: list[str], methods: list[str], decoding: str) -> Table:
    header = ["Training set", "Evaluation", "Method", *map(model_name, models)]
    sizes = pooled_sizes(results, SYMBOLIC_SETS, decoding)
    pooled = f"; Overall pools a run's answers of {sizes}" if sizes else ""
    table = Table(f"Table 3: GSM-Symbolic ({ACCURACY_RULE_SHORT}{pooled})", header, [], [])
    evaluations: list[tuple[str, Callable[[str, str, str], list[float]]]] = [
        (set_title(s), lambda model, method, train_set, s=s: cell(
            results, model, method, train_set, eval_metric(s, decoding, ACCURACY)))
        for s in SYMBOLIC_SETS
    ]
    evaluations.append(("Overall", lambda model, method, train_set: pooled_cell(
        results, model, method, train_set, list(SYMBOLIC_SETS), decoding)))
    for train_set in training_set_names():
        for evaluation, measure in evaluations:
            first = len(table.cells)
            for method in (m for m in methods if m != "base"):
                row = [measure(model, method, train_set) for model in models]
                if any(row):
                    table.labels.append([set_title(train_set), evaluation, method_name(method)])
                    table.cells.append(row)
            table.groups += _columns_grouped(range(first, len(table.cells)), len(models))
    return table


def table_ablations(results: list[TrialResult], models: list[str], methods: list[str], decoding: str) -> Table:
    metric = eval_metric("gsm8k", decoding, ACCURACY)
    ablated = [m for m in models if any(cell(results, m, method, "gsm8k", metric) for method in ABLATIONS)]
    columns = ablated or models
    table = Table(f"Table 4: ablations (GSM8K; {ACCURACY_RULE_SHORT})", ["Method", *map(model_name, columns)], [], [])
    for method in (m for m in methods if m == "clozemath" or m in ABLATIONS):
        row = [cell(results, model, method, "gsm8k", metric) for model in columns]
        if any(row):
            table.labels.append([METHOD_NAMES[method]])
            table.cells.append(row)
    table.groups = _columns_grouped(range(len(table.cells)), len(columns))
    return table


def paper_tables(results: list[TrialResult], decoding: str = "beam") -> list[Table]:
    models = ordered((r.model for r in results), list(MODEL_NAMES))
    methods = ordered((r.method for r in results), list(METHOD_NAMES))
    return [
        table_overall(results, models, methods, decoding),
        table_cot(results, models, methods),
        table_symbolic(results, models, methods, decoding),
        table_ablations(results, models, methods, decoding),
    ]


def _count(value: int | None) -> str:
    return "–" if value is None else f"{value:,}"


def compute_table(results: list[TrialResult]) -> str:
    """Each trained trial's optimizer steps and the tokens they trained on, beside those its budget planned
    (markdown): what a comparison of methods spent. Runs from before trained tokens were recorded show none. Then
    each trial's time (`evaluation_time_table`)."""
    trained = sorted((r for r in results if r.steps is not None), key=lambda r: (r.train_set, r.model, r.method))
    lines = ["**Compute: steps and tokens trained per trial** (real tokens, padding aside; planned: the budget's "
             "epochs over the training set, or the share of them its train.max_steps reach; runs logged before "
             "2026-12-02 planned whole epochs there)", "",
             "| Training set | Model | Method | Seed | Steps | Trained tokens | Planned tokens |",
             "| --- | --- | --- | --- | ---: | ---: | ---: |"]
    lines += [f"| {set_title(r.train_set)} | {model_name(r.model)} | {method_name(r.method)} | {r.seed} | "
              f"{r.steps:,} | {_count(r.trained_tokens)} | {_count(r.planned_tokens)} |" for r in trained]
    return "\n".join(lines) + "\n\n" + evaluation_time_table(results)


def _seconds(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f}"


def timed_trials(results: list[TrialResult]) -> list[TrialResult]:
    """The trials that ended and recorded their evaluation's seconds: those a share of time spent evaluating is of."""
    return [r for r in results if r.seconds and EVAL_SECONDS in r.metrics]


def evaluation_time_table(results: list[TrialResult]) -> str:
    """Each trial's run time, its evaluation's, and of that the start-up (until a model could decode, the first
    actor's or the training worker's: `EVAL_STARTUP_S`) and the decoding (markdown); then the grid's share of its trials' time spent evaluating and
    starting to. Runs from before the start-up was recorded show none."""
    rows = sorted(results, key=lambda r: (r.train_set, r.model, r.method, r.seed))
    lines = ["**Compute: time per trial** (seconds; evaluation: from its request to its last prediction, start-up: "
             "until a model could decode, the first actor's or the training worker's)", "",
             "| Training set | Model | Method | Seed | Run | Evaluation | Start-up | Decoding |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {set_title(r.train_set)} | {model_name(r.model)} | {method_name(r.method)} | {r.seed} | "
              f"{_seconds(r.seconds)} | {_seconds(r.metrics.get(EVAL_SECONDS))} | "
              f"{_seconds(r.metrics.get(EVAL_STARTUP_S))} | {_seconds(r.metrics.get(EVAL_DECODE_S))} |" for r in rows]
    timed = timed_trials(rows)
    if timed:
        run = sum(r.seconds or 0.0 for r in timed)
        share = sum(r.metrics[EVAL_SECONDS] for r in timed) / run
        started = [r for r in timed if EVAL_STARTUP_S in r.metrics]
        partly = "" if len(started) == len(timed) else f" ({len(started)} of {len(timed)} trials recorded it)"
        starting = sum(r.metrics[EVAL_STARTUP_S] for r in started) / run
        startup = f", {starting:.0%} starting it{partly}" if started else ""
        lines += ["", f"Evaluation: {share:.0%} of the trials' run time ({len(timed)} trials){startup}."]
    return "\n".join(lines)


def results_tables(results: list[TrialResult]) -> list[TextTable]:
    """Per training set and model: a row per method, a column per (eval set, decoding), the spread over seeds."""
    tables = []
    for (train_set, model), trials in blocks(results).items():
        columns = eval_columns(trials)
        rows = [[method_name(method, REPLICATION_NAMES),
                 *(spread(percents(measured_on(trials, method, column), column)) for column in columns)]
                for method in ordered((r.method for r in trials), REPLICATION_METHODS)]
        title = (f"Results: {model_name(model)} trained on {set_title(train_set)}, accuracy (%), mean ± std over "
                 f"seeds (n); {ACCURACY_RULE_SHORT}")
        tables.append(TextTable(title, ["Method", *map(column_name, columns)], 1, rows))
    return tables


def _mean_cell(trials: list[TrialResult], column: Column, stat: str) -> str:
    """The mean over these trials of one statistic of `column`, in percent (– where none measured it)."""
    values = [100 * r.metrics[key] for r in trials if (key := eval_metric(*column, stat)) in r.metrics]
    return "–" if not values else f"{statistics.fmean(values):.{1 if stat.endswith('share') else 2}f}"


GRADING_STATS = (ACCURACY, STRICT_ACCURACY, FLEXIBLE_ACCURACY, LENIENT_ACCURACY, FALLBACK_SHARE, CUT_SHARE,
                 UNCUT_ACCURACY)
GRADING_HEADER = ["Accuracy", "Strict", "Flexible", "Lenient", "Fallback share", "Cut share", "Accuracy uncut"]


def grading_tables(results: list[TrialResult]) -> list[TextTable]:
    """Per training set and model: how each method's answers were graded, mean over seeds, in percent: its accuracy
    (`ACCURACY_RULE_SHORT`); strict (only marked answers: after `####`, in `\\boxed{}`; the harness's strict-match for
    base), flexible (the last-number fallback too: as accuracy; the harness's flexible-extract for base: every method
    under both rules) and lenient (the last number of cut generations too: the rule before 2026-12-02; base: as
    accuracy); the share of answers the last-number fallback found; the share of generations cut at `max_new_tokens` and
    the accuracy of the others."""
    tables = []
    for (train_set, model), trials in blocks(results).items():
        rows = []
        for column in eval_columns(trials):
            for method in ordered({r.method for r in trials}, REPLICATION_METHODS):
                measured = measured_on(trials, method, column)
                if measured:
                    rows.append([column_name(column), method_name(method, REPLICATION_NAMES),
                                 *(_mean_cell(measured, column, stat) for stat in GRADING_STATS)])
        title = (f"Grading: {model_name(model)} trained on {set_title(train_set)}, mean over seeds (%); "
                 f"{ACCURACY_RULE_SHORT}; strict counts only marked answers (base: the harness's strict-match), "
                 "flexible the last number too (base: the harness's flexible-extract), lenient also the last number "
                 "of generations cut at max_new_tokens (the rule before 2026-12-02)")
        tables.append(TextTable(title, ["Evaluation", "Method", *GRADING_HEADER], 2, rows))
    return tables


def _interval(difference: Difference | None) -> str:
    return "–" if difference is None else f"[{difference.low:+.2f}, {difference.high:+.2f}]"


def _comparison_row(comparison: Comparison) -> list[str]:
    labels = [column_name(comparison.evaluation), method_name(comparison.method, REPLICATION_NAMES),
              method_name(comparison.reference, REPLICATION_NAMES)]
    seeds, problems = comparison.seeds, comparison.problems
    if problems is None:
        return [*labels, f"{comparison.gap:+.2f}", f"– ({comparison.missing}: difference of the means)", "–", "–", "–"]
    runs = f"{problems.method_runs} and {problems.reference_runs} × {problems.problems:,}"
    if seeds is None:
        return [*labels, f"{problems.points:+.2f}", f"– ({comparison.missing})", "not tested", _interval(problems), runs]
    judged = ("excludes 0" if seeds.excludes_zero else "holds 0") + provisional_label(comparison)
    paired = " (paired seeds)" if seeds.paired else ""
    return [*labels, f"{seeds.points:+.2f}", _interval(seeds) + paired, judged, _interval(problems), runs]


def comparison_tables(found: dict[Block, list[Comparison]]) -> list[TextTable]:
    """Per training set and model, a row per comparison: the difference, its interval over training seeds and test
    problems (what the verdict judges; provisional below `MIN_SEEDS` seeds of a trained method), and its interval
    over problems alone (`clozemath.intervals`)."""
    header = ["Evaluation", "Method", "vs", "Δ (pp)", "95% interval, seeds and problems", "Verdict",
              "95% interval, problems only", "Runs × problems"]
    tables = []
    for (train_set, model), rows in found.items():
        if rows:
            title = (f"Comparisons: {model_name(model)} trained on {set_title(train_set)}, method - reference in "
                     "accuracy points; the verdict judges the 95% interval over training seeds and test problems "
                     "(crossed variance components, unpaired seeds unless the grid pairs them: clozemath.intervals), "
                     f"provisional below {MIN_SEEDS} seeds; beside it the interval over problems with the trained "
                     f"models held fixed; a base model decoded only as the harness decodes it ({BASE_DECODING}) is "
                     "compared so with the others' decoding, as Tables 1 and 3 set it beside them")
            tables.append(TextTable(title, header, 3, [_comparison_row(c) for c in rows]))
    return tables


def noise_floor_tables(found: dict[Block, list[NoiseFloor]]) -> list[TextTable]:
    """Per training set and model with reruns: each method's run-to-run difference at the same config and seed."""
    header = ["Evaluation", "Method", "Reruns", "Mean |Δ| (pp)", "Max |Δ| (pp)", "Answers that differ (%)"]
    tables = []
    for (train_set, model), rows in found.items():
        title = (f"Run-to-run noise floor: {model_name(model)} trained on {set_title(train_set)}, each rerun of a seed "
                 "(same config, same seed: train.rerun) against its first run; a difference between methods below "
                 "it could be the machine's")
        tables.append(TextTable(title, header, 2, [
            [column_name(f.evaluation), method_name(f.method, REPLICATION_NAMES), str(f.pairs), f"{f.mean_gap:.2f}",
             f"{f.max_gap:.2f}", "–" if f.differing is None else f"{f.differing:.1f}"] for f in rows]))
    return tables
