"""DEVELOPMENT.md's recipes "a training set" and "a model": a training set declared in `clozemath.data.training_sets`
alone, and a model added as one YAML file alone, are planned, segmented and prepared (the run's preprocessing steps)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from clozemath.data import training_sets
from clozemath.data.prepare import prepare_data
from clozemath.data.segment import segment_solution
from clozemath.errors import ClozeMathError
from clozemath.plan import load_plan
from clozemath_cli import main

ROOT = Path(__file__).resolve().parents[1]
ROWS = [
    {"question": "Ann has 3 apples and buys 4 more. How many apples has she?",
     "answer": "She has 3+4=<<3+4=7>>7 apples.\n#### 7"},
    {"question": "Bo bakes 2 trays of 5 cookies. How many cookies?",
     "answer": "He bakes 2*5=<<2*5=10>>10 cookies.\n#### 10"},
]


@pytest.fixture
def toy_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`toy`: GSM8K's format under a name of its own, registered as a plug-in would; its train split's file."""
    monkeypatch.setattr(training_sets.TRAINING_SETS, "_entries", dict(training_sets.TRAINING_SETS._entries))
    training_sets.TRAINING_SETS.register("toy", replace(training_sets.GSM8K, name="toy"))
    file = tmp_path / "toy" / "train.jsonl"
    file.parent.mkdir()
    file.write_text("".join(json.dumps(row) + "\n" for row in ROWS), encoding="utf-8")
    return file


@pytest.fixture
def experiment(tmp_path: Path, toy_set: Path) -> Path:
    """A configs folder whose one model, `toy-llama`, is a file of its own; an experiment training on `toy` with it."""
    configs = tmp_path / "configs"
    for folder in ("models", "methods", "experiments"):
        (configs / folder).mkdir(parents=True)
    model = (ROOT / "configs" / "models" / "tiny-llama.yaml").read_text().replace("name: tiny-llama", "name: toy-llama")
    (configs / "models" / "toy-llama.yaml").write_text(model)
    shutil.copy(ROOT / "configs" / "methods" / "clozemath.yaml", configs / "methods")
    path = configs / "experiments" / "toy.yaml"
    path.write_text(
        f"name: toy\nmodel: toy-llama\nmethod: clozemath\ndata: {{dataset: toy, path: {toy_set}}}\n"
        "eval: {sets: [{dataset: gsm8k}]}\n"
    )
    return path


def test_a_declared_training_set_and_a_model_file_are_planned_and_prepared(experiment: Path) -> None:
    (config,) = load_plan(experiment).experiments
    assert (config.model.name, config.data.dataset) == ("toy-llama", "toy")

    prepared = prepare_data(config)
    assert prepared.num_problems == 2
    question = ROWS[0]["question"]
    samples = {(s.kind, s.prefix, s.target) for s in prepared.samples if s.problem_id == "toy-train-0"}
    assert samples == {
        ("lm", f"Question: {question}\nAnswer:<SEP>", " She has 3+4=7 apples.\n#### 7<EOS>"),
        ("cloze", f"Question: {question}\nAnswer: She has <M_0> apples.<SEP>", "<M_0> 3+4=7<EOS>"),
    }
    assert all(row is not None for row in prepared.encoded)


def test_the_declared_set_is_segmented_by_its_rule_and_known_to_the_command_line(toy_set: Path, capsys) -> None:
    equations = [[s.text for s in segment_solution("toy", row["answer"]) if s.kind == "equation"] for row in ROWS]
    assert equations == [["3+4=7"], ["2*5=10"]]
    assert main(["data", "stats", "--dataset", "toy", "--path", str(toy_set), "--json"]) in (0, None)
    stats = json.loads(capsys.readouterr().out)
    assert (stats["problems"], stats["equations"]["total"], stats["solutions_without_equations"]) == (2, 2, 0)


def test_an_unknown_training_set_or_model_is_one_line_naming_the_known_ones(experiment: Path) -> None:
    known = r"\(known: gsm8k, math, toy\)$"
    with pytest.raises(ClozeMathError, match=rf"'data.dataset': unknown training set 'nope' {known}"):
        load_plan(experiment, ["data.dataset=nope"])
    with pytest.raises(ClozeMathError, match=r"unknown model 'tiny-llama' \(known: toy-llama\)$"):
        load_plan(experiment, ["model=tiny-llama"])


def test_the_sample_code_covers_the_training_sets_and_their_rules() -> None:
    """A training set's segmentation and gold rules shape its samples: their modules are part of the sample code that
    a run's identity and its preprocessing cache key hash, found in the preprocessing steps' imports rather than listed
    by hand; a module no step imports (the data statistics) is not."""
    from clozemath.data.prepare import preprocessing_key, sample_code
    from clozemath.data.sources import load_problems

    code = sample_code()
    assert {"clozemath.data.training_sets", "clozemath.data.gold", "clozemath.data.segment",
            "clozemath.data.sources", "clozemath.data.tokenize", "clozemath.data.prepare"} <= code.keys()
    assert "clozemath.data.stats" not in code
    config = load_plan(ROOT / "configs" / "experiments" / "smoke.yaml").experiments[0]
    problems = load_problems("gsm8k", "train", None, 4)
    edited = {**code, "clozemath.data.training_sets": "0" * 16}
    assert preprocessing_key(config, problems, edited) != preprocessing_key(config, problems, code)
