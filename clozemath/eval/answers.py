"""Answer extraction and grading.

GSM8K-like sets (gsm8k, gsm_symbolic, gsm_p1, gsm_p2): the number after `####` (rule `strict`), else the last number
of the generation (`flexible`), equal to the gold within 1e-4. MATH: the content of the last `\\boxed{}` (`boxed`;
else the Minerva few-shot format's `The final answer is $...$`, `final_answer`), equal to the gold by math-verify
(gold first, under a hard timeout) or, failing that, by the MATH paper's normalized string equality.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from fractions import Fraction

from clozemath.errors import ClozeMathError
from clozemath.eval.mathverify import verify_latex

NUMERIC_DATASETS = ("gsm8k", "gsm_symbolic", "gsm_p1", "gsm_p2")
DATASETS = (*NUMERIC_DATASETS, "math")
NUMERIC_TOLERANCE = 1e-4
MATH_VERIFY_TIMEOUT_S = 5.0

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Graded:
    extracted: str | None
    correct: bool
    rule: str  # how the answer was found: strict | flexible | boxed | final_answer | none


def grade(dataset: str, generation: str, gold: str, *, timeout_s: float = MATH_VERIFY_TIMEOUT_S) -> Graded:
    """Extract the answer of `generation` and compare it with `gold` (the dataset's gold answer string)."""
    found = _find_answer(dataset, generation)
    gold_number = None if dataset == "math" else _gold_number(gold)
    if found is None:
        return Graded(None, False, "none")
    (start, end), rule = found
    if gold_number is None:
        extracted = generation[start:end]
        return Graded(extracted, math_answers_equal(gold, extracted, timeout_s=timeout_s), rule)
    extracted = _clean_number(generation[start:end])
    return Graded(extracted, abs(float(extracted) - gold_number) <= NUMERIC_TOLERANCE, rule)


def answer_span(dataset: str, text: str) -> tuple[int, int] | None:
    """Character offsets `[start, end)` in `text` of the answer `grade` extracts (the number; the boxed content)."""
    found = _find_answer(dataset, text)
    return None if found is None else found[0]


def _find_answer(dataset: str, text: str) -> tuple[tuple[int, int], str] | None:
    if dataset == "math":
        return _math_answer(first_turn(dataset, text))
    if dataset in NUMERIC_DATASETS:
        return _numeric_answer(first_turn(dataset, text))
    raise ClozeMathError(f"unknown dataset '{dataset}' for grading (known: {', '.join(DATASETS)})")


def first_turn(dataset: str, text: str) -> str:
    """`text` up to where it starts a new turn of the prompt format (a line opening `Question:`, or `Problem:` for
    MATH): a model that does not stop after its answer goes on with a problem of its own, whose numbers are not its
    answer (the harness's stop sequences cut there too)."""
    marker = "\nProblem:" if dataset == "math" else "\nQuestion:"
    end = text.find(marker)
    return text if end < 0 else text[:end]


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


def _numeric_answer(text: str) -> tuple[tuple[int, int], str] | None:
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

_BOX_OPENERS = ("\\boxed", "\\fbox")
_BARE_BOX_ARGUMENT_RE = re.compile(r" +([^\s$]+)")
_MINERVA_RE = re.compile(r"final answer is\s*\$(?P<answer>[^\n]+?)\$", re.IGNORECASE)


def _boxed_span(text: str) -> tuple[int, int] | None:
    """Offsets of the content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`) in `text`."""
    start = max(text.rfind(opener) for opener in _BOX_OPENERS)
    if start < 0:
        return None
    opener = next(o for o in _BOX_OPENERS if text.startswith(o, start))
    i = start + len(opener)
    if text.startswith(" ", i):  # `\boxed 5`: the argument runs to the next `$` or space
        match = _BARE_BOX_ARGUMENT_RE.match(text, i)
        return match.span(1) if match else None
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return i + 1, j
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`) in `text`, nested braces handled."""
    span = _boxed_span(text)
    return None if span is None else text[span[0] : span[1]]


def _math_answer(text: str) -> tuple[tuple[int, int], str] | None:
    boxed = _boxed_span(text)
    if boxed is not None:
        return boxed, "boxed"
    last = None
    for last in _MINERVA_RE.finditer(text):
        pass
    return None if last is None else (last.span("answer"), "final_answer")


def math_answers_equal(gold: str, pred: str, *, timeout_s: float = MATH_VERIFY_TIMEOUT_S) -> bool:
    """math-verify's verdict (gold first), else the normalized strings' equality; a check past the timeout is
    logged and falls to the string comparison."""
    verdict = verify_latex(gold, pred, timeout_s)
    if verdict is None:
        logger.warning("math-verify ran past %.1f s on gold %.80r vs prediction %.80r", timeout_s, gold, pred)
    return bool(verdict) or normalize_math_answer(gold) == normalize_math_answer(pred)


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


def gsm8k_gold(solution: str) -> str:
    """The number after `####`, commas removed."""
    _, sep, tail = solution.rpartition("####")
    if not sep:
        raise ValueError("no '####' answer line")
    return tail.strip().replace(",", "")
