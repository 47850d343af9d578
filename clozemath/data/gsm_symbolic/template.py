"""Templates: a JSON file read into expressions (its `#init`, `#conditions`, `#answer`) and question and
solution texts with placeholders; the fixes of the released templates that break their own answer."""

from __future__ import annotations

import ast
import json
import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clozemath.data.gsm_symbolic.compiler import Run, _Compiler, _Scope, _dotted_name
from clozemath.data.gsm_symbolic.functions import MAX_ITEMS, _size
from clozemath.data.gsm_symbolic.values import Meter, OverBudget, _Fault, _Rejected, _settle, charge, metered
from clozemath.errors import ClozeMathError


@dataclass(frozen=True)
class Expression:
    """One checked expression of a template, with where it came from (`file: field line N`)."""

    source: str
    where: str
    reads: frozenset[str]
    """The template variables it reads."""
    random: bool
    """Whether it draws (calls `sample`, ...)."""
    run: Run = field(repr=False, compare=False)
    constant: bool = field(repr=False, compare=False)
    cost: int = field(default=1, repr=False, compare=False)
    """Its nodes: the units of work (`Meter`) one evaluation is charged, besides the lists and numbers it makes."""

    def value(self, scope: _Scope) -> Any:
        """Its value within a draw; a division by zero rejects the draw."""
        charge(self.cost)
        try:
            return self.run(scope)
        except ZeroDivisionError:
            raise _Rejected from None
        except (_Fault, TypeError, ValueError, IndexError, OverflowError, RecursionError) as exc:
            raise ClozeMathError(f"{self.where}: {exc} in `{self.source}`") from None

    def evaluate(self, values: Mapping[str, Any], seed: int = 0) -> Any:
        """Its value for the given variables (a ZeroDivisionError propagates as such)."""
        try:
            return self.value(_Scope(dict(values), random.Random(seed)))
        except _Rejected:
            raise ZeroDivisionError(f"division by zero in `{self.source}`") from None


@dataclass(frozen=True)
class Assignment:
    """An `#init` line: the targets and the expression their values are drawn from."""

    targets: tuple[str, ...]
    expression: Expression
    domain: Sequence[Any] | None = field(default=None, repr=False, compare=False)
    """For one target drawn uniformly from fixed values (`range(2, 9)`, a list, `sample(pool)`): those values."""


@dataclass(frozen=True)
class Template:
    path: Path
    name: str
    variables: tuple[Assignment, ...]
    conditions: tuple[Expression, ...]
    answer: Expression
    question: tuple[str | Expression, ...]
    """Literal text and placeholders."""
    solution: tuple[str | Expression, ...]
    """Literal text and placeholders, calculator annotations already removed."""


@dataclass(frozen=True)
class _Fix:
    """A correction to a released template whose `#answer` disagrees with its own solution and question."""

    released: str
    """The released `#answer`, exactly: a template that no longer has it is left alone."""
    answer: str | None = None
    """The `#answer` to use instead."""
    condition: str | None = None
    """A condition the template misses."""


TEMPLATE_FIXES: dict[str, _Fix] = {
    # Yellow cards are as many as red and green together, so all cards are 2 * (red + green): one n1 is missing.
    "symbolic/0062": _Fix("2 * (n1 + (p/100 * n1))", answer="2 * (n1 + n1 + p/100 * n1)"),
    # The question asks for the share of the *present* students; #answer divides by all of them.
    "p1/0074": _Fix(
        "int((total - num_girls - absent_boys)/total * 100)",
        answer="int((total - num_girls - absent_boys)/(total - absent_girls - absent_boys) * 100)",
    ),
    # P1 adds a fixed insurance cost, which #answer leaves out.
    "p1/0089": _Fix(
        "first_hour_cost + (end_time - start_time - free_hours - 1) * first_hour_cost * multiplier",
        answer="first_hour_cost + (end_time - start_time - free_hours - 1) * first_hour_cost * multiplier + extra",
    ),
    # #answer takes 1 off the family's daily count in the last half-month, which nothing in the question says.
    "p2/0026": _Fix(
        "int(((n1 + n2) * (1+frac) ) * 30 + ((n1 + n2) * (1+frac)) * 15 * (100-p1) / 100 + ((n1 + n2) * (1+frac) - 1)"
        " * 15 * (100-p1) / 100 * (100 - p2) / 100)",
        answer="int((n1 + n2) * (1+frac) * 30 + (n1 + n2) * (1+frac) * 15 * (100-p1) / 100 + (n1 + n2) * (1+frac)"
        " * 15 * (100-p1) / 100 * (100 - p2) / 100)",
    ),
    # With a fraction like 7/10 the harvest is not a whole number, and the solution truncates it.
    "p1/0006": _Fix("x * k * (12//n) * 1.0/frac * year", condition="is_int(x * k * (12//n) * year / frac)"),
}
"""Keyed by `<variant>/<template>`; found by checking every instance's `####` against its `#answer`."""


_DOLLAR = re.compile(r"(\"[^\"]*\"|'[^']*')|\$(?=[A-Za-z_])")
_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
_ANNOTATION = re.compile(r"<<[^\n]*?>>|<<[^\n>]*>")
"""A calculator annotation `<<48/2=24>>`, or one closed by a single `>` (symbolic/0084)."""
_HEADER = re.compile(r"#\s*(init|conditions|answer)\s*[:=]?(.*)$")
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")


def _without_dollars(source: str) -> str:
    """Drop the `$` that marks a numeric variable (`$x`), leaving string literals (`"$"`) alone."""
    return _DOLLAR.sub(lambda m: m.group(1) or "", source)


def _statements(source: str, where: str) -> list[ast.stmt]:
    try:
        return ast.parse(_without_dollars(source).strip()).body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ClozeMathError(f"{where}: not an expression ({type(exc).__name__}) in `{source.strip()}`") from None


def _expression(source: str, variables: Iterable[str], where: str, node: ast.expr | None = None) -> Expression:
    """Check and compile an expression (parsed from `source` unless its `node` is given)."""
    if node is None:
        statements = _statements(source, where)
        if len(statements) != 1 or not isinstance(statements[0], ast.Expr):
            raise ClozeMathError(f"{where}: expected one expression, got `{source.strip()}`")
        node = statements[0].value
    compiler = _Compiler(frozenset(variables))
    try:
        run, constant = compiler.compile(node)
    except ZeroDivisionError:
        raise ClozeMathError(f"{where}: division by zero in `{source.strip()}`") from None
    except (_Fault, TypeError, ValueError, IndexError, OverflowError, RecursionError) as exc:
        raise ClozeMathError(f"{where}: {exc} in `{source.strip()}`") from None
    cost = sum(1 for _ in ast.walk(node))
    return Expression(source.strip(), where, frozenset(compiler.reads), compiler.random, run, constant, cost)


def _assignment(source: str, known: Iterable[str], where: str) -> Assignment:
    statements = _statements(source, where)
    if len(statements) != 1 or not isinstance(statements[0], ast.Assign) or len(statements[0].targets) != 1:
        raise ClozeMathError(f"{where}: expected `name = expression` or `a, b = expression`, got `{source}`")
    target, value = statements[0].targets[0], statements[0].value
    nodes = target.elts if isinstance(target, ast.Tuple) else [target]
    names = tuple(n.id for n in nodes if isinstance(n, ast.Name))
    if len(names) != len(nodes):
        raise ClozeMathError(f"{where}: can only assign to names, got `{source}`")
    expression = _expression(source.split("=", 1)[1], known, where, value)
    return Assignment(names, expression, _domain(value, known, where) if len(names) == 1 else None)


def _domain(node: ast.expr, known: Iterable[str], where: str) -> Sequence[Any] | None:
    """The fixed values a one-target `#init` line draws from uniformly, if it does (see `_drawn`)."""
    sampled = False
    if isinstance(node, ast.Call) and _dotted_name(node.func) == "sample" and len(node.args) == 1:
        node, sampled = node.args[0], True
    expression = _expression(ast.unparse(node), known, where, node)
    if not expression.constant:
        return None
    values = expression.run(_Scope({}, random.Random(0)))
    if isinstance(values, tuple) and not sampled:  # a tuple is one value, a `(label, number)` pair
        return None
    if not isinstance(values, (list, tuple, range)) or not 0 < _size(values) <= MAX_ITEMS:
        return None
    return values if isinstance(values, range) else tuple(_settle(v) for v in values)


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _literal(text: str, start: int, end: int, where: str) -> list[str]:
    stray = re.search(r"[{}]", text[start:end])
    if stray:
        raise ClozeMathError(f"{where} {_line_of(text, start + stray.start())}: an unmatched brace")
    return [text[start:end]] if end > start else []


def _text_parts(text: str, to_expression: Callable[[str, int], Expression], where: str) -> list[str | Expression]:
    """Split text into literals and `{...}` placeholders; a stray brace is an error naming its line."""
    parts: list[str | Expression] = []
    last = 0
    for match in _PLACEHOLDER.finditer(text):
        parts += _literal(text, last, match.start(), where)
        parts.append(to_expression(match.group(1), _line_of(text, match.start())))
        last = match.end()
    return parts + _literal(text, last, len(text), where)


def _question_placeholder(content: str, variables: frozenset[str], where: str) -> Expression:
    """`{var, default}`: the variable's name (the default is the original question's value)."""
    name = content.split(",", 1)[0].strip()
    if not _IDENTIFIER.fullmatch(name):
        raise ClozeMathError(f"{where}: expected `{{name, default}}`, got `{{{content}}}`")
    return _expression(name, variables, where)


MAX_TEMPLATE_BYTES = 64 << 10
"""The largest template file read (64 KiB): the released ones are at most 5.1 KB."""
MAX_PLACEHOLDERS = 1_000
"""The most `{...}` placeholders of a template's question and solution together: the released ones have at most
104, and each is an expression evaluated for every instance."""
LOAD_WORK = 1_000_000
"""Units of work (`Meter`) reading a template may take (the expressions it computes once, such as the values drawn
from): the released ones take at most 852."""
LOAD_SECONDS = 10.0


def _read_json(path: Path) -> dict[str, Any]:
    try:
        size = path.stat().st_size
        if size > MAX_TEMPLATE_BYTES:
            raise ClozeMathError(
                f"{path}: refused: {size:,} bytes, more than a template may hold ({MAX_TEMPLATE_BYTES:,})"
            )
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: JSON's, or a long integer
        raise ClozeMathError(f"{path}: not a readable JSON template ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise ClozeMathError(f"{path}: a template is a JSON object")
    for key in ("question_annotated", "answer_annotated"):
        if not isinstance(data.get(key), str):
            raise ClozeMathError(f"{path}: missing text field '{key}'")
    return data


Located = tuple[str, str]
"""Source text and where it is (`file: question_annotated line 12`)."""


def _sections(path: Path, lines: list[str], start: int) -> tuple[list[Located], list[Located], Located]:
    """The `#init` lines, the `#conditions` lines and the `#answer` of question_annotated, from line `start` on."""
    where = f"{path}: question_annotated line"
    found: dict[str, list[Located]] = {"init": [], "conditions": [], "answer": []}
    section = "init"
    for number, raw in enumerate(lines[start:], start=start + 1):
        line = raw.strip()
        header = _HEADER.match(line)
        if header:
            section, rest = header.group(1), header.group(2).strip()
            if section == "answer":
                if found["answer"] or not rest:
                    raise ClozeMathError(f"{where} {number}: expected one `#answer: expression`")
                found["answer"].append((rest, f"{where} {number}"))
            elif rest:
                raise ClozeMathError(f"{where} {number}: unexpected text after '#{section}:'")
        elif line and (section == "answer" or not line.startswith("-")):
            raise ClozeMathError(f"{where} {number}: expected a `- ...` line in #{section}, got `{line}`")
        elif line:
            found[section].append((line[1:].strip(), f"{where} {number}"))
    if not found["answer"]:
        raise ClozeMathError(f"{path}: question_annotated has no '#answer:' line")
    return found["init"], found["conditions"], found["answer"][0]


def load_template(path: str | Path) -> Template:
    """Parse and check one template file; anything outside the format or the whitelist, or past the budget of
    reading one (`MAX_TEMPLATE_BYTES`, `MAX_PLACEHOLDERS`, `LOAD_WORK`, `LOAD_SECONDS`), is a ClozeMathError."""
    path = Path(path)
    try:
        with metered(Meter(LOAD_WORK, LOAD_SECONDS)):
            return _parsed_template(path)
    except OverBudget as exc:
        raise ClozeMathError(f"{path}: refused, past the budget of {exc} for reading a template") from None


def _parsed_template(path: Path) -> Template:
    data = _read_json(path)
    placeholders = sum(
        len(_PLACEHOLDER.findall(data[key])) for key in ("question_annotated", "answer_annotated")
    )
    if placeholders > MAX_PLACEHOLDERS:
        raise ClozeMathError(
            f"{path}: refused: {placeholders:,} placeholders, more than a template may hold ({MAX_PLACEHOLDERS:,})"
        )
    lines = data["question_annotated"].split("\n")
    headers = [(i, header.group(1)) for i, line in enumerate(lines) if (header := _HEADER.match(line.strip()))]
    if not headers or headers[0][1] != "init":
        raise ClozeMathError(f"{path}: question_annotated has no '#init:' section before the others")
    start = headers[0][0]
    init_lines, condition_lines, answer = _sections(path, lines, start)
    assignments: list[Assignment] = []
    for source, where in init_lines:
        assignments.append(_assignment(source, {t for a in assignments for t in a.targets}, where))

    answer_text, answer_where = answer
    braced = re.fullmatch(r"\{([^{}]*)\}", answer_text)  # `#answer: {expr}` in three templates
    answer_text = braced.group(1) if braced else answer_text
    fix = TEMPLATE_FIXES.get(f"{path.parent.name}/{path.stem}")
    if fix is not None and fix.released == answer_text.strip():
        answer_text, answer_where = fix.answer or answer_text, f"{answer_where} (fixed by clozemath)"
        if fix.condition:
            condition_lines.append((fix.condition, f"{path}: condition added by clozemath"))
    variables = frozenset(t for a in assignments for t in a.targets)
    conditions = tuple(_expression(text, variables, at) for text, at in condition_lines)
    for condition in conditions:
        if condition.constant and not condition.value(_Scope({}, random.Random(0))):
            raise ClozeMathError(f"{condition.where}: the condition is always false: `{condition.source}`")
    answer_expression = _expression(answer_text, variables, answer_where)

    question_where = f"{path}: question_annotated line"
    question = _text_parts(
        "\n".join(lines[:start]).rstrip(),
        lambda content, n: _question_placeholder(content, variables, f"{question_where} {n}"),
        question_where,
    )
    solution_where = f"{path}: answer_annotated line"
    solution_text = _ANNOTATION.sub("", data["answer_annotated"]).rstrip()
    if "####" not in solution_text:
        raise ClozeMathError(f"{path}: answer_annotated has no '#### answer' line")
    solution = _text_parts(
        solution_text, lambda content, n: _expression(content, variables, f"{solution_where} {n}"), solution_where
    )
    return Template(path, path.stem, tuple(assignments), conditions, answer_expression, tuple(question),
                    tuple(solution))
