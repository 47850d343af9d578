"""Equation segmentation on the real GSM8K and MATH files (read from $CLOZEMATH_DATA_DIR)."""

from __future__ import annotations

import re
from functools import cache

import pytest

from clozemath.data.segment import Segment, clean_solution, equation_units, segment_solution
from clozemath.data.sources import Problem, load_problems
from clozemath.errors import ClozeMathError

SPLITS = ("train", "test")


@cache
def problems(dataset: str, split: str) -> list[Problem]:
    return load_problems(dataset, split)


@cache
def segmented(dataset: str, split: str) -> list[list[Segment]]:
    return [segment_solution(dataset, p.solution) for p in problems(dataset, split)]


def equations(segments: list[Segment]) -> list[Segment]:
    return [s for s in segments if s.kind == "equation"]


def kinds_and_texts(segments: list[Segment]) -> list[tuple[str, str]]:
    return [(s.kind, s.text.strip()) for s in segments]


# --- GSM8K ---------------------------------------------------------------------------------------------------------


def test_natalia() -> None:
    natalia = problems("gsm8k", "train")[0]
    assert natalia.question.startswith("Natalia sold clips")
    segments = segment_solution("gsm8k", natalia.solution)
    assert kinds_and_texts(segments)[:4] == [
        ("text", "Natalia sold"),
        ("equation", "48/2 = 24"),
        ("text", "clips in May.\nNatalia sold"),
        ("equation", "48+24 = 72"),
    ]
    assert [s.kind for s in segments[4:]] == ["text"]
    assert segments[-1].text.endswith("#### 72")
    assert equation_units(segments) == [[1], [3]]


def test_clean_solution_drops_annotations_only() -> None:
    natalia = problems("gsm8k", "train")[0].solution
    assert clean_solution("gsm8k", natalia) == (
        "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether in April and May.\n#### 72"
    )
    latex = "$x = \\frac{1}{2}$ and <<not an annotation>>"
    assert clean_solution("math", latex) == latex


@pytest.mark.parametrize("split", SPLITS)
def test_gsm8k_one_equation_per_annotation(split: str) -> None:
    annotations = [p.solution.count("<<") for p in problems("gsm8k", split)]
    found = [len(equations(segments)) for segments in segmented("gsm8k", split)]
    assert found == annotations
    if split == "train":
        assert sum(found) == 23_716
        assert found.count(0) == 95


@pytest.mark.parametrize("split", SPLITS)
def test_gsm8k_equations_are_visible_arithmetic(split: str) -> None:
    """Each equation ends in its result, sits on one line, never on the `#### N` line, no whitespace at its edges."""
    with_expression = total = 0
    for segments in segmented("gsm8k", split):
        for segment in equations(segments):
            total += 1
            with_expression += "=" in segment.text
            assert segment.text == segment.text.strip() and "\n" not in segment.text
            assert re.search(r"\d%?[$€£¢]?$", segment.text), segment.text
            assert "####" not in segment.text
        assert segments[-1].kind == "text" and "####" in segments[-1].text
    assert with_expression / total > 0.98


@pytest.mark.parametrize("split", SPLITS)
def test_gsm8k_lossless(split: str) -> None:
    for problem, segments in zip(problems("gsm8k", split), segmented("gsm8k", split), strict=True):
        assert "".join(s.text for s in segments) == clean_solution("gsm8k", problem.solution)


def test_gsm8k_money_units_percent_and_times() -> None:
    solution = (
        "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\n"
        "So 7 stickers/page * 6 pages= <<7*6=42>>42 stickers, 0.2 x 50 = $<<0.2*50=10>>10, "
        "1,040 / 4 = <<1040/4=260>>260 and 20% of 50 is <<10=10>>10%.\n#### 10"
    )
    assert [s.text for s in equations(segment_solution("gsm8k", solution))] == [
        "12/60 = $0.2",
        "7 stickers/page * 6 pages= 42",
        "0.2 x 50 = $10",
        "1,040 / 4 = 260",
        "10%",
    ]


def test_unknown_dataset_is_a_one_line_error() -> None:
    with pytest.raises(ClozeMathError, match="gsm_p2"):
        segment_solution("gsm_p2", "1 + 1 = 2\n#### 2")
