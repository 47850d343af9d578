"""Equation segmentation on the real GSM8K and MATH files (read from $CLOZEMATH_DATA_DIR)."""

from __future__ import annotations

import json
import re
import statistics
from functools import cache

import pytest

from clozemath_cli import main
from clozemath.data.segment import Segment, clean_solution, equation_units, segment_solution
from clozemath.data.sources import Problem, load_problems, local_file
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


def test_gsm8k_a_chain_on_one_line_gives_the_next_equation_its_operator() -> None:
    """`5+5=10+2=12`: the second equation is `+2=12`, its operator with it, not `2=12` after a text `+` (no GSM8K
    solution writes such a chain; the whole of GSM8K segments as before)."""
    segments = segment_solution("gsm8k", "He has 5+5=<<5+5=10>>10+2=<<10+2=12>>12 apples.\n#### 12")
    assert kinds_and_texts(segments) == [("text", "He has"), ("equation", "5+5=10"), ("equation", "+2=12"),
                                         ("text", "apples.\n#### 12")]


def test_gsm8k_units_with_periods_hyphens_and_per_words_keep_their_expression() -> None:
    solution = (
        "The walls are 640 sq. ft. - 80 sq. ft. = <<640-80=560>>560 sq. ft.\n"
        "She needs 3 lbs. coffee * 40 cups of coffee per lb. = <<3*40=120>>120 cups.\n"
        "He did 3 sets * 15 push-ups/set = <<3*15=45>>45 push-ups and ate 8 M&Ms + 10 M&Ms = <<8+10=18>>18.\n"
        "That is 15 gallons * 8 pints / gallon = <<15*8=120>>120 pints for 1 (Carmela) + 4 (cousins) = <<1+4=5>>5.\n"
        "They raised 324 x 2 = $ <<324*2=648>>648 and 18 / ( 2 / 3 ) = <<18/(2/3)=27>>27.\n"
        "S is given by distance / time. Hence S = 280 miles / 140 minutes = <<280/140=2>>2 miles per minute.\n"
        "Joanna has $<<8=8>>8.\n#### 8"
    )
    assert [s.text for s in equations(segment_solution("gsm8k", solution))] == [
        "640 sq. ft. - 80 sq. ft. = 560",
        "3 lbs. coffee * 40 cups of coffee per lb. = 120",
        "3 sets * 15 push-ups/set = 45",
        "8 M&Ms + 10 M&Ms = 18",
        "15 gallons * 8 pints / gallon = 120",
        "1 (Carmela) + 4 (cousins) = 5",
        "324 x 2 = $ 648",
        "18 / ( 2 / 3 ) = 27",
        "S = 280 miles / 140 minutes = 2",  # a sentence's closing period is no abbreviation
        "$8",  # nothing computed, nothing written before it
    ]


def test_gsm8k_a_possessives_s_is_no_variable() -> None:
    """`Her sister's height = 80cm/2 = 40` masks the arithmetic, not `s height = ...` from inside the word (19 GSM8K
    train equations did, 2026-12-05); a one-letter variable after the possessive still opens the equation."""
    solution = (
        "Her sister's height = 80cm/2 = <<80/2=40>>40 cm.\nBrian’s in-laws = 1+1= <<1+1=2>>2.\n"
        "Jane's age is J = 42 / 2 = <<42/2=21>>21.\n#### 21"
    )
    assert [s.text for s in equations(segment_solution("gsm8k", solution))] == [
        "80cm/2 = 40", "1+1= 2", "J = 42 / 2 = 21"]
    after_apostrophe = [
        (problem.id, segment.text) for problem, segments in zip(problems("gsm8k", "train"), segmented("gsm8k", "train"))
        for before, segment in zip(segments, segments[1:])
        if segment.kind == "equation" and before.text.endswith(("'", "’")) and segment.text[:1].isalpha()]
    assert after_apostrophe == []


def test_gsm8k_few_train_equations_are_only_a_number() -> None:
    """Measured: 161 of 23,716 before unit abbreviations, hyphenated and per-unit words were read; 108 after, 70 of
    them annotations that compute nothing (`<<8=8>>8`), the rest prose (`half of 4 is 2`, `or 140`); 116 once a
    possessive's `s` no longer opened an equation (`the neighbor’s water balloons = 5` masks `5`)."""
    number = re.compile(r"-?[$€£¢]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?[%$€£¢]?")
    train = [segment.text for segments in segmented("gsm8k", "train") for segment in equations(segments)]
    only_a_number = sum(bool(number.fullmatch(text)) for text in train)
    assert only_a_number <= 118


def test_unknown_dataset_is_a_one_line_error() -> None:
    with pytest.raises(ClozeMathError, match="gsm_p2"):
        segment_solution("gsm_p2", "1 + 1 = 2\n#### 2")


# --- MATH ----------------------------------------------------------------------------------------------------------


def math_row(split: str, contains: str) -> list[Segment]:
    """The segments of the one MATH solution of `split` that contains `contains`."""
    matches = [i for i, p in enumerate(problems("math", split)) if contains in p.solution]
    assert len(matches) == 1, (contains, matches)
    return segmented("math", split)[matches[0]]


def groups_of(segments: list[Segment]) -> list[list[str]]:
    members: dict[int, list[str]] = {}
    for segment in equations(segments):
        if segment.group is not None:
            members.setdefault(segment.group, []).append(segment.text)
    return list(members.values())


@pytest.mark.parametrize("split", SPLITS)
def test_math_lossless(split: str) -> None:
    for problem, segments in zip(problems("math", split), segmented("math", split), strict=True):
        assert "".join(s.text for s in segments) == clean_solution("math", problem.solution)


@pytest.mark.parametrize("split", SPLITS)
def test_math_most_solutions_have_equations(split: str) -> None:
    share = sum(bool(equations(segments)) for segments in segmented("math", split)) / len(problems("math", split))
    assert share > 0.9  # measured: 94.6% of train, 94.5% of test


def test_math_system_in_cases_is_one_group() -> None:
    segments = math_row("train", "Addison's age, $B = $ Brenda's age")
    assert groups_of(segments) == [["A=3B", "J = B+6", "A=J"]]
    first = next(i for i, s in enumerate(segments) if s.text == "A=3B")
    assert segments[first - 1].text.endswith("$$\\begin{cases}\n") and segments[first - 1].kind == "text"
    assert segments[first + 1] == Segment("text", " \\\\\n")


def test_math_backslash_lines_of_a_display_are_one_group() -> None:
    segments = math_row("train", "$$k = 17a+1\\\\k = 6b+1")
    assert groups_of(segments) == [["k = 17a+1", "k = 6b+1", "k = 2c + 1"]]


def test_math_align_derivation_is_a_sequence_of_separate_equations() -> None:
    """One equation rewritten row after row (5 rows, one unknown) is a chain of steps, not a system."""
    segments = math_row("train", "Since the line passes through $(4,-8)$")
    derivation = ["a(4)+(a+1)(-8)&=a+2", "4a-8a-8&=a+2", "-4a-8&=a+2", "-10&=5a", "-2&=a"]
    assert groups_of(segments) == []
    units = equation_units(segments)
    assert [segments[unit[0]].text for unit in units if segments[unit[0]].text in derivation] == derivation
    assert all(len(unit) == 1 for unit in units)


@pytest.mark.parametrize(
    ("display", "grouped"),
    [
        ("\\begin{align*}\nx + y &= 10,\\\\\nx - y &= 2.\n\\end{align*}", True),  # a system: own left sides
        ("$$\\begin{cases} a+b=5 \\\\ b+c=7 \\\\ a+c=6 \\end{cases}$$", True),
        ("\\begin{align*}\n(x+1)^2 &= x^2 + 2x + 1\\\\\n&= 2x + 5 + x^2 - 4.\n\\end{align*}", False),  # `&=` chain
        ("\\begin{align*}\n30n&=480\\\\\n\\Rightarrow\\qquad n&=16\n\\end{align*}", False),  # an implication
        ("\\begin{align*}\n2x+3 &= 7\\\\\n2x &= 4\\\\\nx &= 2\n\\end{align*}", False),  # 3 rows, 1 unknown
    ],
    ids=["align-system", "cases", "chain", "implication", "rewritten"],
)
def test_math_simultaneous_equations_are_a_group_and_steps_are_not(display: str, grouped: bool) -> None:
    segments = segment_solution("math", f"We solve\n{display}\nand so on.")
    rows = equations(segments)
    assert len(rows) >= 2
    assert [len(unit) for unit in equation_units(segments)] == ([len(rows)] if grouped else [1] * len(rows))


def test_math_piecewise_definition_and_matrices_are_single_equations() -> None:
    piecewise = math_row("train", "$$q(x) = -|x| = \\begin{cases}")
    assert groups_of(piecewise) == []
    assert equations(piecewise)[0].text.startswith("q(x) = -|x| = \\begin{cases}x &\\text{if }x\\le 0\\\\")
    matrices = math_row("train", "We see that\n\\[\\bold{A}^2 = \\begin{pmatrix}")
    assert equations(matrices)[0].text.startswith("\\bold{A}^2 = \\begin{pmatrix} 0 & 1 & 2 \\\\ 1 & 0 & 1")
    # Four equations in three unknowns read as steps (more rows than unknowns): the known limit of the system rule.
    assert groups_of(matrices) == []
    assert "2p + q &= -6" in [s.text for s in equations(matrices)]


@pytest.mark.parametrize("split", SPLITS)
def test_math_asy_blocks_and_bare_symbols_are_text(split: str) -> None:
    for problem, segments in zip(problems("math", split), segmented("math", split), strict=True):
        asy = [m.span() for m in re.finditer(r"\[asy\].*?(?:\[/asy\]|\Z)", problem.solution, re.S)]
        position = 0
        for segment in segments:
            end = position + len(segment.text)
            if segment.kind == "equation":
                assert not any(start < end and position < stop for start, stop in asy), segment.text
                assert re.search(r"[=<>]|\\(le|ge|ne|equiv|approx|lt|gt|cong|sim)", segment.text), segment.text
                assert segment.text == segment.text.strip()
            position = end


def test_math_delimiters_stay_in_the_text() -> None:
    segments = segment_solution("math", "Let $x$ be such that $x = 2,$ so \\(y < 3\\) and $\\boxed{5}$.")
    assert kinds_and_texts(segments) == [
        ("text", "Let $x$ be such that $"),
        ("equation", "x = 2"),
        ("text", ",$ so \\("),
        ("equation", "y < 3"),
        ("text", "\\) and $\\boxed{5}$."),
    ]


def test_math_escaped_dollars_nested_text_and_unbalanced_spans() -> None:
    assert [s.text for s in equations(segment_solution("math", "It costs \\$5, so $y = \\$5$."))] == ["y = \\$5"]
    nested = "$f(x) = 1 \\text{ if $x > 0$}$ and $y$"
    assert [s.text for s in equations(segment_solution("math", nested))] == ["f(x) = 1 \\text{ if $x > 0$}"]
    for broken in ("so $x = 1", "\\[x = 1", "\\begin{align*} a &= b \\\\ c &= d", "[asy] label(\"$x=1$\");"):
        assert segment_solution("math", broken) == [Segment("text", broken)]


# --- clozemath data stats ------------------------------------------------------------------------------------------


def run_stats(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["data", "stats", *args]) == 0
    return capsys.readouterr().out


def test_stats_gsm8k_train_json(capsys: pytest.CaptureFixture[str]) -> None:
    stats = json.loads(run_stats(capsys, "--dataset", "gsm8k", "--split", "train", "--json"))
    per_solution = [p.solution.count("<<") for p in problems("gsm8k", "train")]
    assert stats["problems"] == 7473
    assert stats["equations"] == {
        "total": 23_716,
        "mean": round(23_716 / 7473, 3),
        "median": statistics.median(per_solution),
        "max": max(per_solution),
    }
    assert stats["solutions_without_equations"] == 95
    assert stats["groups"] == {"count": 0, "equations": 0}
    assert stats["units"]["total"] == 23_716


def test_stats_math_test_from_a_path(capsys: pytest.CaptureFixture[str]) -> None:
    path = local_file("math", "test")
    assert path is not None
    stats = json.loads(run_stats(capsys, "--dataset", "math", "--split", "test", "--path", str(path), "--json"))
    found = [equations(segments) for segments in segmented("math", "test")]
    grouped = [s for found_here in found for s in found_here if s.group is not None]
    groups = sum(len({s.group for s in found_here if s.group is not None}) for found_here in found)
    assert stats["problems"] == 5000
    assert stats["equations"]["total"] == sum(map(len, found))
    assert stats["solutions_without_equations"] == sum(not f for f in found)
    assert stats["groups"] == {"count": groups, "equations": len(grouped)} and groups > 0
    assert stats["units"]["total"] == sum(map(len, found)) - len(grouped) + groups


def test_stats_table(capsys: pytest.CaptureFixture[str]) -> None:
    table = run_stats(capsys, "--dataset", "gsm8k", "--split", "test")
    assert re.search(r"^problems +1319$", table, re.M)
    assert re.search(r"^equations total +\d+$", table, re.M)
    assert re.search(r"^solutions without equations +\d+$", table, re.M)
