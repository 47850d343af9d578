"""The dataset registry: an evaluation set added by registering one `Task`, and nothing else, is configured, evaluated,
graded, scored and reported like the built-in ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from clozemath import tasks
from clozemath.data.sources import Problem
from clozemath.errors import ClozeMathError
from clozemath.eval.evaluate import eval_problems, eval_set_identity, evaluate_batch, prompting
from clozemath.eval.predictions import metrics, read_predictions, regrade, results_table, write_predictions
from clozemath.model.load import load_model
from clozemath.plan import load_config
from clozemath.report import set_title
from clozemath.tasks import Task, gsm8k, register

SMOKE = Path(__file__).resolve().parents[1] / "configs" / "experiments" / "smoke.yaml"
TOY_PROBLEMS = [
    Problem(f"toy-{i}", "toy", "test", f"What is {i} plus {i}?", f"{i} + {i} = {2 * i}\n#### {2 * i}", str(2 * i))
    for i in range(6)
]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def toy_task() -> Task:
    return Task(
        name="toy", title="Toy", problems=lambda source: list(TOY_PROBLEMS), identity=lambda source: "toy v1",
        find_answer=gsm8k.find_answer, judge=gsm8k.judge, answer_key=gsm8k.number_key,
        few_shot_prompt=lambda problem: f"Q: {problem.question}\nA:", stop=("\nQ:",),
    )


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> Task:
    monkeypatch.setattr(tasks.TASKS, "_entries", dict(tasks.TASKS._entries))  # registered for this test only
    return register(toy_task())


def test_a_toy_evaluation_set_through_the_registry_alone(toy: Task, tmp_path: Path) -> None:
    config = load_config(SMOKE, [
        "method=base", "eval.sets=[{dataset: toy, limit: 4}]", "eval.decodings=[greedy]", "eval.max_new_tokens=8",
    ])
    [set_cfg] = config.eval.sets
    problems = eval_problems(set_cfg)
    assert len(problems) == 4 and set(problems) <= set(TOY_PROBLEMS) and eval_set_identity(set_cfg) == "toy v1"

    loaded = load_model(config.model, 0, "cpu", training=False)
    predictions = evaluate_batch(loaded, problems, "greedy", config.eval, prompting(config))
    assert [p.prompt for p in predictions] == [f"Q: {p.question}\nA:" for p in problems]  # the task's few-shot prompt
    assert all(p.dataset == "toy" and p.harness is None for p in predictions)  # graded by the task's own rules

    values = metrics(predictions)
    assert values["eval/toy/greedy/total"] == 4 and "| toy | greedy |" in results_table(values)
    path = tmp_path / "toy.jsonl"
    write_predictions(path, predictions)
    assert regrade(read_predictions(path)) == predictions
    assert tasks.grade("toy", "so #### 10", "10").correct and set_title("toy") == "Toy"


def test_an_unknown_evaluation_set_is_refused_in_the_config() -> None:
    with pytest.raises(ClozeMathError, match="unknown dataset 'toy'"):
        load_config(SMOKE, ["eval.sets=[{dataset: toy}]"])
