"""Bad bytes and empty files: a one-line error naming the file (and line), never a traceback or a silent zero."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from clozemath_cli import main

GSM8K_TRAIN = Path(os.environ["CLOZEMATH_DATA_DIR"], "gsm8k", "train.jsonl")
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.startswith("clozemath: error: ") and err.count("\n") == 1, err
    return err


def test_a_data_file_with_bytes_that_are_not_utf8_is_named_with_its_line(tmp_path: Path, capsys) -> None:
    lines = GSM8K_TRAIN.read_bytes().splitlines(keepends=True)[:3]
    lines[2] = lines[2].replace(b"Betty", b"B\xe9tty", 1)  # Latin-1, not UTF-8
    (tmp_path / "train.jsonl").write_bytes(b"".join(lines))
    assert main(["data", "stats", "--dataset", "gsm8k", "--path", str(tmp_path)]) == 2
    assert f"{tmp_path / 'train.jsonl'}:3: not UTF-8 text (byte 0xe9" in _one_line_error(capsys)


def test_a_predictions_file_with_bad_bytes_is_named_with_its_line(tmp_path: Path, capsys) -> None:
    row = {"id": "g1", "dataset": "gsm8k", "generation": "#### 7", "gold": "7"}
    path = tmp_path / "predictions.jsonl"
    path.write_bytes(json.dumps(row).encode() + b"\n" + b'{"id": "g2\xff"}\n')
    assert main(["score", str(path)]) == 2
    assert f"{path}:2: not UTF-8 text (byte 0xff" in _one_line_error(capsys)


def test_a_config_with_bad_bytes_is_named_with_its_line(tmp_path: Path, capsys) -> None:
    config = tmp_path / "configs" / "experiments" / "bad.yaml"
    config.parent.mkdir(parents=True)
    config.write_bytes(b"name: bad\n# caf\xe9\nmodel: tiny-llama\n")
    assert main(["run", str(config)]) == 2
    assert f"{config}:2: not UTF-8 text (byte 0xe9)" in _one_line_error(capsys)


@pytest.mark.parametrize("content", ["", "\n\n"])
def test_an_empty_training_file_is_an_error(tmp_path: Path, capsys, content: str) -> None:
    (tmp_path / "train.jsonl").write_text(content)
    assert main(["data", "stats", "--dataset", "gsm8k", "--path", str(tmp_path)]) == 2
    assert "train.jsonl: no problems in it (an empty file)" in _one_line_error(capsys)
    experiment = CONFIGS / "experiments" / "smoke.yaml"
    assert main(["prepare", str(experiment), f"data.path={tmp_path}"]) == 2
    assert "no problems in it" in _one_line_error(capsys)


def test_an_empty_predictions_file_is_an_error(tmp_path: Path, capsys) -> None:
    path = tmp_path / "predictions.jsonl"
    path.write_text("")
    assert main(["score", str(path)]) == 2
    assert f"{path}: no predictions in it (an empty file)" in _one_line_error(capsys)
