"""`bench/results/speed.json`'s writer (`bench/speed_record.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.speed_record import Headline, Side, command_line, main, record
from clozemath.errors import ClozeMathError


def headline(claim: str, ours: float, baseline: float, card: str = "NVIDIA H200") -> Headline:
    return Headline(
        claim=claim, model="llama-3.2-1b-random", card=card,
        ours=Side("packed", "ours: rows of 16,384", ours, "real tokens/s", {"peak_gib": 13.9}),
        baseline=Side("trl-flex", "TRL SFTTrainer padding_free + liger, 16 x 1024", baseline, "real tokens/s"),
        command=command_line("train_throughput.py", ["--data", "gsm8k", "--out", "a b.md"]),
    )


def test_headlines_are_appended_and_replaced_by_claim_model_and_card(tmp_path: Path) -> None:
    path = tmp_path / "results" / "speed.json"
    record([headline("training ClozeMath", 60_000, 40_000), headline("training IT", 66_000, 40_000)], path)
    record([headline("training ClozeMath", 75_000, 50_000), headline("training ClozeMath", 1, 1, card="H100")], path)
    saved = json.loads(path.read_text())
    assert [(h["claim"], h["card"]) for h in saved] == [
        ("training ClozeMath", "NVIDIA H200"), ("training IT", "NVIDIA H200"), ("training ClozeMath", "H100")]
    first = saved[0]
    assert first["ratio"] == 1.5  # 75,000 / 50,000: the second run replaced the first
    assert first["ours"] == {"name": "packed", "settings": "ours: rows of 16,384", "value": 75_000,
                             "unit": "real tokens/s", "peak_gib": 13.9}
    assert first["baseline"]["name"] == "trl-flex" and "padding_free" in first["baseline"]["settings"]
    assert first["command"] == "python bench/train_throughput.py --data gsm8k --out 'a b.md'"
    assert set(first) == {"claim", "model", "card", "ours", "baseline", "ratio", "command"}


def test_a_file_that_is_not_a_list_of_headlines_is_named_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "speed.json"
    path.write_text('{"claim": "not in a list"}')
    with pytest.raises(ClozeMathError, match=f"{path}: not a list of headline objects"):
        record([headline("training IT", 2, 1)], path)
    path.write_text("[{")
    with pytest.raises(ClozeMathError, match=f"{path}: cannot be read as JSON"):
        record([headline("training IT", 2, 1)], path)
    assert path.read_text() == "[{"


def test_files_from_elsewhere_merge_into_one(tmp_path: Path, capsys) -> None:
    first, second, into = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "speed.json"
    record([headline("training IT", 2, 1), headline("greedy decoding", 3, 1)], first)
    record([headline("training IT", 5, 2)], second)
    assert main([str(first), str(second), "--into", str(into)]) == 0
    assert [(h["claim"], h["ratio"]) for h in json.loads(into.read_text())] == [
        ("training IT", 2.5), ("greedy decoding", 3.0)]
    assert main([str(tmp_path / "missing.json"), "--into", str(into)]) == 2
    assert f"speed_record: error: {tmp_path / 'missing.json'}: no such file" in capsys.readouterr().err
