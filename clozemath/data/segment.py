"""Split a solution into text and equation segments: the paper's y_1..y_m, with F the equation indices.

Segmentation is lossless: the segments' texts joined give back `clean_solution(...)` exactly. Whitespace always
belongs to text segments, so an equation starts and ends on a visible character.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from clozemath.errors import ClozeMathError

DATASETS = ("gsm8k", "math")


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
    _check_dataset(dataset)
    return _ANNOTATION.sub("", solution) if dataset == "gsm8k" else solution


def segment_solution(dataset: str, solution: str) -> list[Segment]:
    """Text and equation segments of a solution, in order; joined, they give `clean_solution(dataset, solution)`."""
    _check_dataset(dataset)
    if dataset == "gsm8k":
        clean, anchors = _strip_annotations(solution)
        return _segments(clean, _gsm8k_equations(clean, anchors))
    return _segments(solution, _math_equations(solution))


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


def _check_dataset(dataset: str) -> None:
    if dataset not in DATASETS:
        raise ClozeMathError(f"cannot segment dataset '{dataset}' (known: {', '.join(DATASETS)})")


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

# A calculator annotation, `<<48/2=24>>`; annotations never nest nor hold `<` or `>`.
_ANNOTATION = re.compile(r"<<[^<>]*>>")
# A number as GSM8K writes it: `1,148`, `0.2`, `.5` (thousands commas only in groups of three).
_NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
# Currency signs; one directly before an annotation (`= $<<...>>10`) belongs to the result.
_CURRENCY = "$€£¢"
# The visible result right after an annotation: `24`, `-10`, `1,148`, `.4`, `95%`, `20€`.
_RESULT = re.compile(rf"-?(?:{_NUMBER})[%{_CURRENCY}]?")
# One operand of visible arithmetic: brackets, a sign, currency, then a number (`$1.25`, `20%`, `20€`, `56cm`,
# `2E`) or a one-letter variable (`x`, `E`), then unit words and closing brackets (`7 stickers/page`, `(5280 feet/1
# mile)`, `6 pages`).
_OPERAND = (
    rf"(?:[(\[][ \t]*)*-?[{_CURRENCY}]?(?:(?:{_NUMBER})[%{_CURRENCY}]?[A-Za-z]*|\b[A-Za-z]\b)"
    r"(?:[ \t]+[A-Za-z]+|/[A-Za-z]+|[)\]])*"
)
# An operator between operands: + - * / ^, the dashes and signs people type, `x` for times, words (`3 times 60`),
# and `=` for chains (`x = 3*4 = 12`).
_OPERATOR = r"[ \t]*(?:[-+*/^=×÷–−]|[xX]|\b(?:plus|minus|times|divided by|multiplied by)\b)[ \t]*"
# Operands joined by operators, ending where the result starts, after its `=` (or `equals`).
_EQUALS = r"[ \t]*(?:=|\bequals\b)[ \t]*\Z"
# The expression left of an annotation; a leading operator is allowed only where the expression continues the
# previous equation on its line (`5+5=10+2=12`).
_EXPRESSION = re.compile(rf"{_OPERAND}(?:{_OPERATOR}{_OPERAND})*{_EQUALS}")
_CONTINUATION = re.compile(rf"(?:{_OPERATOR}{_OPERAND})+{_EQUALS}")


def _strip_annotations(solution: str) -> tuple[str, list[int]]:
    """The clean solution and, for each annotation in order, the clean offset where it stood."""
    pieces: list[str] = []
    anchors: list[int] = []
    position = length = 0
    for match in _ANNOTATION.finditer(solution):
        piece = solution[position : match.start()]
        pieces.append(piece)
        length += len(piece)
        anchors.append(length)
        position = match.end()
    pieces.append(solution[position:])
    return "".join(pieces), anchors


def _gsm8k_equations(clean: str, anchors: list[int]) -> list[_Span]:
    """One equation per annotation: the visible expression with its `=` (if any) and the result after it."""
    spans: list[_Span] = []
    floor = 0  # the previous equation's end: equations never overlap
    for anchor in anchors:
        result = _RESULT.match(clean, anchor)
        end = result.end() if result else anchor
        start = anchor - 1 if anchor > floor and clean[anchor - 1] in _CURRENCY else anchor
        line_start = clean.rfind("\n", 0, start) + 1
        start = _expression_start(clean[max(floor, line_start) : start], start, continues=floor > line_start)
        if end > start:
            spans.append(_Span(start, end))
            floor = end
    return spans


def _expression_start(before: str, result_start: int, continues: bool) -> int:
    """Where the expression in `before` (the line up to the result) begins; `result_start` if none is visible.

    `continues`: `before` starts right after the previous equation, so it may open with an operator.
    """
    match = _EXPRESSION.search(before) or (_CONTINUATION.match(before) if continues else None)
    return result_start - len(before) + match.start() if match else result_start


# ---------------------------------------------------------------------------------------------------------------
# MATH


def _math_equations(solution: str) -> list[_Span]:
    return []
