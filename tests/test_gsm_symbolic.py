"""GSM-Symbolic: every released template instantiates (read from $CLOZEMATH_DATA_DIR), the evaluator refuses
anything outside its whitelist, and the released P2 instances load."""

from __future__ import annotations

import json
import shutil
import time
from fractions import Fraction
from functools import cache
from pathlib import Path

import pytest

from clozemath_cli import main
from clozemath.data import gsm_symbolic
from clozemath.data.gsm_symbolic import sampler as gsm_sampler
from clozemath.data.gsm_symbolic import template as gsm_template
from clozemath.data.gsm_symbolic import values as gsm_values
from clozemath.data.gsm_symbolic import Template, generate, instances, load_template, templates_folder
from clozemath.data.sources import load_problems
from clozemath.errors import ClozeMathError

VARIANTS = ("symbolic", "p1", "p2")


@cache
def templates(variant: str) -> list[Template]:
    return gsm_symbolic.load_templates(variant)


def template_path(variant: str, name: str) -> Path:
    return templates_folder(variant) / f"{name}.json"


# --- the released templates ---------------------------------------------------------------------------------------


def test_the_template_folders_hold_the_released_counts() -> None:
    assert [len(templates(v)) for v in VARIANTS] == [100, 100, 50]


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_template_instantiates_with_its_conditions_and_answer(variant: str) -> None:
    for template in templates(variant):
        drawn = generate(template, 3, seed=11)
        assert [i.index for i in drawn] == [0, 1, 2]
        for instance in drawn:
            where = f"{variant}/{template.name}: {instance.question}"
            assert all(c.evaluate(instance.values) for c in template.conditions), where
            last_line = instance.answer.splitlines()[-1]
            assert last_line.startswith("####") and last_line[4:].strip() == instance.gold, where
            expected = Fraction(template.answer.evaluate(instance.values))
            assert abs(Fraction(instance.gold) - expected) <= Fraction(1, 10_000), where
            for text in (instance.question, instance.answer):
                assert not any(mark in text for mark in ("{", "}", "<<", ">>")), where


def test_worded_values_read_as_words_in_the_question_and_as_numbers_in_the_solution() -> None:
    template = load_template(template_path("symbolic", "0057"))  # {frac1,half} as many ... {mult1,three times}
    for instance in generate(template, 10, seed=3):
        frac, mult = instance.values["frac1"], instance.values["mult1"]
        assert f" {frac.words} as many" in instance.question and f" {mult.words} as many" in instance.question
        n1 = instance.values["n1"]
        assert f"{n1}*{frac.numerator}/{frac.denominator}=" in instance.answer.replace(" ", "")


def test_a_label_number_pair_shows_its_label() -> None:
    template = load_template(template_path("p1", "0002"))  # ("six-sided", 6), ("d20", 20), ...
    for instance in generate(template, 5, seed=0):
        sides = instance.values["sides"]
        assert f"a {sides.words} die" in instance.question
        assert f"/ {int(sides)} =" in instance.answer


def test_the_same_seed_gives_the_same_instances(tmp_path: Path) -> None:
    folder = tmp_path / "p1"
    folder.mkdir()
    for name in ("0000", "0016", "0040"):
        shutil.copy(template_path("p1", name), folder)
    first = instances("p1", 4, seed=21, templates_dir=tmp_path)
    assert first == instances("p1", 4, seed=21, templates_dir=tmp_path)
    assert first != instances("p1", 4, seed=22, templates_dir=tmp_path)
    assert [p.id for p in first[:5]] == ["gsm_p1-0000-0", "gsm_p1-0000-1", "gsm_p1-0000-2", "gsm_p1-0000-3",
                                         "gsm_p1-0016-0"]
    assert {(p.dataset, p.split) for p in first} == {("gsm_p1", "test")}
    assert all(p.solution.endswith(f"#### {p.answer}") for p in first)
    # A template's instances do not depend on which other templates are generated with it.
    alone = generate(load_template(folder / "0040.json"), 4, seed=21)
    assert [i.question for i in alone] == [p.question for p in first if p.id.startswith("gsm_p1-0040")]


def test_a_template_fix_makes_the_solution_and_answer_agree() -> None:
    template = load_template(template_path("p1", "0089"))  # P1 adds insurance; the released #answer forgets it
    assert template.answer.where.endswith("(fixed by clozemath)")
    for instance in generate(template, 5, seed=1):
        values = instance.values
        paid = values["first_hour_cost"] * (1 + (values["end_time"] - values["start_time"] - values["free_hours"]
                                                 - 1) * values["multiplier"])
        assert instance.gold == str(paid + values["extra"])


def test_every_template_fix_applies_to_a_released_template() -> None:
    for key, fix in gsm_template.TEMPLATE_FIXES.items():
        template = load_template(template_path(*key.split("/")))
        if fix.answer:
            assert template.answer.source == fix.answer and "(fixed by clozemath)" in template.answer.where, key
        if fix.condition:
            assert template.conditions[-1].source == fix.condition, key


# --- refusals -----------------------------------------------------------------------------------------------------

BASE = {
    "question_annotated": (
        "It takes {t,10} minutes to cover {d,3} miles. How long for {y,42} miles?\n\n"
        "#init:\n- $t = range(2, 50)\n- $d = range(2, 10)\n- $y = range(2, 100)\n\n"
        "#conditions:\n- is_int(y/d)\n\n"
        "#answer: y//d*t"
    ),
    "answer_annotated": (
        "{y}/{d} = <<{y}/{d}={y//d}>>{y//d} intervals.\n{y//d} * {t} = {y//d*t} minutes.\n#### {y//d*t}"
    ),
}


def write_template(tmp_path: Path, question: str | None = None, answer: str | None = None) -> Path:
    path = tmp_path / "symbolic" / "0000.json"
    path.parent.mkdir(exist_ok=True)
    data = {"question_annotated": question or BASE["question_annotated"],
            "answer_annotated": answer or BASE["answer_annotated"]}
    path.write_text(json.dumps(data))
    return path


def with_line(text: str, old: str, new: str) -> str:
    assert old in text
    return text.replace(old, new)


def test_the_base_template_is_fine(tmp_path: Path) -> None:
    instance = generate(load_template(write_template(tmp_path)), 1, seed=0)[0]
    assert instance.answer.endswith(f"#### {instance.gold}") and "<<" not in instance.answer


@pytest.mark.parametrize(
    ("old", "new", "line", "reason"),
    [
        ("- $t = range(2, 50)", "- $t = __import__('os')", 4, "'__import__', which is not an allowed function"),
        ("- is_int(y/d)", "- ().__class__", 9, "attribute access is not allowed"),
        ("- is_int(y/d)", "- ().__class__.__bases__[0].__subclasses__()", 9, "not an allowed function"),
        ("- $d = range(2, 10)", "- $d = np.random.__dict__", 5, "attribute access is not allowed"),
        ("- is_int(y/d)", "- is_int(y/e)", 9, "undefined name 'e'"),
        ("- $d = range(2, 10)", "- $d = range(2, y)", 5, "undefined name 'y'"),  # y is drawn later
        ("#answer: y//d*t", "#answer: (lambda: 1)()", 11, "not an allowed function"),
        ("#answer: y//d*t", "#answer: [t for t in range(3)]", 11, "a comprehension is not allowed"),
        ("#answer: y//d*t", "#answer: f'{t}'", 11, "an f-string is not allowed"),
        ("#answer: y//d*t", "#answer: sample(names, k=2)", 11, "keyword arguments"),
        ("- is_int(y/d)", "- is_int(y/d) if (x := 1) else 0", 9, "an assignment expression is not allowed"),
        ("- is_int(y/d)", "- 2 ** 10 ** 6 > t", 9, "power too large"),
        ("- is_int(y/d)", "- len(list(range(10 ** 12))) > t", 9, "more than"),
        ("- is_int(y/d)", "- t in range(10 ** 100)", 9, "more than"),
        ("- is_int(y/d)", "- t < 0", None, "can never hold"),
        ("- is_int(y/d)", "is_int(y/d)", 9, "expected a `- ...` line"),
    ],
)
def test_a_bad_question_annotated_is_refused_naming_the_file_and_line(
    tmp_path: Path, old: str, new: str, line: int | None, reason: str
) -> None:
    path = write_template(tmp_path, question=with_line(BASE["question_annotated"], old, new))
    with pytest.raises(ClozeMathError) as raised:
        generate(load_template(path), 2, seed=0)
    message = str(raised.value)
    assert message.startswith(str(path)) and reason in message
    if line is not None:
        assert f"question_annotated line {line}" in message


@pytest.mark.parametrize(
    ("new", "line", "reason"),
    [
        ("{t.real}", 2, "attribute access is not allowed"),
        ("{undefined}", 2, "undefined name 'undefined'"),
        ("{t ** 100000}", 2, "power too large"),  # refused when drawn, not only when constant
        ("{[t] * 10 ** 7}", 2, "more than"),
        ("{open('/etc/passwd')}", 2, "'open', which is not an allowed function"),
        ("{t", 2, "an unmatched brace"),
    ],
)
def test_a_bad_answer_annotated_is_refused_naming_the_file_and_line(
    tmp_path: Path, new: str, line: int, reason: str
) -> None:
    answer = with_line(BASE["answer_annotated"], "{y//d} * {t}", f"{{y//d}} * {new}")
    path = write_template(tmp_path, answer=answer)
    with pytest.raises(ClozeMathError) as raised:
        generate(load_template(path), 2, seed=0)
    message = str(raised.value)
    assert message.startswith(str(path)) and f"answer_annotated line {line}" in message and reason in message


@pytest.mark.parametrize(
    ("question", "answer", "reason"),
    [
        ("How long?\n#answer: 1", None, "no '#init:' section"),
        ("How long?\n#init:\n- $t = range(2, 5)", None, "no '#answer:' line"),
        (None, "{t} minutes.", "no '#### answer' line"),
        (None, "{y//d*t} minutes.\n#### {y//d*t + 1}", "differs from #answer"),
    ],
)
def test_an_unknown_format_is_refused(tmp_path: Path, question: str | None, answer: str | None, reason: str) -> None:
    path = write_template(tmp_path, question=question, answer=answer)
    with pytest.raises(ClozeMathError, match=reason) as raised:
        generate(load_template(path), 1, seed=0)
    assert str(raised.value).startswith(str(path))


def test_a_file_that_is_not_a_template_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "0000.json"
    path.write_text("[1, 2]")
    with pytest.raises(ClozeMathError, match="a template is a JSON object"):
        load_template(path)
    path.write_text("{not json")
    with pytest.raises(ClozeMathError, match="not a readable JSON template"):
        load_template(path)


def test_the_evaluator_computes_exactly(tmp_path: Path) -> None:
    template = load_template(write_template(tmp_path))
    expression = gsm_template._expression("int(0.1 * 3 * 10) + 7/2 + 2**-1 + round(2/3, 2)", [], "test")
    assert expression.evaluate({}) == Fraction(3) + Fraction(7, 2) + Fraction(1, 2) + Fraction(67, 100)
    assert template.answer.evaluate({"y": 42, "d": 3, "t": 10}) == 140
    with pytest.raises(ZeroDivisionError):
        template.answer.evaluate({"y": 42, "d": 0, "t": 10})


# --- files --------------------------------------------------------------------------------------------------------


def test_the_cli_writes_the_instances(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "templates" / "p2"
    folder.mkdir(parents=True)
    for name in ("0000", "0026"):
        shutil.copy(template_path("p2", name), folder)
    out = tmp_path / "out" / "p2.jsonl"
    argv = ["data", "gsm-symbolic", "--variant", "p2", "--per-template", "3", "--seed", "5", "--out", str(out),
            "--templates", str(tmp_path / "templates")]
    assert main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["template"], r["instance"]) for r in rows] == [("0000", k) for k in range(3)] + [
        ("0026", k) for k in range(3)
    ]
    assert [r["id"] for r in rows[:2]] == ["gsm_p2-0000-0", "gsm_p2-0000-1"]
    assert all(set(r) == {"id", "template", "instance", "question", "answer"} for r in rows)
    assert all("\n#### " in r["answer"] for r in rows)
    assert "wrote 6 instances of 2 templates" in capsys.readouterr().out
    assert main([*argv[:-1], str(tmp_path / "nowhere")]) == 2
    assert "no such templates folder" in capsys.readouterr().err


def test_the_released_p2_instances_load() -> None:
    problems = load_problems("gsm_p2", "test")
    assert len(problems) == 2500 and len({p.id for p in problems}) == 2500
    assert problems[0].id == "gsm_p2-0-0" and problems[0].answer == "32.5"
    assert all(p.dataset == "gsm_p2" and p.solution.endswith(f"#### {p.answer}") for p in problems)
    assert all(Fraction(p.answer) is not None for p in problems)


# --- bounds: memory, time, files ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("question", "answer"),
    [  # each power is allowed; their product, over MAX_NUMBER_BITS, is not
        (with_line(BASE["question_annotated"], "- is_int(y/d)", "- t * 7 ** 3000 * 7 ** 3000 * 7 ** 3000 > 0"), None),
        # an answer of 5,000 digits: over Python's limit of 4,300 on printing an integer (it ended in a traceback)
        (None, with_line(BASE["answer_annotated"], "#### {y//d*t}", "#### {t * 7 ** 3000 * 7 ** 3000}")),
    ],
)
def test_numbers_are_bounded_whatever_the_chain_of_operations(
    tmp_path: Path, question: str | None, answer: str | None
) -> None:
    path = write_template(tmp_path, question=question, answer=answer)
    with pytest.raises(ClozeMathError, match=f"a number of more than {gsm_values.MAX_NUMBER_BITS} bits") as raised:
        generate(load_template(path), 1, seed=0)
    assert str(raised.value).startswith(str(path)) and "\n" not in str(raised.value)


def test_costly_conditions_that_never_hold_end_at_the_time_limit(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(gsm_sampler, "TEMPLATE_SECONDS", 1.0)
    monkeypatch.setattr(gsm_sampler, "TEMPLATE_WORK", 10**12)  # the clock, not the work, ends it here
    never = "- len(list(range(t * 10000 + sample([0, 1])))) < t"  # drawn at random: never tabulated, never holds
    path = write_template(tmp_path, question=with_line(BASE["question_annotated"], "- is_int(y/d)", never))
    started = time.monotonic()
    with pytest.raises(ClozeMathError, match=r"past its budget of time \(1 s\) with 0 of 1 instances") as raised:
        generate(load_template(path), 1, seed=0)
    assert str(raised.value).startswith(str(path)) and time.monotonic() - started < 10


def test_a_failing_template_leaves_an_earlier_out_file_whole(tmp_path: Path, capsys) -> None:
    (tmp_path / "templates").mkdir()
    good = write_template(tmp_path / "templates")
    out = tmp_path / "symbolic.jsonl"
    argv = ["data", "gsm-symbolic", "--variant", "symbolic", "--per-template", "2", "--out", str(out),
            "--templates", str(tmp_path / "templates")]
    assert main(argv) == 0
    written = out.read_bytes()
    assert written.count(b"\n") == 2
    broken = with_line(BASE["answer_annotated"], "#### {y//d*t}", "#### {y//d*t + 1}")
    good.write_text(json.dumps({"question_annotated": BASE["question_annotated"], "answer_annotated": broken}))
    capsys.readouterr()
    assert main(argv) == 2
    assert "differs from #answer" in capsys.readouterr().err
    assert out.read_bytes() == written and sorted(p.name for p in tmp_path.iterdir()) == ["symbolic.jsonl", "templates"]
