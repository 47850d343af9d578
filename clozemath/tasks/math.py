"""MATH (Hendrycks et al. 2021): competition problems with LaTeX answers; its test split as an evaluation set.

Answers: the last `\\boxed{}` (else the Minerva format's `The final answer is $...$`) in the generation's first turn,
graded by math-verify with the MATH paper's normalized string equality as fallback. Base models: 4-shot in the
Minerva format, as lm-evaluation-harness's `minerva_math` tasks prompt them.
"""

from __future__ import annotations

from clozemath.data.sources import Problem
from clozemath.eval.answers import Found, Graded, first_turn, graded_latex, latex_answer, normalize_math_answer
from clozemath.eval.prompts import MINERVA_MATH_STOP, minerva_math_few_shot
from clozemath.tasks.base import StoredDataset, Task

NEXT_TURN = "\nProblem:"
"""Where a generation that goes on past its answer starts a problem of its own."""


def find_answer(text: str) -> Found | None:
    return latex_answer(first_turn(text, NEXT_TURN))


def judge(found: Found | None, generation: str, gold: str, timeout_s: float) -> Graded:
    return graded_latex(found, generation, gold, timeout_s)


def few_shot_prompt(problem: Problem) -> str:
    return minerva_math_few_shot(problem.question)


_STORED = StoredDataset("math")

MATH = Task(
    name="math", title="MATH", problems=_STORED.problems, identity=_STORED.identity,
    find_answer=find_answer, judge=judge, answer_key=normalize_math_answer, few_shot_prompt=few_shot_prompt,
    stop=MINERVA_MATH_STOP,
)
