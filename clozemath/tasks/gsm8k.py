"""GSM8K (Cobbe et al. 2021): grade-school word problems with numeric answers; its test split as an evaluation set.

Answers: the number after `####`, else the last number, in the generation's first turn, equal to the gold within
`NUMERIC_TOLERANCE`. Base models: 5-shot as lm-evaluation-harness's `gsm8k` task prompts them, graded by its answer
filters. The GSM-Symbolic sets (`clozemath.tasks.gsm_symbolic`) grade and prompt the same way.
"""

from __future__ import annotations

from functools import cache

from clozemath.data.sources import Problem, load_problems
from clozemath.eval.answers import Found, Graded, first_turn, graded_number, number_key, numeric_answer
from clozemath.eval.prompts import GSM8K_STOP, gsm8k_few_shot, gsm8k_shots
from clozemath.tasks.base import StoredDataset, Task

NEXT_TURN = "\nQuestion:"
"""Where a generation that goes on past its answer starts a problem of its own."""


def find_answer(text: str) -> Found | None:
    return numeric_answer(first_turn(text, NEXT_TURN))


def judge(found: Found | None, generation: str, gold: str, timeout_s: float) -> Graded:
    return graded_number(found, generation, gold)


@cache
def _train() -> tuple[Problem, ...]:
    return tuple(load_problems("gsm8k", "train"))


def _harness_document(problem: Problem) -> int:
    """The problem's position in the harness's `gsm8k` test documents (its file order); other GSM8K-like sets, which
    are no harness task, take the shots of the first document."""
    prefix = "gsm8k-test-"
    return int(problem.id.removeprefix(prefix)) if problem.id.startswith(prefix) else 0


def few_shot_prompt(problem: Problem) -> str:
    """GSM8K 5-shot, as lm-evaluation-harness builds it."""
    return gsm8k_few_shot(problem.question, gsm8k_shots(_train(), _harness_document(problem)))


_STORED = StoredDataset("gsm8k")

GSM8K = Task(
    name="gsm8k", title="GSM8K", problems=_STORED.problems, identity=_STORED.identity,
    find_answer=find_answer, judge=judge, answer_key=number_key, few_shot_prompt=few_shot_prompt, stop=GSM8K_STOP,
    harness_filters=True,
)
