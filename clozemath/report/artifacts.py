"""The trials' per-problem predictions: read from their MLflow artifacts or from an export, and exported."""

from __future__ import annotations

import gzip
import io
import json
import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from tempfile import TemporaryDirectory

from clozemath import tracking
from clozemath.data.sources import read_jsonl
from clozemath.errors import ClozeMathError
from clozemath.eval.predictions import Prediction, metrics, prediction_from_row
from clozemath.files import atomic_path
from clozemath.records import PREDICTIONS_ARTIFACTS
from clozemath.report.names import Column
from clozemath.report.runs import TrialResult

EXPORT_FILE = "predictions.jsonl.gz"
EXPORTS = ("full", "compact")
"""What `export_predictions` keeps of a prediction: everything but the prompt (`full`), or also not the generation
(`compact`: the answer, its rule and verdicts, how the generation ended)."""


class PredictionArtifacts:
    """Each run's predictions from its `eval/predictions/<set>.jsonl` artifacts, downloaded once; or all runs' from
    files `export_predictions` wrote (`exported`), which need no artifact store."""

    def __init__(self, tracking_uri: str, exported: Sequence[str | Path] = ()) -> None:
        self._tracking_uri = tracking_uri
        self._runs: dict[str, list[Prediction]] = {}
        self._exported = bool(exported)
        self._exported_runs: dict[str, tuple[str, str, str, str, str, str]] = {}
        """Run id -> (model, method, training set, seed, run name, rerun), as the exports name the run."""
        for path in exported:
            runs, named = read_export(Path(path))
            self._runs |= runs
            self._exported_runs |= named

    @classmethod
    def held(cls, runs: dict[str, list[Prediction]]) -> PredictionArtifacts:
        """The predictions of these runs, read already (from reports' folders: `clozemath.report.folders`); any other
        run has none. No store is opened."""
        artifacts = cls("")
        artifacts._runs, artifacts._exported = dict(runs), True
        return artifacts

    def predictions(self, run_id: str) -> list[Prediction]:
        """The run's predictions, every set and decoding (none if it logged none)."""
        if run_id not in self._runs:
            self._runs[run_id] = [] if self._exported else self._download(run_id)
        return self._runs[run_id]

    def rejudged(self, results: list[TrialResult]) -> list[TrialResult]:
        """The trials with their evaluation metrics recomputed from their predictions, where they logged them: the
        grading rules of this version judge every run, whatever version evaluated it (a run from before the cut rule
        is re-judged by it: `clozemath.eval.predictions`)."""
        return [replace(r, metrics={**r.metrics, **metrics(found)}) if (found := self.predictions(r.run_id)) else r
                for r in results]

    def exported_trials(self) -> list[TrialResult]:
        """The trials of the exports read (`exported`), named as the export names them, their evaluation metrics
        computed from their predictions: a report from the files alone, with no tracking store (no compute, curves
        or params: the export holds none)."""
        trials = []
        for run_id in sorted(self._exported_runs):
            model, method, train_set, seed, run_name, rerun = self._exported_runs[run_id]
            trials.append(TrialResult(run_id, model, method, train_set, seed, metrics(self._runs[run_id]),
                                      run_name=run_name, rerun=int(rerun)))
        return trials

    def correctness(self, run_id: str, column: Column) -> dict[str, bool] | None:
        """None when the run logged no predictions of this set and decoding."""
        found = {p.id: p.correct for p in self.predictions(run_id) if (p.dataset, p.decoding) == column}
        return found or None

    def _download(self, run_id: str) -> list[Prediction]:
        client = tracking.client(self._tracking_uri)
        files = [artifact.path for artifact in client.list_artifacts(run_id, PREDICTIONS_ARTIFACTS)
                 if artifact.path.endswith(".jsonl") and not artifact.path.endswith(".partial.jsonl")]
        os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"  # a bar per file would bury the tables
        found = []
        with TemporaryDirectory() as folder:
            for path in files:
                local = Path(client.download_artifacts(run_id, path, folder))
                # lines end at "\n" only: a generation may hold U+2028
                found += [prediction_from_row(row, where) for where, row in read_jsonl(local)]
        return found


def read_export(path: Path) -> tuple[dict[str, list[Prediction]], dict[str, tuple[str, str, str, str, str, str]]]:
    """Each run's predictions in an `export_predictions` file, and the run as the file names it (model, method,
    training set, seed, run name, rerun)."""
    if not path.is_file():
        raise ClozeMathError(f"{path}: no such predictions export (`clozemath report --export-predictions`)")
    runs: dict[str, list[Prediction]] = defaultdict(list)
    named: dict[str, tuple[str, str, str, str, str, str]] = {}
    for where, row in read_jsonl(path):
        if not isinstance(row.get("run_id"), str):
            raise ClozeMathError(f"{where}: no 'run_id' (not a file `clozemath report --export-predictions` wrote)")
        runs[row["run_id"]].append(prediction_from_row({"generation": "", **row}, where))  # compact: none
        fields = ("model", "method", "train_set", "seed", "run_name")
        named[row["run_id"]] = (*(str(row.get(key, "")) for key in fields), str(row.get("rerun", 0)))
    return dict(runs), named


def artifact_folder(tracking_uri: str, run_id: str) -> str:
    """Where the run's artifacts are (a local folder as its path)."""
    uri = tracking.client(tracking_uri).get_run(run_id).info.artifact_uri
    return uri.removeprefix("file://")


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
                       "seed": r.seed, "rerun": r.rerun, "train_set": r.train_set}
                for prediction in artifacts.predictions(r.run_id):
                    row = {key: value for key, value in asdict(prediction).items() if key not in dropped}
                    handle.write(json.dumps({**run, **row}, ensure_ascii=False) + "\n")
    return path
