"""Split a solution into text and equation segments: the paper's y_1..y_m, with F the equation indices.

Segmentation is lossless: the segments' texts joined give back `clean_solution(...)` exactly. Whitespace always
belongs to text segments, so an equation starts and ends on a visible character. Each training set names its rule
(`clozemath.data.training_sets`):

GSM8K (`calculator_annotations`): one equation per `<<expr=result>>` calculator annotation, the arithmetic visible
around it: the expression left of it with its `=` and the result right of it (`48/2 = <<48/2=24>>24` gives
`48/2 = 24`), or the result alone where no expression is visible. Currency, percent signs, thousands commas and
unit words, abbreviated or hyphenated (`7 stickers/page * 6 pages= 42`, `640 sq. ft. - 80 sq. ft. = 560`), belong to
the equation; the `#### N` line is never one.

MATH (`latex_relations`): equations are the relation-bearing (`=`, `<`, `\\le`, `\\equiv`, ...) parts of LaTeX math
spans (`$..$`, `$$..$$`, `\\(..\\)`, `\\[..\\]`, `align`, `equation`, `eqnarray`); a span without a relation (`$x$`)
is text, and so are `[asy]` pictures and spans that never close. The delimiters stay in the text, so that masking
`$x = 5$` leaves `$<M_0>$`: the context still says "a formula stands here", and the model fills in only the formula.
Each relation-bearing row of a span of several rows (`\\\\`-separated lines of a display, an align environment, a
`cases`/`array`/`aligned` block) is an equation, while the separators and alignment context (`\\begin{aligned}`, a
row's leading `&`, its closing punctuation) are text. The rows form a group (simultaneous equations, one unit of F)
when each states an equation with its own left side, none opens with an implication and there are no more rows than
unknowns; otherwise (`&=` chains, `\\Rightarrow` rows, one equation rewritten row after row) they are steps, each an
equation of its own. A rows environment inside a relation (`f(x) = \\begin{cases}`) is part of one equation, and
matrix rows (`pmatrix`) never split.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from itertools import accumulate
from dataclasses import dataclass
from typing import Literal

from clozemath.data.training_sets import TRAINING_SETS, EquationRule
from clozemath.errors import ClozeMathError


@dataclass(frozen=True)
class Segment:
    kind: Literal["text", "equation"]
    text: str
    group: int | None = None
    """Equation segments sharing a group id (lines of one multi-line display or system) form one unit of F."""


@dataclass(frozen=True)
class _Span:
    """An equation's characters `[start, end)` in the clean solution."""

    start: int
    end: int
    group: int | None = None


def clean_solution(dataset: str, solution: str) -> str:
    """The solution a model sees: GSM8K without its `<<expr=result>>` calculator annotations; MATH unchanged."""
    return _ANNOTATION.sub("", solution) if _rule(dataset) == "calculator_annotations" else solution


def segment_solution(dataset: str, solution: str) -> list[Segment]:
    """Text and equation segments of a solution, in order; joined, they give `clean_solution(dataset, solution)`."""
    if _rule(dataset) == "calculator_annotations":
        clean, anchors = _strip_annotations(solution)
        return _segments(clean, _gsm8k_equations(clean, anchors))
    return _segments(solution, _math_equations(solution))


def without_final_answer(segments: list[Segment]) -> list[Segment]:
    """The segments without GSM8K's closing `#### N` line (and the line break before it): what an infilling sample
    shows, since its last equation is always masked and `#### N` would give that equation's result away."""
    if not segments or segments[-1].kind != "text":
        return list(segments)
    kept = _FINAL_ANSWER_LINE.sub("", segments[-1].text)
    return [*segments[:-1], *([Segment("text", kept)] if kept else [])]


def equation_units(segments: list[Segment]) -> list[list[int]]:
    """The units of F in order, as segment indices: an ungrouped equation alone, or all members of one group."""
    units: list[list[int]] = []
    unit_of_group: dict[int, list[int]] = {}
    for index, segment in enumerate(segments):
        if segment.kind != "equation":
            continue
        if segment.group is None:
            units.append([index])
        elif segment.group in unit_of_group:
            unit_of_group[segment.group].append(index)
        else:
            unit_of_group[segment.group] = [index]
            units.append(unit_of_group[segment.group])
    return units


def _rule(dataset: str) -> EquationRule:
    """The training set's segmentation rule (`clozemath.data.training_sets`)."""
    if dataset not in TRAINING_SETS:
        raise ClozeMathError(f"cannot segment dataset '{dataset}' (known: {', '.join(TRAINING_SETS)})")
    return TRAINING_SETS[dataset].equations


def _segments(text: str, spans: list[_Span]) -> list[Segment]:
    """Equation segments at `spans` (sorted, disjoint), text segments for the non-empty gaps between them."""
    segments: list[Segment] = []
    position = 0
    for span in spans:
        if span.start > position:
            segments.append(Segment("text", text[position : span.start]))
        segments.append(Segment("equation", text[span.start : span.end], span.group))
        position = span.end
    if position < len(text):
        segments.append(Segment("text", text[position:]))
    return segments


# ---------------------------------------------------------------------------------------------------------------
# GSM8K: `Natalia sold 48/2 = <<48/2=24>>24 clips` -> equation `48/2 = 24` (the annotation's place anchors it).

# GSM8K's final answer line, `#### 72`, with the line break before it.
_FINAL_ANSWER_LINE = re.compile(r"\s*####[^\n]*\s*\Z")
# A calculator annotation, `<<48/2=24>>`; annotations never nest nor hold `<` or `>`.
_ANNOTATION = re.compile(r"<<[^<>]*>>")
# A number as GSM8K writes it: `1,148`, `0.2`, `.5` (thousands commas only in groups of three).
_NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
# Currency signs; one directly before an annotation (`= $<<...>>10`) belongs to the result.
_CURRENCY = "$€£¢"
# The visible result right after an annotation: `24`, `-10`, `1,148`, `.4`, `95%`, `20€`.
_RESULT = re.compile(rf"-?(?:{_NUMBER})[%{_CURRENCY}]?")
# A unit word: letters, with inner periods, hyphens or ampersands and an abbreviation's closing period (`pages`,
# `sq.ft`, `ft.`, `lbs.`, `a.m.`, `time-outs`, `M&Ms`, `cm³`); a period before a capitalised word ends a sentence.
_UNIT = r"[A-Za-z][A-Za-z²³]*(?:[-.&][A-Za-z²³]+)*(?:\.(?![ \t]+[A-Z]))?"
# One operand of visible arithmetic: brackets, a sign, currency, then a number (`$1.25`, `20%`, `20€`, `56cm`, `2E`)
# or a one-letter variable (`x`, `E`; not a possessive's `s`), then unit words, per-unit words, named parts in
# brackets and closing brackets (`7 stickers/page`, `12 cookies / box`, `(5280 feet/1 mile)`, `6 pages`, `1
# (Carmela)`, `(50-40)mph`).
_OPERAND = (
    rf"(?:[(\[][ \t]*)*-?[{_CURRENCY}]?(?:(?:{_NUMBER})[%{_CURRENCY}]?(?:{_UNIT})?|(?<!['’])\b[A-Za-z]\b)"
    rf"(?:[ \t]+{_UNIT}|[ \t]*/[ \t]*{_UNIT}|[ \t]*\([A-Za-z][A-Za-z ]*\)|[ \t]*[)\]](?:{_UNIT})?)*"
)
# An operator between operands: + - * / ^, the dashes and signs people type, `x` for times, words (`3 times 60`),
# and `=` for chains (`x = 3*4 = 12`).
_OPERATOR = r"[ \t]*(?:[-+*/^=×÷–−]|[xX]|\b(?:plus|minus|times|divided by|multiplied by)\b)[ \t]*"
# Operands joined by operators, ending where the result starts, after its `=` (or `equals`) and any currency or
# percent sign written apart from the result (`=$ 100`, `= %95`).
_EQUALS = rf"[ \t]*(?:=|\bequals\b)[ \t]*[{_CURRENCY}%]*[ \t]*\Z"
# The expression left of an annotation; a leading operator is allowed only where the expression continues the
# previous equation on its line (`5+5=10+2=12`).
_EXPRESSION = re.compile(rf"{_OPERAND}(?:{_OPERATOR}{_OPERAND})*{_EQUALS}")
_CONTINUATION = re.compile(rf"(?:{_OPERATOR}{_OPERAND})+{_EQUALS}")


def _strip_annotations(solution: str) -> tuple[str, list[int]]:
    """The clean solution and, for each annotation in order, the clean offset where it stood."""
    pieces = _ANNOTATION.split(solution)
    return "".join(pieces), list(accumulate(len(piece) for piece in pieces[:-1]))


def _gsm8k_equations(clean: str, anchors: list[int]) -> list[_Span]:
    """One equation per annotation: the visible expression with its `=` (if any) and the result after it."""
    spans: list[_Span] = []
    floor = 0  # the previous equation's end: equations never overlap
    for anchor in anchors:
        result = _RESULT.match(clean, anchor)
        if result is None:  # nothing visible to mask (never so in GSM8K)
            continue
        start = anchor - 1 if anchor > floor and clean[anchor - 1] in _CURRENCY else anchor
        # searched back to the previous equation only (linear in the solution); not found there: the line began
        # before that equation, and 0 says so as well as its true start
        line_start = clean.rfind("\n", max(floor - 1, 0), start) + 1
        start = _expression_start(clean[max(floor, line_start) : start], start, continues=floor > line_start)
        spans.append(_Span(start, result.end()))
        floor = result.end()
    return spans


def _expression_start(before: str, result_start: int, continues: bool) -> int:
    """Where the expression in `before` (the line up to the result) begins; `result_start` if none is visible.

    `continues`: `before` starts right after the previous equation, so it may open with an operator, which then
    belongs to this equation (`+2=12` of `5+5=10+2=12`, not `2=12`).
    """
    match = (_CONTINUATION.match(before) if continues else None) or _EXPRESSION.search(before)
    return result_start - len(before) + match.start() if match else result_start


# ---------------------------------------------------------------------------------------------------------------
# MATH: `We have $x = 5$.` -> text `We have $`, equation `x = 5`, text `$.`

# Top-level math environments: their body is math, their `\begin`/`\end` are delimiters.
_MATH_ENVIRONMENTS = r"align|equation|eqnarray"
# Where text turns into math, or must be skipped whole: an Asymptote picture, a math environment, `$$`, `$`, `\[`,
# `\(`; or any other escaped pair (`\$`, `\\`), matched so that its second character opens nothing.
_OPENER = re.compile(rf"\[asy\]|\\begin\{{(?:{_MATH_ENVIRONMENTS})\*?\}}|\$\$|\$|\\\[|\\\(|\\.", re.S)
# The closing delimiter of each opener but environments (`\begin{align}` closes at `\end{align}`).
_CLOSERS = {"$": "$", "$$": "$$", "\\[": "\\]", "\\(": "\\)"}
# Inside math: an escaped pair (`\$`, `\}`, `\]`), a brace, or dollars; every closing delimiter is one of these.
_MATH_TOKEN = re.compile(r"\\.|[{}]|\$\$?", re.S)
# Nesting inside a math body: `\begin{..}`/`\end{..}` and braces; row separators `\\` (with an optional `[4pt]`
# and the `\hline`s after it) count only outside any nesting; other escaped pairs (`\{`) are skipped.
_NESTING_TOKEN = re.compile(r"\\begin\{[^{}]*\}|\\end\{[^{}]*\}|\\\\(?:\[[^\]]*\])?(?:\s*\\hline)*|\\.|[{}]", re.S)
# Environments whose rows are lines of equations (a system or derivation), with their column argument (`{rcl}`).
_ROWS_ENVIRONMENT = re.compile(
    r"\\begin\{(aligned|alignedat|align\*?|eqnarray\*?|gathered|split|cases|array)\}(?:\{[^{}]*\})?"
)
# A relation: `=`, `<`, `>`, or a relation command that is not the start of a longer one (`\le`, not `\left`).
_RELATION = re.compile(
    r"[=<>]|\\(?:le|leq|leqslant|ge|geq|geqslant|ne|neq|equiv|approx|lt|gt|cong|sim|simeq|doteq|propto)(?![A-Za-z])"
)
# A row that opens with an implication derives from the row before: `\Rightarrow x &= 2`.
_IMPLICATION = re.compile(r"\\(?:Rightarrow|Longrightarrow|implies|therefore|iff|Leftrightarrow|to)(?![A-Za-z])")
# LaTeX commands and `\text{...}` words, which name no unknown; and a one-letter symbol, which may.
_COMMAND = re.compile(r"\\(?:text|mbox|mathrm)\s*\{[^{}]*\}|\\[A-Za-z]+")
_SYMBOL = re.compile(r"(?<![A-Za-z])[A-Za-z](?![A-Za-z])")
# What a row may start with that is layout, not equation: spaces, alignment `&`, `\hline`.
_ROW_HEAD = re.compile(r"(?:\s|&|\\hline)*")
# What a row may end with that is punctuation or spacing, not equation: `.`, `,`, `\quad`, `\,`, `~`, `\nonumber`
# (but never the second character of a command: the `.` of `\right.` is the equation's).
_ROW_TAIL = re.compile(r"(?<!\\)(?<!\\right)(?<!\\left)(?:\s|[.,;:~&]|\\[,;:! ]|\\q?quad|\\nonumber)*\Z")


def _math_equations(solution: str) -> list[_Span]:
    """Equations of every math span in the solution, groups numbered from 0 in order."""
    spans: list[_Span] = []
    groups = 0
    for body_start, body_end in _math_bodies(solution):
        rows = _equation_rows(solution, body_start, body_end)
        group = groups if _is_system([solution[start:end] for start, end in rows]) else None
        groups += group is not None
        spans.extend(_Span(start, end, group) for start, end in rows)
    return spans


def _is_system(rows: list[str]) -> bool:
    """Whether the rows of one display are simultaneous equations (one unit of F) rather than a chain of steps.

    A system: every row states an equation with its own left side, no row opens with an implication, and there are
    no more rows than unknowns (one-letter symbols). Otherwise the rows are steps that follow from each other:
    `&= ...` continuations, `\\Rightarrow` rows, or one equation rewritten row after row (`2x+3 &= 7 \\\\ 2x &= 4`).
    """
    if len(rows) < 2 or not all(map(_has_own_left_side, rows)):
        return False
    unknowns = set(_SYMBOL.findall(_COMMAND.sub(" ", " ".join(rows))))
    return len(rows) <= len(unknowns)


def _has_own_left_side(row: str) -> bool:
    relation = _RELATION.search(row)
    left = row[: relation.start()] if relation else ""
    return not _IMPLICATION.match(row) and re.search(r"[0-9A-Za-z]", left) is not None


def _math_bodies(text: str) -> list[tuple[int, int]]:
    """`[start, end)` of the body of every closed math span, skipping `[asy]` pictures and escaped characters."""
    bodies: list[tuple[int, int]] = []
    position = 0
    while match := _OPENER.search(text, position):
        opener = match.group()
        position = match.end()
        if opener == "[asy]":
            end = text.find("[/asy]", position)
            position = len(text) if end < 0 else end + len("[/asy]")
        elif closer := _closer(opener):
            end = _closing(text, position, closer)
            if end is not None:
                bodies.append((position, end))
                position = end + len(closer)
    return bodies


def _closer(opener: str) -> str | None:
    """What closes a math span opened by `opener`; None for an escaped character (`\\$`), which opens nothing."""
    if opener.startswith("\\begin"):
        return opener.replace("\\begin", "\\end", 1)
    return _CLOSERS.get(opener)


def _closing(text: str, start: int, closer: str) -> int | None:
    """Where `closer` first stands at brace depth 0 from `start` (escaped `\\$` never closes); None if nowhere."""
    if closer.startswith("\\end"):
        end = text.find(closer, start)
        return None if end < 0 else end
    depth = 0
    for token in _MATH_TOKEN.finditer(text, start):
        value = token.group()
        if value == "{":
            depth += 1
        elif value == "}":
            depth -= 1
        elif depth <= 0 and (value == closer or (closer == "$" and value == "$$")):
            return token.start()
    return None


def _equation_rows(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """The relation-bearing rows of a math body, each trimmed of its layout and closing punctuation."""
    region_start, region_end = _rows_region(text, start, end)
    rows = []
    row_start = region_start
    for token, depth in _nesting(text, region_start, region_end):
        if depth == 0 and token.group().startswith("\\\\"):
            rows.append(_trim(text, row_start, token.start()))
            row_start = token.end()
    rows.append(_trim(text, row_start, region_end))
    return [(row_start, row_end) for row_start, row_end in rows if _has_relation(text[row_start:row_end])]


def _rows_region(text: str, start: int, end: int) -> tuple[int, int]:
    """Where the rows of a body lie: inside its rows environment (`\\[\\begin{aligned}...\\end{aligned}\\]`) when
    the rest of the body holds no relation, else the whole body (a piecewise `f(x) = \\begin{cases}` is one row)."""
    environment = _outer_rows_environment(text, start, end)
    if environment is None:
        return start, end
    begin, finish = environment
    if _has_relation(text[start : begin.start()] + text[finish.end() : end]):
        return start, end
    return begin.end(), finish.start()


def _outer_rows_environment(text: str, start: int, end: int) -> tuple[re.Match[str], re.Match[str]] | None:
    """The `\\begin{..}{args}` and `\\end{..}` of the first rows environment at nesting depth 0, if any."""
    begin: re.Match[str] | None = None
    for token, depth in _nesting(text, start, end):
        value = token.group()
        if begin is None and depth == 0 and value.startswith("\\begin"):
            begin = _ROWS_ENVIRONMENT.match(text, token.start(), end)
        elif begin is not None and depth == 0 and value.startswith("\\end"):
            return begin, token
    return None


def _nesting(text: str, start: int, end: int) -> Iterator[tuple[re.Match[str], int]]:
    """Each nesting token between `start` and `end` with the depth (braces and environments) it stands at."""
    depth = 0
    for token in _NESTING_TOKEN.finditer(text, start, end):
        value = token.group()
        if value.startswith("\\end") or value == "}":
            depth -= 1
        yield token, depth
        if value.startswith("\\begin") or value == "{":
            depth += 1


def _trim(text: str, start: int, end: int) -> tuple[int, int]:
    """`[start, end)` without leading layout (`&`, spaces) or trailing punctuation and spacing."""
    start = _ROW_HEAD.match(text, start, end).end()
    tail = _ROW_TAIL.search(text, start, end)
    return start, tail.start() if tail else end


def _has_relation(math: str) -> bool:
    """Whether `math` states a relation between things (`x = 5`), not just shows a symbol (`$<$`)."""
    return _RELATION.search(math) is not None and re.search(r"[0-9A-Za-z]", _RELATION.sub("", math)) is not None
