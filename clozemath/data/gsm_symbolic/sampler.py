"""Instances: variables drawn until every condition holds (tabulating the costly ones), questions and solutions
rendered, each instance's `####` answer checked against its `#answer`."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from clozemath.data.gold import NUMERIC_TOLERANCE, gsm8k_gold
from clozemath.data.gsm_symbolic.compiler import _Scope
from clozemath.data.gsm_symbolic.functions import _sequence
from clozemath.data.gsm_symbolic.template import Assignment, Expression, Template
from clozemath.data.gsm_symbolic.values import (
    Meter,
    OverBudget,
    _Fault,
    _Rejected,
    _is_number,
    _settle,
    charge,
    metered,
    show,
)
from clozemath.errors import ClozeMathError


MAX_DRAWS = 200_000
"""Draws per instance before a template counts as unsatisfiable."""

TEMPLATE_WORK = 5_000_000
"""Units of work (`Meter`) a template may spend beyond INSTANCE_WORK an instance: 2-5.5 s of CPU for the hostile
templates tried, and 3 times what the costliest released template takes to tabulate its conditions (p2/0010: 1.65
million, in one instance). Seed 0, 50 instances: the costliest takes 5.1 million in all (p2/0007), 17% of its
budget; a template whose conditions never hold is refused in seconds."""

INSTANCE_WORK = 500_000
"""Units of work each instance drawn adds to its template's budget: 5 times the most a released template spends
an instance on average (p2/0007: 103,000)."""

TEMPLATE_SECONDS = 30.0
SECONDS_PER_INSTANCE = 0.5
"""A template may take TEMPLATE_SECONDS or SECONDS_PER_INSTANCE an instance, whichever is longer: the slowest
released template took 9 s for 50 instances on a busy 2-core machine. The work budget, not the clock, is what
normally refuses a template, the same on every machine."""

TABULATE_AFTER = 2_000
"""Draws of one instance after which the conditions among independent variables are tabulated."""

DRAW_WORK = 10
"""Units of work (`Meter`) a draw is charged besides its expressions': its own bookkeeping."""

ENUMERATION_LIMIT = 50_000
"""Most combinations of variables tested at once when tabulating the ones that meet some conditions."""


@dataclass(frozen=True)
class Instance:
    template: str
    index: int
    question: str
    answer: str
    """A GSM8K-style solution ending `#### N`."""
    gold: str
    """The number after `####`."""
    values: dict[str, Any] = field(repr=False, compare=False)
    """The drawn variables."""
    draws: int = field(repr=False, compare=False)
    """How many draws it took."""


def _drawn(value: Any, targets: tuple[str, ...], rng: random.Random) -> list[Any]:
    """The targets' values: one drawn from a list or range for one target, else one item per target."""
    if len(targets) == 1:
        if isinstance(value, (list, range)):
            if not _sequence(value, "a draw"):
                raise _Fault("nothing to draw from")
            value = rng.choice(value)
        return [_settle(value)]
    if not isinstance(value, (list, tuple)) or len(value) != len(targets):
        given = len(value) if isinstance(value, (list, tuple)) else "one value"
        raise _Fault(f"{len(targets)} targets but the expression gives {given}")
    return [_settle(item) for item in value]


def _bind(assignment: Assignment, scope: _Scope) -> None:
    targets = assignment.targets
    if assignment.domain is not None:
        scope.values[targets[0]] = scope.rng.choice(assignment.domain)
        return
    value = assignment.expression.value(scope)
    try:
        scope.values.update(zip(targets, _drawn(value, targets, scope.rng), strict=True))
    except _Fault as exc:
        raise ClozeMathError(f"{assignment.expression.where}: {exc} in `{assignment.expression.source}`") from None


@dataclass(frozen=True)
class _Table:
    """Every combination of some independently drawn variables that meets the conditions among them."""

    names: tuple[str, ...]
    rows: list[tuple[Any, ...]]


@dataclass(frozen=True)
class _Plan:
    """How to draw: pick a row of each table, check `first`, then each remaining `#init` line and its checks."""

    tables: tuple[_Table, ...]
    first: tuple[Expression, ...]
    steps: tuple[tuple[Assignment, tuple[Expression, ...]], ...]


def _holds(conditions: Iterable[Expression], scope: _Scope) -> bool:
    try:
        return all(condition.value(scope) for condition in conditions)
    except _Rejected:
        return False


def _linked(conditions: Sequence[Expression]) -> list[list[Expression]]:
    """Conditions grouped so that no two groups share a variable."""
    groups: list[tuple[set[str], list[Expression]]] = []
    for condition in conditions:
        joined = [g for g in groups if g[0] & condition.reads]
        names = set(condition.reads).union(*(g[0] for g in joined))
        members = [m for g in joined for m in g[1]] + [condition]
        groups = [g for g in groups if all(g is not j for j in joined)] + [(names, members)]
    return [members for _, members in groups]


def _enumerate(
    template: Template, conditions: list[Expression], domains: dict[str, Sequence[Any]]
) -> tuple[_Table, list[Expression]] | None:
    """The rows of the variables these conditions read that meet them, cheapest condition first.

    Stops before a step would test more than ENUMERATION_LIMIT combinations; the conditions left over are then
    checked draw by draw. Drawing a row uniformly is exactly rejection sampling of these variables on the
    conditions covered, since each of them is drawn uniformly and on its own.
    """
    order = {name: i for i, name in enumerate(domains)}
    names: list[str] = []
    rows: list[tuple[Any, ...]] = [()]
    pending, covered = list(conditions), list[Expression]()
    scope = _Scope({}, random.Random(0))

    def cost(condition: Expression) -> int:
        return len(rows) * math.prod(len(domains[n]) for n in condition.reads if n not in names)

    while pending:
        cheapest = min(pending, key=cost)
        if cost(cheapest) > ENUMERATION_LIMIT:
            break
        new = sorted((n for n in cheapest.reads if n not in names), key=order.__getitem__)
        names += new
        now = [c for c in pending if c.reads <= set(names)]
        kept = []
        for row in rows:
            for combination in itertools.product(*(domains[n] for n in new)):
                scope.values = dict(zip(names, row + combination, strict=True))
                if _holds(now, scope):
                    kept.append(row + combination)
        if not kept:
            raise ClozeMathError(
                f"{template.path}: the #conditions can never hold together: "
                + "; ".join(f"`{c.source}`" for c in covered + now)
            )
        rows, covered = kept, covered + now
        pending = [c for c in pending if all(c is not d for d in now)]
    return (_Table(tuple(names), rows), covered) if covered else None


def _plan(template: Template, tabulate: bool) -> _Plan:
    """Tables (if `tabulate`) for the conditions among independently drawn variables; the other conditions are
    checked as soon as their variables are drawn. A failed check restarts the whole draw, so instances follow the
    distribution of plain rejection sampling on all conditions either way."""
    assigned = [t for a in template.variables for t in a.targets]
    domains: dict[str, Sequence[Any]] = {
        a.targets[0]: a.domain
        for a in template.variables
        if a.domain is not None and assigned.count(a.targets[0]) == 1
    }
    conditions = [c for c in template.conditions if not c.constant]
    enumerable = [c for c in conditions if tabulate and not c.random and c.reads and c.reads <= domains.keys()]
    tables: list[_Table] = []
    covered: set[int] = set()
    for group in _linked(enumerable):
        enumerated = _enumerate(template, group, domains)
        if enumerated is not None:
            tables.append(enumerated[0])
            covered |= {id(c) for c in enumerated[1]}
    tabled = {name for table in tables for name in table.names}
    steps = [a for a in template.variables if not set(a.targets) <= tabled]
    step_of = {target: i for i, a in enumerate(steps) for target in a.targets}
    first: list[Expression] = []
    checks: list[list[Expression]] = [[] for _ in steps]
    for condition in conditions:
        if id(condition) not in covered:
            later = [step_of[n] for n in condition.reads if n in step_of]
            (checks[max(later)] if later else first).append(condition)
    return _Plan(tuple(tables), tuple(first), tuple((a, tuple(c)) for a, c in zip(steps, checks, strict=True)))


_SENTENCE_END = {".", "!", "?", "\n"}


def _render(parts: Sequence[str | Expression], scope: _Scope, in_question: bool) -> str:
    """Fill the placeholders; a text value that opens a sentence is capitalized (`Half of them ...`)."""
    pieces: list[str] = []
    last = "\n"
    for part in parts:
        if isinstance(part, str):
            text = part
        else:
            try:
                text = show(part.value(scope), in_question)
            except _Fault as exc:
                raise ClozeMathError(f"{part.where}: {exc} in `{part.source}`") from None
            if last in _SENTENCE_END and text[:1].islower():
                text = text[0].upper() + text[1:]
        pieces.append(text)
        stripped = text.rstrip(" ")
        if stripped:
            last = stripped[-1]
    return "".join(pieces).strip()


def same_number(text: str, value: Any) -> bool:
    """Whether `text` (the number after `####`) equals `value` within the grading tolerance."""
    try:
        shown = Fraction(text.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return False
    return _is_number(value) and abs(shown - value) <= Fraction(str(NUMERIC_TOLERANCE))


def _draw(plan: _Plan, scope: _Scope) -> bool:
    """Draw every variable; False as soon as a condition fails."""
    for table in plan.tables:
        scope.values.update(zip(table.names, scope.rng.choice(table.rows), strict=True))
    if not all(condition.value(scope) for condition in plan.first):
        return False
    for assignment, conditions in plan.steps:
        _bind(assignment, scope)
        if not all(condition.value(scope) for condition in conditions):
            return False
    return True


class _Sampler:
    """A template's draws: plain rejection first, tables once an instance takes TABULATE_AFTER draws."""

    def __init__(self, template: Template) -> None:
        self.template = template
        self.plan = _plan(template, tabulate=False)
        self.tabulated = False

    def tabulate(self) -> None:
        if not self.tabulated:
            self.plan = _plan(self.template, tabulate=True)
            self.tabulated = True


def _instance(sampler: _Sampler, index: int, rng: random.Random) -> Instance:
    template = sampler.template
    for draw in range(1, MAX_DRAWS + 1):
        if draw == TABULATE_AFTER:
            sampler.tabulate()
        charge(DRAW_WORK)
        scope = _Scope({}, rng)
        try:
            if not _draw(sampler.plan, scope):
                continue
            question = _render(template.question, scope, in_question=True)
            answer = _render(template.solution, scope, in_question=False)
            expected = template.answer.value(scope)
        except _Rejected:
            continue
        gold = gsm8k_gold(answer)
        if not same_number(gold, expected):
            raise ClozeMathError(
                f"{template.path}: the solution's '#### {gold}' differs from #answer = {show(expected, False)} "
                f"for {_describe(scope.values)}"
            )
        return Instance(template.name, index, question, answer, gold, scope.values, draw)
    raise ClozeMathError(f"{template.path}: the #conditions never held in {MAX_DRAWS} draws")


def _describe(values: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={show(v, False) if _is_number(v) or isinstance(v, str) else v}" for k, v in values.items())


def generate(template: Template, count: int, seed: int) -> list[Instance]:
    """`count` instances of one template; the same seed gives the same instances, whatever other templates exist.
    A template that goes past its budget of work or time (`TEMPLATE_WORK` and `INSTANCE_WORK` a finished instance,
    `TEMPLATE_SECONDS` or `SECONDS_PER_INSTANCE`) is refused in one line."""
    rng = random.Random(f"gsm-symbolic/{seed}/{template.path.parent.name}/{template.name}")
    sampler = _Sampler(template)
    meter = Meter(TEMPLATE_WORK + INSTANCE_WORK, max(TEMPLATE_SECONDS, count * SECONDS_PER_INSTANCE))
    drawn: list[Instance] = []
    try:
        with metered(meter):
            for index in range(count):
                drawn.append(_instance(sampler, index, rng))
                meter.limit += INSTANCE_WORK
    except OverBudget as exc:
        raise ClozeMathError(
            f"{template.path}: refused, past its budget of {exc} with {len(drawn)} of {count} instances drawn: its "
            "conditions rarely hold, or its expressions cost too much"
        ) from None
    return drawn
