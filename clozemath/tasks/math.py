"""MATH (Hendrycks et al. 2021): competition problems with LaTeX answers; its test split as an evaluation set.

Answers: the content of the last `\\boxed{}` (rule `boxed`; else the Minerva few-shot format's `The final answer is
$...$`, `final_answer`) in the generation's first turn, equal to the gold by math-verify (gold first, under a hard
timeout: `clozemath.tasks.mathverify`) or, failing that, by the MATH paper's normalized string equality.

Base models: 4-shot in the Minerva format, as lm-evaluation-harness v0.4.12's `minerva_math_*` tasks (version 3.0)
prompt them: the four Minerva exemplars (Lewkowycz et al. 2022) in order (sampler `first_n`), as
`Problem:\\n{problem}\\n\\nSolution: {solution}`, each solution ending in `\\nFinal Answer: The final answer is
${answer}$. I hope it is correct.`, joined by "\\n\\n", then the test problem as `Problem:\\n{problem}\\n\\nSolution:`.
"""

from __future__ import annotations

import re
from fractions import Fraction

from clozemath.data.gold import boxed_span
from clozemath.data.sources import Problem
from clozemath.tasks.base import MATH_VERIFY_TIMEOUT_S, Found, Graded, StoredDataset, Task, first_turn
from clozemath.tasks.mathverify import verify_latex

NEXT_TURN = ("\nProblem:", "\nQuestion:")
"""Where a generation that goes on past its answer starts a problem of its own: the 4-shot Minerva format's, or the
trained models' `Question: ...\nAnswer:` (until 2026-12-05 only the first: a trained model's next turn was graded as
its answer)."""
MINERVA_MATH_STOP = ("Problem:",)


# --- answers: LaTeX ----------------------------------------------------------------------------------------------

_MINERVA_RE = re.compile(r"final answer is\s*\$(?P<answer>(?:\\\$|[^$\n])+)\$", re.IGNORECASE)
"""`The final answer is $...$`, an escaped `\\$` inside kept (`$\\$18.90$`)."""


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


def graded_latex(found: Found | None, generation: str, gold: str, timeout_s: float = MATH_VERIFY_TIMEOUT_S) -> Graded:
    """A LaTeX answer against a LaTeX gold: `math_answers_equal`."""
    if found is None:
        return Graded(None, False, "none")
    (start, end), rule = found
    extracted = generation[start:end]
    return Graded(extracted, math_answers_equal(gold, extracted, timeout_s=timeout_s), rule)


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


def find_answer(text: str) -> Found | None:
    return latex_answer(first_turn(text, NEXT_TURN))


def judge(found: Found | None, generation: str, gold: str, timeout_s: float) -> Graded:
    return graded_latex(found, generation, gold, timeout_s)


# --- the harness's 4-shot prompt ---------------------------------------------------------------------------------

# The Minerva MATH exemplars (problem, solution, final answer) as the harness v0.4.12 writes them, quirks kept: the
# first problem's double space and stray `}`, and the align rows ended by a single backslash (`480\` + newline).
MINERVA_EXEMPLARS: tuple[tuple[str, str, str], ...] = (
    (
        r"Find the domain of the expression  $\frac{\sqrt{x-2}}{\sqrt{5-x}}$.}",
        r"The expressions inside each square root must be non-negative. Therefore, $x-2 \ge 0$, so $x\ge2$, and "
        r"$5 - x \ge 0$, so $x \le 5$. Also, the denominator cannot be equal to zero, so $5-x>0$, which gives "
        r"$x<5$. Therefore, the domain of the expression is $\boxed{[2,5)}$.",
        r"[2,5)",
    ),
    (
        r"If $\det \mathbf{A} = 2$ and $\det \mathbf{B} = 12,$ then find $\det (\mathbf{A} \mathbf{B}).$",
        r"We have that $\det (\mathbf{A} \mathbf{B}) = (\det \mathbf{A})(\det \mathbf{B}) = (2)(12) = "
        r"\boxed{24}.$",
        r"24",
    ),
    (
        "Terrell usually lifts two 20-pound weights 12 times. If he uses two 15-pound weights instead, how many "
        "times must Terrell lift them in order to lift the same total weight?",
        "If Terrell lifts two 20-pound weights 12 times, he lifts a total of $2\\cdot 12\\cdot20=480$ pounds of "
        "weight.  If he lifts two 15-pound weights instead for $n$ times, he will lift a total of "
        "$2\\cdot15\\cdot n=30n$ pounds of weight.  Equating this to 480 pounds, we can solve for $n$:\n"
        "\\begin{align*}\n30n&=480\\\n\\Rightarrow\\qquad n&=480/30=\\boxed{16}\n\\end{align*}",
        "16",
    ),
    (
        "If the system of equations\n\n\\begin{align*}\n6x-4y&=a,\\\n6y-9x &=b.\n\\end{align*}has a solution "
        "$(x, y)$ where $x$ and $y$ are both nonzero,\nfind $\\frac{a}{b},$ assuming $b$ is nonzero.",
        "If we multiply the first equation by $-\\frac{3}{2}$, we obtain\n\n$$6y-9x=-\\frac{3}{2}a.$$Since we "
        "also know that $6y-9x=b$, we have\n\n$$-\\frac{3}{2}a=b\\Rightarrow\\frac{a}{b}=\\boxed{-\\frac{2}{3}}.$$",
        r"-\frac{2}{3}",
    ),
)


def minerva_math_few_shot(problem: str) -> str:
    blocks = [
        f"Problem:\n{question}\n\nSolution: {solution}\n"
        f"Final Answer: The final answer is ${answer}$. I hope it is correct."
        for question, solution, answer in MINERVA_EXEMPLARS
    ]
    return "\n\n".join([*blocks, f"Problem:\n{problem}\n\nSolution:"])


def few_shot_prompt(problem: Problem) -> str:
    return minerva_math_few_shot(problem.question)


_STORED = StoredDataset("math")

MATH = Task(
    name="math", title="MATH", problems=_STORED.problems, identity=_STORED.identity,
    find_answer=find_answer, judge=judge, answer_key=normalize_math_answer, few_shot_prompt=few_shot_prompt,
    stop=MINERVA_MATH_STOP,
)
