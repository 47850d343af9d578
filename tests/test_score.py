"""Predictions files and `clozemath score`: regrading, accuracy per dataset and decoding, malformed lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clozemath_cli import main
from clozemath.errors import ClozeMathError
from clozemath.eval.predictions import Prediction, read_predictions, score_predictions, write_predictions


def _prediction(id: str, dataset: str, decoding: str, generation: str, gold: str, correct: bool) -> Prediction:
    return Prediction(id, dataset, decoding, f"Q{id} <SEP>", generation, None, gold, correct, 0.5)


# `correct` as saved; two verdicts are stale and the regrade flips them.
PREDICTIONS = [
    _prediction("g1", "gsm8k", "greedy", "3 + 4 = 7\n#### 7", "7", True),
    _prediction("g2", "gsm8k", "greedy", "So it is 12.", "13", True),  # stale: wrong
    _prediction("g3", "gsm8k", "beam5", "#### 1,000", "1000", True),
    _prediction("g4", "gsm8k", "beam5", "no answer", "5", False),
    _prediction("m1", "math", "greedy", "so $\\boxed{\\dfrac{1}{2}}$", "0.5", False),  # stale: right
    _prediction("m2", "math", "greedy", "so $\\boxed{3}$", "4", False),
]


@pytest.fixture
def predictions_file(tmp_path: Path) -> Path:
    path = tmp_path / "run" / "predictions.jsonl"
    write_predictions(path, PREDICTIONS)
    return path


def test_write_then_read_round_trips(predictions_file: Path) -> None:
    assert read_predictions(predictions_file) == PREDICTIONS


def test_score_predictions_counts_saved_verdicts() -> None:
    scores = score_predictions(PREDICTIONS)
    assert scores["overall"] == {"accuracy": 3 / 6, "correct": 3, "total": 6}
    assert scores["groups"] == {
        "gsm8k/beam5": {"accuracy": 0.5, "correct": 1, "total": 2},
        "gsm8k/greedy": {"accuracy": 1.0, "correct": 2, "total": 2},
        "math/greedy": {"accuracy": 0.0, "correct": 0, "total": 2},
    }


def test_score_command_regrades(predictions_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["score", str(predictions_file), "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert scores["overall"] == {"accuracy": 3 / 6, "correct": 3, "total": 6}
    assert {key: tally["correct"] for key, tally in scores["groups"].items()} == {
        "gsm8k/beam5": 1, "gsm8k/greedy": 1, "math/greedy": 1,
    }
    assert scores["changed"] == 2

    assert main(["score", str(predictions_file)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["set", "correct", "total", "accuracy"]
    assert table[-2].split() == ["overall", "3", "6", "50.00%"]


def test_predictions_without_decoding_group_by_dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "minimal.jsonl"
    path.write_text(json.dumps({"id": "a", "dataset": "gsm_p2", "generation": "#### 4", "gold": "4"}) + "\n")
    assert main(["score", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["groups"] == {"gsm_p2": {"accuracy": 1.0, "correct": 1, "total": 1}}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"id": "x", "dataset": "gsm8k", "generation": "#### 1"}', "missing field 'gold'"),
        ('{"id": "x", "dataset": "svamp", "generation": "#### 1", "gold": "1"}', "unknown dataset 'svamp'"),
        ('{"id": "x", "dataset": "gsm8k", "generation": "#### 1", "gold": 1}', "field 'gold' has the wrong type"),
        ('{"id": "x", "dataset": "gsm8k", "generation": "1", "gold": "1", "correct": 1}', "field 'correct'"),
    ],
)
def test_malformed_line_is_a_one_line_error_naming_file_and_line(
    predictions_file: Path, capsys: pytest.CaptureFixture[str], line: str, message: str
) -> None:
    with predictions_file.open("a") as handle:
        handle.write(line + "\n")
    assert main(["score", str(predictions_file)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"{predictions_file}:{len(PREDICTIONS) + 1}: " in err and message in err


def test_missing_file_and_non_numeric_gold(tmp_path: Path) -> None:
    with pytest.raises(ClozeMathError, match="no such predictions file"):
        read_predictions(tmp_path / "absent.jsonl")
    path = tmp_path / "bad_gold.jsonl"
    write_predictions(path, [_prediction("g9", "gsm8k", "greedy", "#### 4", "four", False)])
    assert main(["score", str(path)]) == 2
