"""Grading on the real GSM8K, GSM-Symbolic p2 and MATH test golds; math-verify's timeout from any thread."""

from __future__ import annotations

import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import pytest

from clozemath.data.sources import load_problems
from clozemath.errors import ClozeMathError
from clozemath.data.gold import last_boxed
from clozemath.tasks import answer_span, grade
from clozemath.tasks import math as math_task
from clozemath.tasks.math import normalize_math_answer

SAMPLE = 150
# math-verify rejects `\\left (` with a space and units written `\\text {...}`: the normalized fallback covers those.
MATH_VERIFY_BLIND_SPOTS = {"spaces", "unit_dropped"}


@pytest.fixture(scope="module")
def math_golds() -> list[str]:
    return [problem.answer for problem in load_problems("math", "test")]


def _sample(golds: list[str], n: int = SAMPLE, seed: int = 0) -> list[str]:
    return random.Random(seed).sample(golds, min(n, len(golds)))


# --- GSM8K-like ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("generation", "gold", "extracted", "rule"),
    [
        ("48/2 = 24 clips.\n#### 72", "72", "72", "strict"),
        ("#### 72\nQuestion: another one, #### 5", "72", "72", "strict"),  # the first `####` answers this question
        ("She pays 5 dollars.\n#### $1,000", "1000", "1000", "strict"),
        ("#### -3", "-3", "-3", "strict"),
        ("####2.50", "2.5", "2.50", "strict"),
        ("#### none, so 18 it is", "18", "18", "flexible"),  # no number right after `####`
        ("So she has 3 + 4 = 7 apples.", "7", "7", "flexible"),
        ("The total is $5.00.", "5", "5.00", "flexible"),
        ("It grew by 50%.", "50", "50", "flexible"),
        ("They raised 1,000 dollars", "1000", "1000", "flexible"),
        ("The change is -$12.", "-12", "-12", "flexible"),
        ("The list 1,2,3", "3", "3", "flexible"),
        ("The score was 10-7", "7", "7", "flexible"),  # a hyphen, not a sign
        ("So x =-4", "-4", "-4", "flexible"),
        ("It is 0.33334 of it", "0.3333", "0.33334", "flexible"),  # within 1e-4
        ("#### .5", "0.5", ".5", "strict"),  # a bare decimal is a half, not 5
        ("It costs $.75 each", "0.75", ".75", "flexible"),
        ("#### \u22123", "-3", "-3", "strict"),  # the Unicode minus sign
        ("It fell by \u22124.5 degrees", "-4.5", "-4.5", "flexible"),
        # a model that does not stop goes on with a question of its own: its numbers are not the answer
        ("The answer is 7.\n\nQuestion: Tom has 9 apples. How many?\nAnswer: 9", "7", "7", "flexible"),
        ("She has 7.\nQuestion: and then #### 9", "7", "7", "flexible"),
        # a MATH-trained model marks its answer to a GSM-like problem with \\boxed{}: its one number, not the last
        ("So, Hiroshi responds to \\(\\boxed{510}\\) emails in a 5 day work week.", "510", "510", "boxed"),
        ("&= \\boxed{20\\%}\n\\end{align*}", "20", "20", "boxed"),
        ("costs \\boxed{\\$1,500} for 3 weeks", "1500", "1500", "boxed"),
        ("\\boxed{-4} degrees, up 2", "-4", "-4", "boxed"),
        ("#### 12\nThat is \\boxed{13}", "12", "12", "strict"),  # `####` first
        ("\\boxed{\\frac{3}{4}} of 8 is 6", "6", "6", "flexible"),  # two numbers in the box: the last number
        ("The box \\boxed{x} holds 9", "9", "9", "flexible"),  # no number in it
    ],
)
def test_numeric_extraction_and_equality(generation: str, gold: str, extracted: str, rule: str) -> None:
    graded = grade("gsm8k", generation, gold)
    assert (graded.extracted, graded.correct, graded.rule) == (extracted, True, rule)


@pytest.mark.parametrize(
    ("generation", "gold", "rule"),
    [
        ("#### 71", "72", "strict"),
        ("#### 72.01", "72", "strict"),
        ("#### 72\nThen 73", "73", "strict"),
        ("She has 7 apples and 8 pears", "7", "flexible"),
        ("The change is -12.", "12", "flexible"),
        ("no number at all", "1", "none"),
    ],
)
def test_numeric_mismatch(generation: str, gold: str, rule: str) -> None:
    graded = grade("gsm_symbolic", generation, gold)
    assert (graded.correct, graded.rule) == (False, rule)
    assert (graded.extracted is None) == (rule == "none")


@pytest.mark.parametrize(
    "generation",
    ["#### " + " " * 200_000, "####" + " " * 100_000 + "$" + " " * 100_000, "#### " * 40_000, "1," * 100_000],
)
def test_numeric_grading_is_linear_in_the_generation(generation: str) -> None:
    """200 kB generations grade in about 0.2 s (quadratic backtracking took 31 s for 20 kB, so would take an hour)."""
    started = time.perf_counter()
    grade("gsm8k", generation, "5")
    assert time.perf_counter() - started < 2.0


def test_numeric_span_covers_the_extracted_number() -> None:
    text = "Costs $1,250.50 then. #### $1,250.50 total"
    start, end = answer_span("gsm8k", text)
    assert (start, text[start:end]) == (text.index("####") + 6, "1,250.50")
    assert answer_span("gsm_p1", "nothing here") is None


def test_cot_decodings_marked_vote_counts_only_the_papers_mark_on_gsm8k_and_the_box_on_math() -> None:
    """CoT-decoding's `marked` vote (`eval.cot_vote`): on GSM8K-like sets a branch votes with a `####` answer only
    (the paper's rule), not a boxed one, which grading still reads; on MATH the box is the mark."""
    from clozemath.tasks import get_task

    boxed = "so the total is \\boxed{72} dollars for 3 days"
    gsm8k, math = get_task("gsm8k"), get_task("math")
    start, end = gsm8k.answer_span(boxed)
    assert boxed[start:end] == "72" and gsm8k.answer_span(boxed, marked_only=True) is None
    marked = "48 + 24 = 72\n#### 72"
    start, end = gsm8k.answer_span(marked, marked_only=True)
    assert marked[start:end] == "72"
    start, end = math.answer_span(boxed, marked_only=True)
    assert boxed[start:end] == "72"


@pytest.mark.parametrize(
    ("dataset", "text"),
    [("gsm8k", "She has 7 apples. 5 5 5 5"), ("gsm8k", "48 + 24 = 72\n#### 7"), ("gsm8k", "so \\boxed{7} and 5 5"),
     ("math", "so $x = \\boxed{7}$ and 5 5"), ("math", "x is 7 and 5 5 5")],
)
def test_a_cut_generation_has_an_answer_span_where_grading_reads_one_that_may_be_right(dataset: str, text: str) -> None:
    """CoT-decoding votes with the answer `answer_span` finds; for a generation cut at `max_new_tokens` that is the
    answer grading may count right: a marked or boxed one, never the last number (`CUT_RULE`)."""
    from clozemath.tasks import get_task

    task = get_task(dataset)
    for ended in (True, False):
        span = task.answer_span(text, ended)
        graded = task.grade(text, "7", ended=ended)
        assert (span is None) == (graded.rule == "cut" or graded.extracted is None), (ended, graded)
        if span is not None:
            assert task.answer_key(text[span[0]:span[1]]) == task.answer_key(graded.extracted)


@pytest.mark.parametrize("dataset", ["gsm8k", "gsm_p2"])
def test_every_numeric_test_gold_is_correct_against_itself(dataset: str) -> None:
    problems = load_problems(dataset, "test")
    assert len(problems) == {"gsm8k": 1319, "gsm_p2": 2500}[dataset]
    for problem in problems:
        gold = problem.answer
        strict = grade(dataset, f"{problem.solution.rpartition('####')[0]}#### {gold}", gold)
        sentence = f"So the answer is {gold}."
        flexible = grade(dataset, sentence, gold)
        assert (strict.correct, strict.rule) == (True, "strict"), gold
        assert (flexible.correct, flexible.rule) == (True, "flexible"), gold
        start, end = answer_span(dataset, sentence)
        assert sentence[start:end] == gold
        if re.fullmatch(r"\d+", gold):
            assert grade(dataset, f"#### ${int(gold):,}", gold).correct


def test_numeric_errors_name_the_culprit() -> None:
    for generation in ["#### 40", "no number"]:
        with pytest.raises(ClozeMathError, match="'forty'"):
            grade("gsm8k", generation, "forty")
    with pytest.raises(ClozeMathError, match="unknown dataset 'svamp'"):
        grade("svamp", "#### 40", "40")


# --- MATH: extraction ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ("so $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{\\{1, \\sqrt{2}\\}}", "\\{1, \\sqrt{2}\\}"),
        ("\\fbox{7}", "7"),
        ("$\\boxed 5$", "5"),
        ("\\boxed{x} and later \\fbox{y}", "y"),
        ("\\boxed{unclosed {", None),
        ("no box", None),
    ],
)
def test_last_boxed_and_its_span(text: str, content: str | None) -> None:
    assert last_boxed(text) == content
    span = answer_span("math", text)
    assert (None if span is None else text[span[0] : span[1]]) == content


def test_minerva_final_answer_when_nothing_is_boxed() -> None:
    text = "So $x=3$.\nFinal Answer: The final answer is $\\dfrac{3}{4}$. I hope it is correct."
    graded = grade("math", text, "\\frac34")
    assert (graded.extracted, graded.correct, graded.rule) == ("\\dfrac{3}{4}", True, "final_answer")
    assert grade("math", "The answer is 3/4.", "\\frac34").rule == "none"
    dollars = grade("math", "Final Answer: The final answer is $\\$18.90$. I hope it is correct.", "18.90")
    assert (dollars.extracted, dollars.correct) == ("\\$18.90", True)  # an escaped dollar inside the answer
    assert grade("math", "Final Answer: The final answer is $3$ and $4$.", "3").extracted == "3"


@pytest.mark.parametrize("turn", ["\nQuestion: What is 3+4?\nAnswer: ", "\nProblem:\nWhat is 3+4?\n\nSolution: "])
def test_a_math_answer_is_the_first_turns_in_either_prompt_format(turn: str) -> None:
    """A trained model prompted `Question: ...\nAnswer:` that goes on with a problem of its own, or a base model in
    the Minerva format: the answer is the first turn's `\\boxed{}`, not the next problem's."""
    graded = grade("math", f"So $x = \\boxed{{5}}$.{turn}3 + 4 = \\boxed{{7}}", "5")
    assert (graded.extracted, graded.correct, graded.rule) == ("5", True, "boxed")


# --- MATH: equivalence on real golds ------------------------------------------------------------------------------


def _without_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Grade by math-verify alone: no two normalized strings compare equal."""
    monkeypatch.setattr(math_task, "normalize_math_answer", lambda answer: object())


def _without_math_verify(monkeypatch: pytest.MonkeyPatch) -> None:
    """Grade by the normalized-string fallback alone."""
    monkeypatch.setattr(math_task, "verify_latex", lambda gold, pred, timeout_s: False)


def _self_check_failures(golds: list[str], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    _without_fallback(monkeypatch)
    return [gold for gold in golds if not grade("math", f"So $\\boxed{{{gold}}}$.", gold).correct]


def test_sample_of_math_golds_is_correct_against_itself_by_math_verify(
    math_golds: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _self_check_failures(_sample(math_golds, 400), monkeypatch) == []


@pytest.mark.slow  # 10 s on an idle core, 35 s on a busy machine
def test_every_math_gold_is_correct_against_itself_by_math_verify(
    math_golds: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert len(math_golds) == 5000
    assert _self_check_failures(math_golds, monkeypatch) == []


def _terminating_decimal(value: Fraction) -> str | None:
    for digits in range(1, 7):
        if (value * 10**digits).denominator == 1:
            return f"{float(value):.{digits}f}"
    return None


def _reformats(gold: str) -> dict[str, str]:
    """Equivalent spellings of `gold` that apply to it, by kind."""
    variants = {}
    if "\\frac" in gold:
        variants["dfrac"] = gold.replace("\\frac", "\\dfrac")
    if "\\dfrac" in gold or "\\tfrac" in gold:
        variants["frac"] = re.sub(r"\\[dt]frac", r"\\frac", gold)
    if re.fullmatch(r"-?\d*\.\d+", gold):
        value = Fraction(gold)
        variants["decimal_to_frac"] = f"{'-' if value < 0 else ''}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"
    frac = re.fullmatch(r"(-?)\\[dt]?frac\{?(\d+)\}?\{?(\d+)\}?", gold)
    if frac and (decimal := _terminating_decimal(Fraction(int(frac[2]), int(frac[3])))):
        variants["frac_to_decimal"] = frac[1] + decimal
    spaced = re.sub(r"\s*(?<!\\)([-+=()])\s*", r" \1 ", gold).strip()
    spaced = re.sub(r"(?<!\\),(?!\d{3}(?!\d)|\\!|\})", ", ", spaced)  # not `\,`, `{,}`, `,\!` or `1,000`
    if spaced != gold:
        variants["spaces"] = spaced
    if re.fullmatch(r"-?\d+(\.\d+)?", gold):
        variants["unit"] = f"{gold}\\text{{ cm}}"
    unit = re.fullmatch(r"(.+?)\s*\\text\s*\{\s*[a-z ]+\}", gold)
    if unit:
        variants["unit_dropped"] = unit[1]
    return variants


@pytest.mark.parametrize("judge", ["both", "math_verify_only", "fallback_only"])
def test_math_golds_are_correct_against_reformatted_equivalents(
    math_golds: list[str], judge: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if judge == "math_verify_only":
        _without_fallback(monkeypatch)
    elif judge == "fallback_only":
        _without_math_verify(monkeypatch)
    by_kind: dict[str, list[tuple[str, str]]] = {}
    for gold in math_golds:
        for kind, variant in _reformats(gold).items():
            by_kind.setdefault(kind, []).append((gold, variant))
    assert set(by_kind) == {"dfrac", "frac", "decimal_to_frac", "frac_to_decimal", "spaces", "unit", "unit_dropped"}
    failures = []
    for kind, pairs in by_kind.items():
        if judge == "math_verify_only" and kind in MATH_VERIFY_BLIND_SPOTS:
            continue
        for gold, variant in random.Random(kind).sample(pairs, min(40, len(pairs))):
            if not grade("math", f"\\boxed{{{variant}}}", gold).correct:
                failures.append((kind, gold, variant))
    assert failures == []


def test_math_golds_are_wrong_against_other_problems_answers(math_golds: list[str]) -> None:
    rng = random.Random(1)
    pairs = []
    while len(pairs) < SAMPLE:
        gold, other = rng.sample(math_golds, 2)
        if normalize_math_answer(gold) != normalize_math_answer(other):
            pairs.append((gold, other))
    accepted = [(gold, other) for gold, other in pairs if grade("math", f"\\boxed{{{other}}}", gold).correct]
    assert accepted == []


@pytest.mark.parametrize(
    ("gold", "pred"),
    [
        ("\\frac{1}{2}", "\\frac{1}{3}"),
        ("\\text{Monday}", "\\text{Tuesday}"),
        ("(1,2)", "(2,1)"),
        ("x^2+1", "x^2-1"),
        ("\\text{(C)}", "\\text{(D)}"),
        ("10", "100"),
    ],
)
def test_math_mismatches(gold: str, pred: str) -> None:
    assert not grade("math", f"\\boxed{{{pred}}}", gold).correct


# --- MATH: pathological predictions -------------------------------------------------------------------------------

PATHOLOGICAL = {
    "power tower": "9^{9^{9^{9}}}",
    "huge power": "9^{9^{9}}",
    "deep nesting": "(" * 3000 + "1" + ")" * 3000,
    "deep fractions": "\\frac{1}{" * 400 + "2" + "}" * 400,
    "long number": "1" * 20000,
}
TIMEOUT_S = 1.0


def _timed_grade(pred: str) -> tuple[bool, float]:
    """Grade `pred` against `3` on a started worker (its start, a second or more, is not the check's time)."""
    assert grade("math", "\\boxed{1}", "1").correct
    start = time.monotonic()
    graded = grade("math", f"\\boxed{{{pred}}}", "3", timeout_s=TIMEOUT_S)
    return graded.correct, time.monotonic() - start


@pytest.mark.parametrize("name", PATHOLOGICAL)
def test_pathological_prediction_is_wrong_within_the_timeout(name: str) -> None:
    correct, seconds = _timed_grade(PATHOLOGICAL[name])
    assert not correct
    assert seconds < TIMEOUT_S + 1.0
    assert grade("math", "\\boxed{3}", "3").correct  # the pool still works, its killed worker replaced


def test_pathological_prediction_times_out_in_worker_threads() -> None:
    results: list[tuple[bool, float]] = []
    thread = threading.Thread(target=lambda: results.append(_timed_grade(PATHOLOGICAL["huge power"])))
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()
    (correct, seconds), = results
    assert not correct and seconds < TIMEOUT_S + 1.0


def test_concurrent_grading_from_a_thread_pool(math_golds: list[str]) -> None:
    pathological = [PATHOLOGICAL["huge power"], PATHOLOGICAL["deep nesting"]]
    golds = _sample(math_golds, 22, seed=2) + ["3"] * len(pathological)
    preds = golds[: -len(pathological)] + pathological
    with ThreadPoolExecutor(max_workers=3) as pool:
        graded = list(pool.map(lambda pair: grade("math", f"\\boxed{{{pair[1]}}}", pair[0], timeout_s=TIMEOUT_S),
                               zip(golds, preds)))
    assert [g.correct for g in graded] == [True] * (len(golds) - len(pathological)) + [False] * len(pathological)
