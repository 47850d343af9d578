"""What a dataset family tells the rest of the code: its problems, how its answers are found and graded, how a
base model is prompted for it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from clozemath.data.sources import Problem, data_identity, load_problems
from clozemath.eval.answers import MARKED_RULES, MATH_VERIFY_TIMEOUT_S, Found, Graded


class EvalSource(Protocol):
    """Where an evaluation set's problems come from (`clozemath.config.EvalSetConfig` is one)."""

    split: str
    path: str | None
    per_template: int
    seed: int
    generate: bool


@dataclass(frozen=True)
class Task:
    """One evaluation set. Register it in `clozemath.tasks` and every command can evaluate, grade and report it."""

    name: str
    """As configs (`eval.sets[].dataset`), predictions files and metric keys name it."""
    title: str
    """As the report's tables name it."""
    problems: Callable[[EvalSource], list[Problem]]
    """All the set's problems, in a fixed order (a subset is drawn from them)."""
    identity: Callable[[EvalSource], str]
    """Where the problems come from and a fingerprint of their content (a grid restores only on the same data)."""
    find_answer: Callable[[str], Found | None]
    judge: Callable[[Found | None, str, str, float], Graded]
    """(found answer, generation, gold, math-verify timeout) -> verdict."""
    answer_key: Callable[[str], str]
    """The key under which CoT-decoding sums the confidence of equal answers."""
    few_shot_prompt: Callable[[Problem], str]
    """A base model's prompt, as lm-evaluation-harness builds it."""
    stop: tuple[str, ...]
    """Where a few-shot generation stops."""
    harness_filters: bool = False
    """Few-shot predictions graded by lm-evaluation-harness's `gsm8k` answer filters (strict-match first)."""

    def grade(self, generation: str, gold: str, *, timeout_s: float = MATH_VERIFY_TIMEOUT_S) -> Graded:
        """Extract the answer of `generation` and compare it with `gold`."""
        return self.judge(self.find_answer(generation), generation, gold, timeout_s)

    def answer_span(self, text: str, marked_only: bool = False) -> tuple[int, int] | None:
        """Character offsets `[start, end)` in `text` of the answer `grade` extracts; `marked_only`: only an answer
        where the format marks it (`MARKED_RULES`: `####`, `\\boxed{}`), not the last-number fallback."""
        found = self.find_answer(text)
        if found is None or (marked_only and found[1] not in MARKED_RULES):
            return None
        return found[0]


@dataclass(frozen=True)
class StoredDataset:
    """`problems` and `identity` of a set that `clozemath.data.sources` loads by name (GSM8K, MATH)."""

    name: str

    def problems(self, source: EvalSource) -> list[Problem]:
        return load_problems(self.name, source.split, source.path)

    def identity(self, source: EvalSource) -> str:
        return data_identity(self.name, source.split, source.path)
