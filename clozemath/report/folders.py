"""Reports read back from their folders (`clozemath report --from DIR ...`): a report's `trials.json` (every trial's
tags, params and metrics), `steps.json.gz` (its steps and its accuracy during training) and `predictions.jsonl.gz`
(its answers) are enough to report it again, alone or with others, with no tracking store: the slices of a study run
one grid run each on machines whose stores are gone, and their committed report folders make the study's report.

A trial held by two folders (the same run reported twice, or a trial run again in a later part of a slice) is
reported once: the one that finished more evaluations, else the one of the folder given first, and a note says
which. Two runs of the same cell (model, method, training set, seed, rerun) trained with other settings (a rate
chosen since) are refused: pooled, they would pass for one trial."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from clozemath.errors import ClozeMathError
from clozemath.eval.predictions import Prediction
from clozemath.records import (
    ACCURACY,
    EVAL_PREFIX,
    REPORT_DIR,
    TRAINED_STEPS,
    TRAINED_TOKENS,
    TRIAL_TAG,
    parse_eval_metric,
)
from clozemath.report.artifacts import EXPORT_FILE, PredictionArtifacts, read_export
from clozemath.report.history import STEPS_FILE, ExportedHistories, Steps, read_steps
from clozemath.report.runs import TRIALS_FILE, TrialResult, read_trials_json

FOLDER_FILES = (TRIALS_FILE, STEPS_FILE, EXPORT_FILE)
"""What a report folder must hold to be reported again (`clozemath report --export-predictions` writes them all)."""
OUTCOMES = (TRAINED_STEPS, TRAINED_TOKENS)
"""Params a run logs of what it did, not of what it was set to do."""


@dataclass(frozen=True)
class ReportFolder:
    """One report's files, read."""

    folder: Path
    trials: list[TrialResult]
    predictions: dict[str, list[Prediction]]
    steps: dict[str, Steps]


@dataclass(frozen=True)
class Merged:
    """The trials of several report folders, each once, with what the report reads of them."""

    trials: list[TrialResult]
    artifacts: PredictionArtifacts
    histories: ExportedHistories
    notes: list[str]
    """A line for each trial found in two folders: which one was kept."""


def report_files(folder: Path) -> Path:
    """The folder holding the report's files: `folder`, or its `report/` (a slice's folder as it comes back)."""
    if not folder.is_dir():
        raise ClozeMathError(f"--from {folder}: no such folder")
    nested = folder / REPORT_DIR
    return nested if not (folder / TRIALS_FILE).exists() and (nested / TRIALS_FILE).exists() else folder


def read_folder(path: Path) -> ReportFolder:
    """A report folder's trials, predictions and steps; a missing or damaged file, or files that do not belong
    together, is a one-line error naming the file."""
    folder = report_files(path)
    for name in FOLDER_FILES:
        if not (folder / name).is_file():
            raise ClozeMathError(f"{folder / name}: missing (a report folder holds {', '.join(FOLDER_FILES)}: "
                                 "`clozemath report --export-predictions` writes them)")
    trials = read_trials_json(folder / TRIALS_FILE)
    try:
        predictions, _ = read_export(folder / EXPORT_FILE)
    except OSError as exc:
        raise ClozeMathError(f"{folder / EXPORT_FILE}: cannot be read ({exc.strerror or exc})") from None
    steps = read_steps(folder / STEPS_FILE)
    held = {r.run_id for r in trials}
    for name, runs in ((EXPORT_FILE, predictions), (STEPS_FILE, steps)):
        strangers = sorted(set(runs) - held)
        if strangers:
            raise ClozeMathError(f"{folder / name}: run {strangers[0]} is not in {folder / TRIALS_FILE} (files of "
                                 "different reports?)")
    untracked = [r for r in trials if r.steps is not None and r.run_id not in steps]
    if untracked:
        raise ClozeMathError(f"{folder / STEPS_FILE}: no steps of run {untracked[0].run_id} ({untracked[0].run_name}), "
                             f"which {folder / TRIALS_FILE} says trained")
    return ReportFolder(folder, trials, predictions, steps)


def _cell(r: TrialResult) -> tuple[str, str, str, str, int]:
    """What a trial is in the tables: trials of one cell are pooled as seeds."""
    return r.model, r.method, r.train_set, r.seed, r.rerun


def _place(value: str) -> bool:
    """A setting naming where a run ran (an absolute path, a local store): it differs between machines."""
    return value.startswith(("/", "sqlite:///", "file://"))


def _other_settings(kept: TrialResult, other: TrialResult) -> list[str]:
    """The settings two runs of one cell differ in (`key: a -> b`), where they ran and what they did aside."""
    keys = sorted((kept.params.keys() | other.params.keys()) - set(OUTCOMES))
    found = []
    for key in keys:
        a, b = kept.params.get(key, "None"), other.params.get(key, "None")
        if a != b and not (_place(a) and _place(b)):
            found.append(f"{key}: {a} -> {b}")
    return found


def _evaluated(r: TrialResult) -> int:
    """How many (set, decoding) accuracies the trial holds after training."""
    return sum(1 for key in r.metrics if (parsed := parse_eval_metric(key)) is not None
               and (parsed.prefix, parsed.stat) == (EVAL_PREFIX, ACCURACY))


def merge(folders: Sequence[ReportFolder]) -> Merged:
    """Every folder's trials, each cell once (see the module): the predictions and steps of the one kept."""
    kept: dict[tuple[str, str, str, str, int], tuple[TrialResult, ReportFolder]] = {}
    notes = []
    for folder in folders:
        for trial in folder.trials:
            cell = _cell(trial)
            if cell not in kept:
                kept[cell] = trial, folder
                continue
            first, where = kept[cell]
            label = trial.tags.get(TRIAL_TAG) or f"{trial.method} seed {trial.seed}"
            changed = _other_settings(first, trial)
            if changed:
                raise ClozeMathError(
                    f"{where.folder} (run {first.run_id}) and {folder.folder} (run {trial.run_id}) both hold {label} "
                    f"of {trial.model} on {trial.train_set}, with other settings ({'; '.join(changed[:2])}): give "
                    "only the folder of the runs to report")
            later = _evaluated(trial) > _evaluated(first)
            if later:
                kept[cell] = trial, folder
            why = ("the same run" if trial.run_id == first.run_id else
                   "it finished more evaluations" if later or _evaluated(first) > _evaluated(trial) else
                   "given first")
            chosen = folder if later else where
            notes.append(f"note: {label} is in {where.folder} (run {first.run_id}) and {folder.folder} (run "
                         f"{trial.run_id}): reported once, {chosen.folder}'s ({why})")
    chosen = list(kept.values())
    return Merged([trial for trial, _ in chosen],
                  PredictionArtifacts.held({t.run_id: f.predictions[t.run_id] for t, f in chosen
                                            if t.run_id in f.predictions}),
                  ExportedHistories({t.run_id: f.steps[t.run_id] for t, f in chosen if t.run_id in f.steps}),
                  notes)


def read_folders(paths: Sequence[str | Path]) -> Merged:
    """The trials of these report folders, merged (`merge`)."""
    return merge([read_folder(Path(path)) for path in paths])
