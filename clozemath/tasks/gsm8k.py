"""GSM8K (Cobbe et al. 2021): grade-school word problems with numeric answers; its test split as an evaluation set.

Answers: the number after `####` (rule `strict`), else the one number of the last `\\boxed{}` (`boxed`: how a
MATH-trained model marks its answer to a GSM-Symbolic problem, `\\boxed{510} emails in a 5 day week`, whose last
number is 5), else the last number (`flexible`, the fallback), in the generation's first turn, equal to the gold
within `NUMERIC_TOLERANCE`. CoT-decoding's `marked` vote counts only `####` answers, the paper's rule. Base models:
5-shot as lm-evaluation-harness v0.4.12's `gsm8k` task (version 3.0) prompts them, graded by its answer filters
(`clozemath.tasks.harness`). The GSM-Symbolic sets (`clozemath.tasks.gsm_symbolic`) grade and prompt the same way.

The harness writes each shot as `Question: {question}\\nAnswer: {answer}` (the answer as the data has it, calculator
annotations and `#### N` kept), joins the shots and the test question with "\\n\\n", and ends with the test question.
Its default sampler draws the 5 shots from the train split with one `random.Random(1234)` (the harness's default
few-shot seed) per task, `sample(train, 5)` once per test document in document order: test problem i gets the draw
i + 1 of that generator. It decodes greedily, stops at its `until` strings (and at the model's end-of-sequence token,
as our decoder does anyway) after at most 256 new tokens (its `max_gen_toks` for Hugging Face models), and encodes
the prompt with the tokenizer's own special tokens (Llama's BOS).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from fractions import Fraction
from functools import cache

from clozemath.data.gold import NUMERIC_TOLERANCE, boxed_span
from clozemath.data.sources import Problem, load_problems
from clozemath.errors import ClozeMathError
from clozemath.tasks.base import Found, Graded, StoredDataset, Task, first_turn

NEXT_TURN = ("\nQuestion:",)
"""Where a generation that goes on past its answer starts a problem of its own (the 5-shot prompt's format and the
trained models' `Question: ...\nAnswer:`)."""
GSM8K_SHOTS = 5
HARNESS_FEWSHOT_SEED = 1234
GSM8K_STOP = ("Question:", "</s>", "<|im_end|>")
"""The `until` of the harness's `gsm8k` (task version 3.0)."""


# --- answers: numbers --------------------------------------------------------------------------------------------

# A sign (`-`, or the Unicode minus `−`; also `-$5`; not the hyphen of `10-7`), then digits with optional thousands
# commas and decimals, or a bare decimal (`.5`); a leading `$` and a trailing `.`, `%` or unit stay outside.
# `1,2,3` is three numbers; `1,000` is one.
_MINUS = "-\u2212"
_NUMBER = (
    rf"(?:(?<![\w.])[{_MINUS}]\$?)?(?:(?:\d{{1,3}}(?:,\d{{3}})+(?!\d)|\d+)(?:\.\d+)?|(?<![\w.])\.\d+)"
)
_NUMBER_RE = re.compile(_NUMBER)
_STRICT_RE = re.compile(rf"####\s*(?:\$\s*)?({_NUMBER})")  # no two `\s*` side by side: linear in spaces


def numeric_answer(text: str) -> Found | None:
    """The number after `####` (`strict`), else the last `\\boxed{}`'s number where it holds one and no other
    (`boxed`: `\\boxed{20\\%}`, `\\boxed{\\$15}`; not `\\boxed{\\frac{3}{4}}`), else the last number (`flexible`)."""
    strict = _STRICT_RE.search(text)
    if strict:
        return strict.span(1), "strict"
    boxed = boxed_span(text)
    if boxed is not None:
        numbers = list(_NUMBER_RE.finditer(text, *boxed))
        if len(numbers) == 1:
            return numbers[0].span(), "boxed"
    last = None
    for last in _NUMBER_RE.finditer(text):
        pass
    return None if last is None else (last.span(), "flexible")


def graded_number(found: Found | None, generation: str, gold: str) -> Graded:
    """A numeric answer against a numeric gold: equal within `NUMERIC_TOLERANCE` (a gold that is no number is an
    error, found answer or not)."""
    gold_number = _gold_number(gold)
    if found is None:
        return Graded(None, False, "none")
    (start, end), rule = found
    extracted = _clean_number(generation[start:end])
    return Graded(extracted, abs(float(extracted) - gold_number) <= NUMERIC_TOLERANCE, rule)


def number_key(text: str) -> str:
    """The key under which CoT-decoding sums the confidence of equal numeric answers (`1,000` = `1000.0`)."""
    cleaned = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        return str(Fraction(cleaned))
    except (ValueError, ZeroDivisionError):
        return cleaned


def _clean_number(text: str) -> str:
    return text.replace(",", "").replace("$", "").replace("\u2212", "-").rstrip(".")


def _gold_number(gold: str) -> float:
    try:
        return float(_clean_number(gold.strip()))
    except ValueError:
        raise ClozeMathError(f"gold answer '{gold}' is not a number") from None


def find_answer(text: str) -> Found | None:
    return numeric_answer(first_turn(text, NEXT_TURN))


def judge(found: Found | None, generation: str, gold: str, timeout_s: float) -> Graded:
    return graded_number(found, generation, gold)


# --- the harness's 5-shot prompt ---------------------------------------------------------------------------------

HARNESS_DOCUMENTS = 1319
"""GSM8K test's documents: the draws are made for all of them at once (a document's shots are the same whatever the
draws after it)."""


@cache
def gsm8k_shot_draws(num_train: int, num_documents: int) -> tuple[tuple[int, ...], ...]:
    """The train indices of each test document's shots, documents in order, as the harness's default sampler draws
    them (its shared generator is why a document's shots depend on its position)."""
    if num_train < GSM8K_SHOTS:
        raise ValueError(f"{GSM8K_SHOTS} shots asked for, {num_train} train problems given")
    generator = random.Random(HARNESS_FEWSHOT_SEED)
    return tuple(tuple(generator.sample(range(num_train), GSM8K_SHOTS)) for _ in range(num_documents))


def gsm8k_shots(train: Sequence[Problem], document: int) -> list[Problem]:
    """The 5 train problems the harness shows before test document `document` (0-based, in file order)."""
    return [train[index] for index in gsm8k_shot_draws(len(train), max(document + 1, HARNESS_DOCUMENTS))[document]]


def gsm8k_few_shot(question: str, shots: Sequence[Problem]) -> str:
    blocks = [f"Question: {shot.question}\nAnswer: {shot.solution}" for shot in shots]
    return "\n\n".join([*blocks, f"Question: {question}\nAnswer:"])


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
    harness_filters=True, vote_rules=frozenset({"strict"}),
)
