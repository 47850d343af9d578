"""`clozemath report`: the runs of one or more grids, their tables, summary, trials and figure, printed and
written."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from clozemath.errors import ClozeMathError
from clozemath.files import write_text_atomic
from clozemath.records import is_eval_metric
from clozemath.report.artifacts import EXPORT_FILE, PredictionArtifacts, artifact_folder, export_predictions
from clozemath.report.compare import comparisons, noise_floors, orderings, paper_claims
from clozemath.report.figure import FIGURE_FILE, accuracy_curves, no_curve_reason, plot_accuracy_vs_steps
from clozemath.report.folders import read_folders
from clozemath.report.history import STEPS_FILE, ExportedHistories, Histories, StoreHistories, export_steps
from clozemath.report.render import Table, TextTable, to_latex, to_markdown
from clozemath.report.runs import (
    TRIALS_FILE,
    TrialResult,
    check_one_problem_set_per_name,
    experiments_runs,
    trials_json,
)
from clozemath.report.names import method_name, set_title
from clozemath.report.seeds import divergence_factor, run_divergence, seed_tables
from clozemath.report.tables import (
    comparison_tables,
    compute_table,
    grading_tables,
    noise_floor_tables,
    paper_tables,
    results_tables,
)

if TYPE_CHECKING:
    from mlflow.entities import Run

    from clozemath.train.divergence import Divergence

SUMMARY_FILE = "summary.md"
FOLDERS_REPORT = "folders"
"""The default report folder's name for a report of report folders (`reports/folders`)."""


def report_folder(experiment: str | Sequence[str], out: str | Path | None, folders: Sequence[str | Path] = ()
                  ) -> Path:
    """Where the report is written: `out`, by default `reports/<experiment>[+<experiment>...]` (of predictions
    exports alone: `reports/predictions`; of report folders: `reports/folders`)."""
    names = [experiment] if isinstance(experiment, str) else list(experiment)
    names = names or [FOLDERS_REPORT if folders else "predictions"]
    return Path(out) if out is not None else Path("reports") / "+".join(names)


@dataclass(frozen=True)
class WrittenReport:
    """What `write_report` made."""

    folder: Path
    summary: str
    """The paper's orderings and each of its claims against the runs (`summary.md`)."""
    tables: str
    """Every table, rendered (`tables.md` or `tables.tex`)."""
    grids: list[tuple[Run, list[TrialResult]]]
    """Each grid run reported, with its trials."""
    files: list[Path]
    unpredicted: list[TrialResult]
    """The trials that measured an accuracy but have no per-problem predictions to read (their differences get no
    interval)."""
    trials: list[TrialResult]
    """Every trial reported."""
    notes: list[str]
    """Of report folders read (`folders`): each trial two of them held, and which one was reported."""


def write_report(
    experiment: str | Sequence[str],
    tracking_uri: str = "sqlite:///mlruns.db",
    out: str | Path | None = None,
    latex: bool = False,
    parent_run_ids: Sequence[str] = (),
    decoding: str = "beam",
    export: str | None = None,
    exported: Sequence[str | Path] = (),
    folders: Sequence[str | Path] = (),
    exclude_diverged: bool = False,
) -> WrittenReport:
    """Write the results, grading and comparisons tables and the paper's tables that have runs (markdown, or LaTeX)
    of one experiment's grid, or of several reported as one (Table 4's ablations beside the main grid's runs), the
    paper's orderings against this replication (`summary.md`, markdown for the README), the trials' metrics (JSON),
    every step of their training (`steps.json.gz`) and Figure 3 under `out` (default
    `reports/<experiment>[+<experiment>...]`). Every trial's evaluation metrics are recomputed from its predictions
    where it has them, so today's grading rules judge every run. `export`: also write every trial's predictions
    (`export_predictions`, full or compact) there. `exported`: read the predictions from such files instead of the
    runs' artifacts; with no `experiment`, the trials too (no tracking store: no compute table, curves, steps or
    params). `folders`: instead of a store, the folders of reports written with their predictions exported
    (`clozemath.report.folders`: a study's slices), reported as one, everything included.
    `parent_run_ids`: the experiment's grid runs to report as one (default: its latest). `exclude_diverged`: leave
    out the runs whose training loss diverged and did not come back (`clozemath.train.divergence`), named in the
    summary: the verdicts without them, beside the report of every run."""
    names = [experiment] if isinstance(experiment, str) else list(experiment)
    histories: Histories = StoreHistories(tracking_uri)
    notes: list[str] = []
    folder = report_folder(names, out, folders)
    if folders:
        if names or exported or parent_run_ids:
            raise ClozeMathError("report: --from reads whole report folders, their trials and predictions: give it "
                                 "without --experiment, --parent or --predictions")
        # a folder reported again into itself holds what it held (`bench/slices.py unpack` exports its predictions
        # so); beside other folders, or without its diverged runs, it would lose its own runs or predictions
        if any(Path(read).resolve() == folder.resolve() for read in folders) and (len(folders) > 1 or exclude_diverged):
            raise ClozeMathError(f"report: --out {out} is one of the --from folders: the report would overwrite what "
                                 "it reads with other runs; give it another folder")
        merged = read_folders(folders)
        artifacts, histories, notes = merged.artifacts, merged.histories, merged.notes
        grids, results = [], artifacts.rejudged(merged.trials)
    elif names:
        artifacts = PredictionArtifacts(tracking_uri, exported)
        grids = experiments_runs(tracking_uri, names, parent_run_ids)
        results = artifacts.rejudged([r for _, runs in grids for r in runs])
    elif exported:
        artifacts = PredictionArtifacts(tracking_uri, exported)
        grids, results = [], artifacts.exported_trials()
    else:
        raise ClozeMathError("report: name an --experiment, --predictions files or --from report folders")
    check_one_problem_set_per_name(results)
    folder.mkdir(parents=True, exist_ok=True)
    # one order whatever the source: a store lists its runs newest first, a report's files sorted
    every = sorted(results, key=lambda r: (r.train_set, r.model, r.method, r.seed, r.rerun, r.run_id))
    # each trained trial's steps read once (a store: a query a metric): the seeds table, Figure 3 and the export
    histories = ExportedHistories({r.run_id: histories.steps(r) for r in every if r.steps is not None})
    left_out = diverged_runs(every, histories) if exclude_diverged else []
    every = [r for r in every if r.run_id not in {run.run_id for run, _ in left_out}]
    floors = noise_floor_tables(noise_floors(every, artifacts))
    results = [r for r in every if r.rerun == 0]  # every table but the noise floor's: a seed's first run
    found = comparisons(results, artifacts, decoding)
    render: Callable[[Table | TextTable], str] = to_latex if latex else to_markdown
    tables: list[Table | TextTable] = [
        *results_tables(results), *comparison_tables(found), *floors, *grading_tables(results),
        *seed_tables(results, histories),
        *(table for table in paper_tables(results, decoding) if table.cells),
    ]
    text = "\n\n".join([*map(render, tables), compute_table(results)])
    tables_file = folder / ("tables.tex" if latex else "tables.md")
    write_text_atomic(tables_file, text + "\n")
    curves = accuracy_curves(histories, results, decoding)
    summary = "\n\n".join(text for text in (left_out_line(left_out) if exclude_diverged else "",
                                            orderings(found, decoding, results), paper_claims(found, curves, decoding))
                           if text)
    write_text_atomic(folder / SUMMARY_FILE, summary + "\n")
    write_text_atomic(folder / TRIALS_FILE, trials_json(every))
    figure = plot_accuracy_vs_steps(curves, folder / FIGURE_FILE, no_curve_reason(results))
    steps = export_steps(every, histories, folder / STEPS_FILE)
    written = [tables_file, folder / SUMMARY_FILE, folder / TRIALS_FILE, steps, figure]
    if export is not None:
        written.append(export_predictions(every, artifacts, folder / EXPORT_FILE, export))
    unpredicted = [r for r in every if any(map(is_eval_metric, r.metrics)) and not artifacts.predictions(r.run_id)]
    return WrittenReport(folder, summary, text, grids, written, unpredicted, every, notes)


def diverged_runs(trials: list[TrialResult], histories: Histories) -> list[tuple[TrialResult, Divergence]]:
    """The trained trials whose logged losses diverged and did not come back, with where (a run that came back had a
    surge, and scores with its method: `clozemath.train.divergence`)."""
    found = [(r, run_divergence(histories.steps(r), divergence_factor(r))) for r in trials if r.steps is not None]
    return [(r, divergence) for r, divergence in found if divergence is not None and divergence.ended_diverged]


def left_out_line(left_out: list[tuple[TrialResult, Divergence]]) -> str:
    """The summary's first line in a report without the diverged runs (`exclude_diverged`)."""
    named = "; ".join(f"{method_name(r.method)} seed {r.seed} trained on {set_title(r.train_set)} "
                      f"({divergence.describe()})" for r, divergence in left_out)
    return (f"**Left out: the runs whose training diverged** (the smoothed loss at train.divergence_factor times its "
            f"lowest to the run's end, `clozemath.train.divergence`): {named or 'none'}.")


def report(
    experiment: str | Sequence[str],
    tracking_uri: str = "sqlite:///mlruns.db",
    out: str | Path | None = None,
    latex: bool = False,
    parent_run_ids: Sequence[str] = (),
    decoding: str = "beam",
    export: str | None = None,
    exported: Sequence[str | Path] = (),
    folders: Sequence[str | Path] = (),
    exclude_diverged: bool = False,
) -> str:
    """`write_report`, and print what it wrote: the grid runs (or the report folders read and the trials two of them
    held), a note on trials without predictions, the summary and the tables, the files; returns the tables' text."""
    made = write_report(experiment, tracking_uri, out, latex, parent_run_ids, decoding, export, exported, folders,
                        exclude_diverged)
    for parent, runs in made.grids:
        print(f"grid run {parent.info.run_id} ({parent.info.run_name}): {len(runs)} trials")
    if folders:
        print(f"{len(folders)} report folders: {len(made.trials)} trials")
    print()
    print(*made.notes, sep="\n", end="\n\n" if made.notes else "")
    if made.unpredicted:
        print(missing_predictions_note(made.unpredicted, tracking_uri, bool(exported or folders)) + "\n")
    print("\n\n".join(filter(None, [made.summary, made.tables])))
    sizes = ", ".join(f"{path} ({path.stat().st_size / 2**20:.1f} MiB)" if path.suffix == ".gz" else str(path)
                      for path in made.files)
    print(f"\nwritten: {sizes}")
    return made.tables


def missing_predictions_note(trials: list[TrialResult], tracking_uri: str, exported: bool) -> str:
    """Why some differences have no interval, and what to give: the export of the predictions (`--predictions`),
    where the runs' artifacts are not (a store copied without its artifact folder, as the committed ones are)."""
    count = f"{len(trials)} trial{'s' if len(trials) > 1 else ''}"
    if exported:
        return (f"note: {count} ({trials[0].run_name or trials[0].run_id}, ...) are in none of the predictions exports "
                "read: their differences have no interval (give the export that holds them)")
    where = artifact_folder(tracking_uri, trials[0].run_id)
    return (f"note: {count} have no per-problem predictions among their MLflow artifacts ({where}): their "
            "differences have no interval. If the predictions were exported (`clozemath report --export-predictions`, "
            "e.g. the predictions*.jsonl.gz beside a committed store), give them: --predictions FILE")
