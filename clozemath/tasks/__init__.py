"""The dataset registry: every evaluation set by name, one module per dataset family (as nanochat's `tasks/`).

A family's module holds what is particular to it (where its problems come from, how its answers are found and
graded, how a base model is prompted) as `Task`s. Adding an evaluation set is one new module and one line in
`TASKS`, or a `register` call: configs, predictions files, metrics, `clozemath score` and the report then know it.
"""

from __future__ import annotations

from clozemath.data.sources import Problem
from clozemath.registry import Registry
from clozemath.tasks.base import MATH_VERIFY_TIMEOUT_S, EvalSource, Graded, Task
from clozemath.tasks.gsm8k import GSM8K
from clozemath.tasks.gsm_symbolic import GSM_P1, GSM_P2, GSM_SYMBOLIC
from clozemath.tasks.math import MATH

__all__ = ["EvalSource", "Task", "answer_span", "few_shot_prompt", "get_task", "grade", "register", "task_names"]

TASKS: Registry[Task] = Registry("dataset", [(task.name, task) for task in (GSM8K, MATH, GSM_SYMBOLIC, GSM_P1, GSM_P2)])
task_names = TASKS.names
get_task = TASKS.__getitem__


def register(task: Task) -> Task:
    """Make an evaluation set known by its name (registering a name again replaces it)."""
    return TASKS.register(task.name, task)


def grade(dataset: str, generation: str, gold: str, *, ended: bool = True,
          timeout_s: float = MATH_VERIFY_TIMEOUT_S) -> Graded:
    """Extract the answer of `generation` and compare it with `gold` (the dataset's gold answer string); `ended`:
    the generation ended on its own, not at `max_new_tokens` (`Task.grade`)."""
    return get_task(dataset).grade(generation, gold, ended=ended, timeout_s=timeout_s)


def few_shot_prompt(problem: Problem) -> str:
    """A base model's prompt for the problem, as lm-evaluation-harness builds it for the problem's dataset."""
    return get_task(problem.dataset).few_shot_prompt(problem)


def answer_span(dataset: str, text: str, ended: bool = True) -> tuple[int, int] | None:
    """Character offsets `[start, end)` in `text` of the answer `grade` extracts (the number; the boxed content)."""
    return get_task(dataset).answer_span(text, ended)
