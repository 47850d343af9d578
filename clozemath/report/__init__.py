"""The paper's tables and Figure 3 from the tracked runs of a grid (`clozemath report`).

The child runs of a grid's MLflow run carry the tags `model`, `method`, `train_set` and `seed` and the metrics
`eval/<set>/<decoding>/{accuracy,correct,total}`; a cell is one accuracy in percent over seeds, "mean ± std (n)".

- Table 1 (overall): training set x {Base, MFT, ClozeMath} rows, a column per model; each model evaluated on the set
  it was trained on, with `decoding` (beam search); base models few-shot, greedy, as lm-evaluation-harness runs them.
- Table 2 (CoT-decoding): a row per model, a column per method; GSM8K-trained, GSM8K test, CoT-decoding.
- Table 3 (GSM-Symbolic): training set x {GSM-Sym, GSM-P1, GSM-P2, Overall} x method rows, a column per model;
  Overall is the pooled accuracy of the three sets (their correct answers over their problems).
- Table 4 (ablations): ClozeMath and its ablations on GSM8K, a column per model that has ablations.
- Figure 3: GSM8K accuracy against training steps (`eval.every_steps`, every point on the same subset of GSM8K test),
  a panel per model, a line per method.

The best mean of each comparison is bold: per column within a block (Tables 1, 3, 4), per model (Table 2's rows).

Printed first, per model and training set, so that a replication shows which differences are more than noise:
- Results: a row per method, a column per (eval set, decoding) its runs have, each cell "mean ± std (n)" over seeds.
- Comparisons: each trained method against IT and against base on every (eval set, decoding) both have: the
  difference in points with a 95% paired bootstrap interval over problems pooled over seeds (`clozemath.intervals`),
  from the per-problem predictions the trials logged as artifacts.
- Seeds: each method's seeds side by side on the training set's own test, those far below the others flagged, with
  what each run's training did (its final loss, gradient-norm peak and spikes, where its loss diverged: `seeds`).
Every trial's tags, params (among them the steps and tokens it trained, and a matched budget as configured) and
latest metrics are also written as JSON (`trials.json`), and every step of its training (loss, gradient norm,
learning rate, tokens) as gzipped JSON (`steps.json.gz`, `history`); the compute table gives each trial's trained
tokens beside those its budget planned.

A report's folder holds what it takes to report it again without the store (`--from`: trials.json, steps.json.gz,
predictions.jsonl.gz); several such folders (a study's slices) are reported as one (`folders`).

Its parts: `runs` (the trials read back), `names` (how things are named and ordered), `tables` and `render` (the
tables, as markdown or LaTeX), `artifacts` and `compare` (per-problem predictions and the bootstrap comparisons),
`figure` (Figure 3), `seeds` (the seeds table), `history` (the steps' export, and the histories read back from a
store or from it), `folders` (report folders read back and merged), `command` (`report`, which composes them).
"""

from __future__ import annotations

from clozemath.report.command import report, report_folder
from clozemath.report.figure import accuracy_curves
from clozemath.report.names import REPLICATION_METHODS, set_title
from clozemath.report.render import to_latex, to_markdown
from clozemath.report.runs import TrialResult, grid_runs
from clozemath.report.tables import grading_tables, paper_tables

__all__ = [
    "REPLICATION_METHODS", "TrialResult", "accuracy_curves", "grading_tables", "grid_runs", "paper_tables", "report",
    "report_folder", "set_title", "to_latex", "to_markdown",
]
