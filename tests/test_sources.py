"""Reading problems: a split's slice (`train[:-500]`, `train[-500:]`) for a validation set held out of training."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from clozemath.data.sources import load_problems
from clozemath.errors import ClozeMathError


def gsm8k_train_lines() -> int:
    path = Path(os.environ["CLOZEMATH_DATA_DIR"]) / "gsm8k" / "train.jsonl"
    return sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())


def test_a_held_out_slice_and_the_rest_partition_the_split() -> None:
    whole = load_problems("gsm8k", "train")
    training, validation = load_problems("gsm8k", "train[:-500]"), load_problems("gsm8k", "train[-500:]")
    assert len(whole) == gsm8k_train_lines()
    assert len(validation) == 500 and len(training) == len(whole) - 500
    assert training + validation == whole  # same ids, texts and order as the whole split's
    assert {p.id for p in training}.isdisjoint(p.id for p in validation)


def test_a_limit_applies_within_the_slice() -> None:
    assert load_problems("gsm8k", "train[-500:]", limit=3) == load_problems("gsm8k", "train")[-500:-497]
    assert load_problems("gsm8k", "train[10:20]") == load_problems("gsm8k", "train", limit=20)[10:]


@pytest.mark.parametrize(("split", "culprit"), [("train[5]", "train[5]"), ("train[a:]", "train[a:]"),
                                                ("train[-99999:-99998]", "holds none")])
def test_a_bad_slice_is_a_one_line_error(split: str, culprit: str) -> None:
    with pytest.raises(ClozeMathError, match=culprit.replace("[", r"\[")):
        load_problems("gsm8k", split)
