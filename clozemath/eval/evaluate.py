"""Predictions files (JSONL, one `Prediction` a line): read, write, regrade, score."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from clozemath.data.sources import read_jsonl
from clozemath.errors import ClozeMathError
from clozemath.eval.answers import DATASETS, grade


@dataclass(frozen=True)
class Prediction:
    id: str
    dataset: str
    decoding: str
    prompt: str
    generation: str
    extracted: str | None
    gold: str
    correct: bool
    confidence: float | None


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "id": (str,), "dataset": (str,), "decoding": (str,), "prompt": (str,), "generation": (str,),
    "extracted": (str, type(None)), "gold": (str,), "correct": (bool,), "confidence": (int, float, type(None)),
}
_REQUIRED = ("id", "dataset", "generation", "gold")  # the rest default: `score` regrades from these
_DEFAULTS: dict[str, Any] = {"decoding": "", "prompt": "", "extracted": None, "correct": False, "confidence": None}


def _has_type(value: Any, allowed: tuple[type, ...]) -> bool:
    return bool in allowed if isinstance(value, bool) else isinstance(value, allowed)  # JSON true is no number


def _prediction(row: dict[str, Any], where: str) -> Prediction:
    values = {}
    for field in fields(Prediction):
        if field.name not in row:
            if field.name in _REQUIRED:
                raise ClozeMathError(f"{where}: missing field '{field.name}'")
            values[field.name] = _DEFAULTS[field.name]
            continue
        value = row[field.name]
        if not _has_type(value, _FIELD_TYPES[field.name]):
            raise ClozeMathError(f"{where}: field '{field.name}' has the wrong type ({type(value).__name__})")
        values[field.name] = value
    if values["dataset"] not in DATASETS:
        raise ClozeMathError(f"{where}: unknown dataset '{values['dataset']}' (known: {', '.join(DATASETS)})")
    return Prediction(**values)


def read_predictions(path: str | Path) -> list[Prediction]:
    file = Path(path)
    if not file.is_file():
        raise ClozeMathError(f"{file}: no such predictions file")
    return [_prediction(row, where) for where, row in read_jsonl(file)]


def write_predictions(path: str | Path, predictions: list[Prediction]) -> None:
    file = Path(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    with file.open("w", encoding="utf-8") as handle:
        for prediction in predictions:
            handle.write(json.dumps(asdict(prediction), ensure_ascii=False) + "\n")


def regrade(predictions: list[Prediction]) -> list[Prediction]:
    """The predictions with `extracted` and `correct` recomputed from `generation` and `gold`."""
    regraded = []
    for prediction in predictions:
        try:
            graded = grade(prediction.dataset, prediction.generation, prediction.gold)
        except ClozeMathError as exc:
            raise ClozeMathError(f"prediction '{prediction.id}': {exc}") from None
        regraded.append(replace(prediction, extracted=graded.extracted, correct=graded.correct))
    return regraded


def _tally(correct: int, total: int) -> dict[str, float | int]:
    return {"accuracy": correct / total if total else 0.0, "correct": correct, "total": total}


def score_predictions(predictions: list[Prediction]) -> dict[str, Any]:
    """`{"overall": tally, "groups": {"<dataset>/<decoding>": tally}}`, a tally being accuracy, correct, total;
    a group without a decoding is named by its dataset alone."""
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for prediction in predictions:
        key = f"{prediction.dataset}/{prediction.decoding}" if prediction.decoding else prediction.dataset
        counts[key][0] += prediction.correct
        counts[key][1] += 1
    correct = sum(c for c, _ in counts.values())
    return {
        "overall": _tally(correct, len(predictions)),
        "groups": {key: _tally(c, n) for key, (c, n) in sorted(counts.items())},
    }


def print_score(path: str | Path, as_json: bool = False) -> None:
    """Regrade a predictions file and print its accuracy (the `clozemath score` command)."""
    predictions = read_predictions(path)
    regraded = regrade(predictions)
    scores = score_predictions(regraded)
    scores["changed"] = sum(old.correct != new.correct for old, new in zip(predictions, regraded))
    if as_json:
        print(json.dumps(scores, indent=2))
        return
    width = max([len("overall"), *map(len, scores["groups"])])
    print(f"{'set':<{width}}  {'correct':>7}  {'total':>6}  accuracy")
    for key, tally in [*scores["groups"].items(), ("overall", scores["overall"])]:
        print(f"{key:<{width}}  {tally['correct']:>7}  {tally['total']:>6}  {100 * tally['accuracy']:7.2f}%")
    print(f"regraded {len(predictions)} predictions: {scores['changed']} verdicts changed")
