"""`clozemath report`: the runs of one or more grids, their tables, summary, trials and figure, printed and
written."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from clozemath.errors import ClozeMathError
from clozemath.files import write_text_atomic
from clozemath.report.artifacts import EXPORT_FILE, PredictionArtifacts, export_predictions
from clozemath.report.compare import comparisons, noise_floors, orderings
from clozemath.report.figure import FIGURE_FILE, accuracy_curves, plot_accuracy_vs_steps
from clozemath.report.history import STEPS_FILE, export_steps
from clozemath.report.render import Table, TextTable, to_latex, to_markdown
from clozemath.report.runs import experiments_runs, trials_json
from clozemath.report.tables import (
    comparison_tables,
    compute_table,
    grading_tables,
    noise_floor_tables,
    paper_tables,
    results_tables,
)

TRIALS_FILE = "trials.json"
SUMMARY_FILE = "summary.md"


def report_folder(experiment: str | Sequence[str], out: str | Path | None) -> Path:
    """Where the report is written: `out`, by default `reports/<experiment>[+<experiment>...]`."""
    names = [experiment] if isinstance(experiment, str) else list(experiment)
    return Path(out) if out is not None else Path("reports") / "+".join(names)


def report(
    experiment: str | Sequence[str],
    tracking_uri: str = "sqlite:///mlruns.db",
    out: str | Path | None = None,
    latex: bool = False,
    parent_run_ids: Sequence[str] = (),
    decoding: str = "beam",
    export: str | None = None,
    exported: Sequence[str | Path] = (),
) -> str:
    """Print the results, grading and comparisons tables and the paper's tables that have runs (markdown, or LaTeX)
    of one experiment's grid, or of several reported as one (Table 4's ablations beside the main grid's runs); write
    them, the paper's orderings against this replication (`summary.md`, markdown for the README), the trials' metrics
    (JSON), every step of their training (`steps.json.gz`) and Figure 3 under `out` (default
    `reports/<experiment>[+<experiment>...]`); returns the printed text. Every trial's evaluation metrics are
    recomputed from its predictions where it has them, so today's grading rules judge every run. `export`: also
    write every trial's predictions (`export_predictions`, full or compact) there. `exported`: read the predictions
    from such files instead of the runs' artifacts; with no `experiment`, the trials too (no tracking store: no
    compute table, curves, steps or params). `parent_run_ids`: the experiment's grid runs to report as one (default:
    its latest)."""
    names = [experiment] if isinstance(experiment, str) else list(experiment)
    artifacts = PredictionArtifacts(tracking_uri, exported)
    if names:
        grids = experiments_runs(tracking_uri, names, parent_run_ids)
        results = artifacts.rejudged([r for _, runs in grids for r in runs])
    elif exported:
        grids, results = [], artifacts.exported_trials()
    else:
        raise ClozeMathError("report: name an --experiment, or --predictions files to report from alone")
    folder = report_folder(names or ["predictions"], out)
    folder.mkdir(parents=True, exist_ok=True)
    every = results
    floors = noise_floor_tables(noise_floors(every, artifacts))
    results = [r for r in every if r.rerun == 0]  # every table but the noise floor's: a seed's first run
    found = comparisons(results, artifacts)
    render: Callable[[Table | TextTable], str] = to_latex if latex else to_markdown
    tables: list[Table | TextTable] = [
        *results_tables(results), *comparison_tables(found), *floors, *grading_tables(results),
        *(table for table in paper_tables(results, decoding) if table.values),
    ]
    text = "\n\n".join([*map(render, tables), compute_table(results)])
    tables_file = folder / ("tables.tex" if latex else "tables.md")
    write_text_atomic(tables_file, text + "\n")
    summary = orderings(found, decoding)
    write_text_atomic(folder / SUMMARY_FILE, summary + "\n")
    write_text_atomic(folder / TRIALS_FILE, trials_json(every))
    figure = plot_accuracy_vs_steps(accuracy_curves(tracking_uri, results, decoding), folder / FIGURE_FILE)
    steps = export_steps(every, tracking_uri, folder / STEPS_FILE)
    written = [tables_file, folder / SUMMARY_FILE, folder / TRIALS_FILE, steps, figure]
    if export is not None:
        written.append(export_predictions(every, artifacts, folder / EXPORT_FILE, export))
    for parent, runs in grids:
        print(f"grid run {parent.info.run_id} ({parent.info.run_name}): {len(runs)} trials")
    print()
    print("\n\n".join(filter(None, [summary, text])))
    sizes = ", ".join(f"{path} ({path.stat().st_size / 2**20:.1f} MiB)" if path.suffix == ".gz" else str(path)
                      for path in written)
    print(f"\nwritten: {sizes}")
    return text
