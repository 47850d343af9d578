"""An evaluation set chosen by a file of problem ids (`eval.sets[].ids`): those problems in the set's order, a seeded
subset of them with `limit`, the file's content among the run's inputs, a bad file or an id the set does not hold
one line naming it; and the committed MATH-500 list (`configs/ids/math500.txt`) against the data."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from clozemath.config import EvalSetConfig, ExperimentConfig
from clozemath.errors import ClozeMathError
from clozemath.eval.evaluate import eval_problems
from clozemath.plan import data_inputs, load_config

ROOT = Path(__file__).resolve().parents[1]
MATH500 = ROOT / "configs" / "ids" / "math500.txt"
GSM8K_TEST = 1319


def ids_file(folder: Path, text: str) -> Path:
    path = folder / "ids.txt"
    path.write_text(text, encoding="utf-8")
    return path


def test_the_listed_problems_in_the_sets_order_and_with_limit_a_seeded_subset_of_them(tmp_path: Path) -> None:
    listed = ["gsm8k-test-900", "gsm8k-test-3", "gsm8k-test-41", "gsm8k-test-1318", "gsm8k-test-7"]
    path = ids_file(tmp_path, "# a comment line\n\n" + "\n".join(f"{i}   # why" for i in listed) + "\n")
    chosen = eval_problems(EvalSetConfig(dataset="gsm8k", ids=str(path)))
    assert [p.id for p in chosen] == sorted(listed, key=lambda i: int(i.rsplit("-", 1)[1]))
    everything = {p.id: p for p in eval_problems(EvalSetConfig(dataset="gsm8k"))}
    assert len(everything) == GSM8K_TEST and all(p == everything[p.id] for p in chosen)
    subset = eval_problems(EvalSetConfig(dataset="gsm8k", ids=str(path), limit=2, seed=3))
    drawn = sorted(random.Random("eval/gsm8k/3").sample(range(len(chosen)), 2))  # as `limit` draws from any set
    assert [p.id for p in subset] == [chosen[i].id for i in drawn]


@pytest.mark.parametrize(("text", "error"), [
    ("gsm8k-test-1\ngsm8k-test-99999\nmath-test-2\n",
     "ids.txt: 'gsm8k-test-99999' and 1 more not among the 1,319 problems of gsm8k/test (its ids run gsm8k-test-0 "
     "... gsm8k-test-1318)"),
    ("gsm8k-test-1\n\ngsm8k-test-1 # again\n", "ids.txt:3: 'gsm8k-test-1' listed again (first on line 1)"),
    ("# nothing but a comment\n", "ids.txt: no problem ids in it"),
    (b"\xff\xfe", "ids.txt: an ids file, not UTF-8 text"),
    (None, "ids.txt: no such ids file"),
])
def test_a_bad_ids_file_is_one_line_naming_it(tmp_path: Path, text: str | bytes | None, error: str) -> None:
    path = tmp_path / "ids.txt"
    if isinstance(text, bytes):
        path.write_bytes(text)
    elif text is not None:
        path.write_text(text)
    with pytest.raises(ClozeMathError) as caught:
        eval_problems(EvalSetConfig(dataset="gsm8k", ids=str(path)))
    assert str(caught.value) == f"{tmp_path}/{error}"


def experiment(ids: Path) -> ExperimentConfig:
    config = load_config(ROOT / "configs" / "experiments" / "smoke.yaml",
                         [f"eval.sets=[{{dataset: gsm8k, ids: {ids}}}]"])
    assert isinstance(config, ExperimentConfig)
    return config


def test_the_ids_files_content_is_among_the_runs_inputs_and_checked_before_anything_runs(tmp_path: Path) -> None:
    """Other ids in the same file are other inputs (a grid does not resume on them); an id the set does not hold
    stops the run at its inputs, before Ray."""
    path = ids_file(tmp_path, "gsm8k-test-1\ngsm8k-test-2\n")
    before = data_inputs([experiment(path)], training=False)
    (key,) = [k for k in before if k.startswith("evaluation ids ")]
    assert key == f"evaluation ids {path} of gsm8k/test" and before[key].startswith(f"{path} ")
    ids_file(tmp_path, "gsm8k-test-1\ngsm8k-test-3\n")
    after = data_inputs([experiment(path)], training=False)
    assert after[key] != before[key] and {k: v for k, v in after.items() if k != key} == {
        k: v for k, v in before.items() if k != key}
    ids_file(tmp_path, "gsm8k-test-1\ngsm8k-test-5000\n")
    with pytest.raises(ClozeMathError, match=r"ids.txt: 'gsm8k-test-5000' not among the 1,319 problems of gsm8k/test"):
        data_inputs([experiment(path)], training=False)


def test_the_committed_math500_ids_are_the_rows_math500_names() -> None:
    """Each id's row of the MATH test file holds the subject and file the line names (MATH-500's `unique_id`), 500
    problems over MATH's seven subjects, all of them evaluated."""
    data = Path(os.environ.get("CLOZEMATH_DATA_DIR", "")) / "math" / "test.jsonl"
    if not data.is_file():
        pytest.skip(f"no MATH test file at {data}")
    rows = [json.loads(line) for line in data.read_text(encoding="utf-8").splitlines()]
    lines = [line.split("#") for line in MATH500.read_text().splitlines() if not line.startswith("#")]
    assert len(lines) == 500
    for problem_id, name in lines:
        row = rows[int(problem_id.strip().removeprefix("math-test-"))]
        assert name.strip() == f"test/{row['subject']}/{row['file_id']}.json"
    chosen = eval_problems(EvalSetConfig(dataset="math", ids=str(MATH500)))
    assert len(chosen) == 500 and {p.id for p in chosen} == {i.strip() for i, _ in lines}
