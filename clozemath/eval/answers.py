"""Answer extraction and grading rules, for any dataset; each dataset picks its own (`clozemath.tasks`).

Numeric answers (GSM8K-like sets): the number after `####` (rule `strict`), else the last number of the generation
(`flexible`, the fallback), equal to the gold within `NUMERIC_TOLERANCE`. LaTeX answers (MATH): the content of the last
`\\boxed{}` (`boxed`; else the Minerva few-shot format's `The final answer is $...$`, `final_answer`), equal to the
gold by math-verify (gold first, under a hard timeout) or, failing that, by the MATH paper's normalized string
equality.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from clozemath.data.gold import NUMERIC_TOLERANCE, boxed_span
from clozemath.errors import ClozeMathError
from clozemath.eval.mathverify import verify_latex

MATH_VERIFY_TIMEOUT_S = 5.0

Found = tuple[tuple[int, int], str]
"""Where an answer is in a generation (character offsets `[start, end)`) and the rule that found it."""


MARKED_RULES = frozenset({"strict", "boxed", "final_answer"})
"""The rules that read the answer where the solution format marks it (`####`, `\\boxed{}`, Minerva's final-answer
line); the other, `flexible` (the last number), is a fallback for generations that never mark one. Strict accuracy
counts only answers found by these."""
FALLBACK_RULE = "flexible"


@dataclass(frozen=True)
class Graded:
    extracted: str | None
    correct: bool
    rule: str  # how the answer was found: strict | flexible | boxed | final_answer | none


def first_turn(text: str, marker: str) -> str:
    """`text` up to where it starts a new turn of the prompt format (a line opening with `marker`, such as
    `\nQuestion:`): a model that does not stop after its answer goes on with a problem of its own, whose numbers are
    not its answer (the harness's stop sequences cut there too)."""
    end = text.find(marker)
    return text if end < 0 else text[:end]


def graded_number(found: Found | None, generation: str, gold: str) -> Graded:
    """A numeric answer against a numeric gold: equal within `NUMERIC_TOLERANCE` (a gold that is no number is an
    error, found answer or not)."""
    gold_number = _gold_number(gold)
    if found is None:
        return Graded(None, False, "none")
    (start, end), rule = found
    extracted = _clean_number(generation[start:end])
    return Graded(extracted, abs(float(extracted) - gold_number) <= NUMERIC_TOLERANCE, rule)


def graded_latex(found: Found | None, generation: str, gold: str, timeout_s: float = MATH_VERIFY_TIMEOUT_S) -> Graded:
    """A LaTeX answer against a LaTeX gold: `math_answers_equal`."""
    if found is None:
        return Graded(None, False, "none")
    (start, end), rule = found
    extracted = generation[start:end]
    return Graded(extracted, math_answers_equal(gold, extracted, timeout_s=timeout_s), rule)


def number_key(text: str) -> str:
    """The key under which CoT-decoding sums the confidence of equal numeric answers (`1,000` = `1000.0`)."""
    cleaned = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        return str(Fraction(cleaned))
    except (ValueError, ZeroDivisionError):
        return cleaned


# --- GSM8K-like: numbers -----------------------------------------------------------------------------------------

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
    """The number after `####` (`strict`), else the last number (`flexible`)."""
    strict = _STRICT_RE.search(text)
    if strict:
        return strict.span(1), "strict"
    last = None
    for last in _NUMBER_RE.finditer(text):
        pass
    return None if last is None else (last.span(), "flexible")


def _clean_number(text: str) -> str:
    return text.replace(",", "").replace("$", "").replace("\u2212", "-").rstrip(".")


def _gold_number(gold: str) -> float:
    try:
        return float(_clean_number(gold.strip()))
    except ValueError:
        raise ClozeMathError(f"gold answer '{gold}' is not a number") from None


# --- MATH: LaTeX answers -----------------------------------------------------------------------------------------

_MINERVA_RE = re.compile(r"final answer is\s*\$(?P<answer>[^\n]+?)\$", re.IGNORECASE)


def latex_answer(text: str) -> Found | None:
    """The last `\\boxed{}`'s content (`boxed`), else the Minerva format's `The final answer is $...$`
    (`final_answer`)."""
    boxed = boxed_span(text)
    if boxed is not None:
        return boxed, "boxed"
    last = None
    for last in _MINERVA_RE.finditer(text):
        pass
    return None if last is None else (last.span("answer"), "final_answer")


def math_answers_equal(gold: str, pred: str, *, timeout_s: float = MATH_VERIFY_TIMEOUT_S) -> bool:
    """math-verify's verdict (gold first), else the normalized strings' equality; a check past the timeout
    (`verify_latex` logs or counts it) falls to the string comparison."""
    return bool(verify_latex(gold, pred, timeout_s)) or normalize_math_answer(gold) == normalize_math_answer(pred)


# The normalization of the MATH paper's `is_equiv` (Hendrycks et al. 2021), written afresh.
_SPACING_RE = re.compile(r"(?<!\\)\\[!,;: ]|\\q?quad\b")  # not the `\\` of a matrix row break
_LEFT_RIGHT_RE = re.compile(r"\\(?:left|right)(?![a-zA-Z])")
_DEGREES_RE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?")
_TEXT_RE = re.compile(r"\\(?:text|textbf|textit|mbox|mathrm)\s*\{([^{}]*)\}")
_TRAILING_UNIT_RE = re.compile(r"\\(?:text|mbox|mathrm)\s*\{\s*[A-Za-z][A-Za-z .]*\}(?:\^\s*\{?\d\}?)?\s*$")
_VARIABLE_PREFIX_RE = re.compile(r"^[A-Za-z]\w?\s*=\s*")
_SQRT_RE = re.compile(r"\\sqrt(\w)")
_FRAC_RE = re.compile(r"\\frac(\d|\{[^{}]*\})(\d|\{[^{}]*\})")
_DECIMAL_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d*)(?:\.\d+)?")
_MAX_NUMBER_DIGITS = 1000  # Python refuses to convert much longer digit strings to int
_INT_RATIO_RE = re.compile(r"(-?\d+)/(\d+)")


def normalize_math_answer(answer: str) -> str:
    """A canonical string for a MATH answer: spacing, `\\left`/`\\right`, degrees, `\\$`, `%`, trailing
    `\\text{}` units and a leading `x =` dropped; `\\dfrac`/`\\tfrac` -> `\\frac` with braced arguments;
    `\\sqrt3` -> `\\sqrt{3}`; decimals and `a/b` -> `\\frac{a}{b}`; spaces removed."""
    s = _SPACING_RE.sub(" ", answer.replace("\n", ""))
    s = re.sub(r"\\[dtc]frac", r"\\frac", s)
    s = _LEFT_RIGHT_RE.sub("", s)
    s = _DEGREES_RE.sub("", s)
    s = s.replace("\\$", "").replace("\\%", "").replace("%", "").replace("{,}", ",")
    without_unit = _TRAILING_UNIT_RE.sub("", s).strip()
    s = without_unit or s
    s = _TEXT_RE.sub(r"\1", s)
    if s.count("=") == 1:
        s = _VARIABLE_PREFIX_RE.sub("", s.strip())
    s = s.replace(" ", "").rstrip(".")
    s = _SQRT_RE.sub(r"\\sqrt{\1}", s)
    s = _FRAC_RE.sub(lambda m: f"\\frac{{{m[1].strip('{}')}}}{{{m[2].strip('{}')}}}", s)
    return _canonical_number(s)


def _canonical_number(s: str) -> str:
    """`0.5` -> `\\frac{1}{2}`, `2.0` -> `2`, `1,000` -> `1000`, `3/4` -> `\\frac{3}{4}`; anything else unchanged."""
    if _DECIMAL_RE.fullmatch(s) and any(c.isdigit() for c in s) and len(s) <= _MAX_NUMBER_DIGITS:
        value = Fraction(s.replace(",", ""))
        if value.denominator == 1:
            return str(value.numerator)
        sign = "-" if value < 0 else ""
        return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"
    ratio = _INT_RATIO_RE.fullmatch(s)
    return f"\\frac{{{ratio[1]}}}{{{ratio[2]}}}" if ratio else s
