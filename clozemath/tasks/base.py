"""What a dataset family tells the rest of the code: its problems, how its answers are found and graded, how a
base model is prompted for it; and the grading vocabulary every family shares (`Found`, `Graded`, the rules)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from clozemath.data.sources import Problem, data_identity, load_problems
from clozemath.tasks.harness import Match, exact_match

MATH_VERIFY_TIMEOUT_S = 5.0
"""How long one math-verify check may run (`clozemath.tasks.mathverify`) before the string comparison decides."""

Found = tuple[tuple[int, int], str]
"""Where an answer is in a generation (character offsets `[start, end)`) and the rule that found it."""

MARKED_RULES = frozenset({"strict", "boxed", "final_answer"})
"""The rules that read the answer where the solution format marks it (`####`, `\\boxed{}`, Minerva's final-answer
line); the other, `flexible` (the last number), is a fallback for generations that never mark one. Strict accuracy
counts only answers found by these."""
FALLBACK_RULE = "flexible"
CUT_RULE = "cut"
"""A generation cut at `max_new_tokens` before it marked an answer: wrong, whatever its last number (a model that
loops repeats numbers until the cut, and the last of them is right by luck often enough to score)."""
ACCURACY_RULE = ("the marked answer (after `####`, in `\\boxed{}`), else the last number of a generation that ended "
                 "on its own (one cut at max_new_tokens without a marked answer is wrong); base models: the harness's "
                 "strict-match")
"""What `accuracy` counts."""
ACCURACY_RULE_SHORT = "accuracy: the marked answer, else the last number of an uncut generation; base: strict-match"
"""The same, short enough for every table's header."""


@dataclass(frozen=True)
class Graded:
    extracted: str | None
    correct: bool
    rule: str
    """How the answer was found: strict | flexible | boxed | final_answer | none, or cut (`CUT_RULE`)."""
    lenient: bool | None = None
    """The verdict had the last-number fallback read cut generations too (the rule before 2026-12-02); None: the
    same as `correct`."""

    @property
    def lenient_correct(self) -> bool:
        return self.correct if self.lenient is None else self.lenient


def first_turn(text: str, markers: tuple[str, ...]) -> str:
    """`text` up to where it first starts a new turn of a prompt format (a line opening with one of `markers`, such as
    `\nQuestion:`): a model that does not stop after its answer goes on with a problem of its own, whose numbers are
    not its answer (the harness's stop sequences cut there too)."""
    ends = [end for marker in markers if (end := text.find(marker)) >= 0]
    return text[:min(ends)] if ends else text


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
    harness_match: Match = exact_match
    """How those filters' answers are compared with the gold: the harness's `exact_match` (GSM8K, a harness task), or
    `numeric_match` (GSM-Symbolic, which is none)."""
    vote_rules: frozenset[str] = MARKED_RULES
    """The rules whose answers vote in CoT-decoding's `marked` vote (`eval.cot_vote`)."""

    def grade(self, generation: str, gold: str, *, ended: bool = True, timeout_s: float = MATH_VERIFY_TIMEOUT_S
              ) -> Graded:
        """Extract the answer of `generation` and compare it with `gold`; `ended`: the generation ended on its own
        (else it was cut at `max_new_tokens`, and the last-number fallback does not apply: `CUT_RULE`)."""
        graded = self.judge(self.find_answer(generation), generation, gold, timeout_s)
        if ended or graded.rule != FALLBACK_RULE:
            return graded
        return Graded(graded.extracted, False, CUT_RULE, lenient=graded.correct)

    def answer_span(self, text: str, ended: bool = True, marked_only: bool = False) -> tuple[int, int] | None:
        """Character offsets `[start, end)` in `text` of the answer `grade` extracts, where it extracts one that may
        be right (`ended`: as `grade`'s, so that a cut generation's last number is none); `marked_only`: only an
        answer where the format marks it as CoT-decoding's vote counts it (`vote_rules`), not the last-number
        fallback."""
        found = self.find_answer(text)
        if found is None or (marked_only and found[1] not in self.vote_rules) or (
                not ended and found[1] == FALLBACK_RULE):
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
