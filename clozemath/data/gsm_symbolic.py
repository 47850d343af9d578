"""GSM-Symbolic: instances of Apple's templates, from a safe expression evaluator (an AST whitelist, never eval/exec).

A template is a JSON file. `question_annotated` holds the question with `{var, default}` placeholders, then
`#init:` (one `- targets = expression` line per variable; a `$` before a name only marks it numeric),
`#conditions:` (boolean expressions) and `#answer: expression`. `answer_annotated` is a GSM8K solution with
`{expression}` placeholders and `<<calculator>>` annotations, ending `#### {expression}`.

Semantics:
- An `#init` value that is a collection (`range(...)`, a list, a pool) is drawn from uniformly; `sample(xs, k)`
  draws k distinct values for k targets; a `(label, number)` pair is a number that the question shows as its label.
- Draws are rejected until every condition holds. A condition is checked as soon as its variables are drawn and a
  failure restarts the whole draw; once a template proves expensive, the combinations of independently drawn
  variables that meet the conditions among them are tabulated and drawn from. Either way the instances follow the
  distribution of plain rejection sampling.
- Each instance's `####` answer must equal its `#answer`; five released templates break that and are fixed here
  (TEMPLATE_FIXES).
- Arithmetic is exact: integers and Fractions; float literals are read as exact decimals and `/` gives a Fraction,
  so `int(...)` in the solution and in `#answer` agree. Results show as decimals; `Fraction(a, b)` and the
  fraction pools show as `a/b`; word-valued pool entries (`twice`, `a third`, `four`) show their words in the
  question and their number in the solution.
"""

from __future__ import annotations

import ast
import itertools
import json
import math
import operator
import os
import random
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar, Literal

from tqdm import tqdm

from clozemath.data.sources import DATA_DIR_ENV, Problem
from clozemath.errors import ClozeMathError
from clozemath.data.gold import NUMERIC_TOLERANCE, gsm8k_gold
from clozemath.files import atomic_writer

Variant = Literal["symbolic", "p1", "p2"]
DATASETS: dict[str, str] = {"symbolic": "gsm_symbolic", "p1": "gsm_p1", "p2": "gsm_p2"}
MAX_DRAWS = 200_000
"""Draws per instance before a template counts as unsatisfiable."""
MAX_ITEMS = 1_000_000
"""Longest list (or string) an expression may build."""
MAX_NUMBER_BITS = 10_000
"""Largest number (numerator and denominator) a value may hold, in bits: about 3,000 digits, under Python's limit of
4,300 digits on converting an integer to text, and small enough that no chain of operations can exhaust memory."""
MAX_POWER_BITS = MAX_NUMBER_BITS
"""Largest power an expression may compute, in bits (checked before computing it)."""
MAX_SECONDS = 120.0
"""Time a template may take to draw its instances: conditions that are costly to check and never hold end here."""
TABULATE_AFTER = 2_000
"""Draws of one instance after which the conditions among independent variables are tabulated."""
ENUMERATION_LIMIT = 50_000
"""Most combinations of variables tested at once when tabulating the ones that meet some conditions."""


# --- values -------------------------------------------------------------------------------------------------------


class WordedInt(int):
    """An integer that the question shows as words (`twice`, `four`, `triplets`) and the solution as digits."""

    words: str

    def __new__(cls, value: int, words: str) -> WordedInt:
        self = super().__new__(cls, value)
        self.words = words
        return self


class WordedFraction(Fraction):
    """A fraction that the question shows as words (`a third`, `two-fifths`) or digits, the solution as `a/b`."""

    words: str

    def __new__(cls, value: Fraction, words: str) -> WordedFraction:
        self = super().__new__(cls, value)
        self.words = words
        return self


class ShownFraction(Fraction):
    """The result of `Fraction(a, b)` in a template: shown as `a/b` rather than as a decimal."""


Worded = WordedInt | WordedFraction


def _plain(value: Any) -> Any:
    """Numbers as plain int/Fraction (integral Fractions become ints), at most MAX_NUMBER_BITS; anything else
    unchanged. Every arithmetic result passes here."""
    if isinstance(value, bool) or not isinstance(value, (int, Fraction)):
        return value
    numerator, denominator = (value, 1) if isinstance(value, int) else (value.numerator, value.denominator)
    if max(numerator.bit_length(), denominator.bit_length()) > MAX_NUMBER_BITS:
        raise _Fault(f"a number of more than {MAX_NUMBER_BITS} bits")
    if type(value) is int:
        return value
    if isinstance(value, Fraction):
        return value.numerator if value.denominator == 1 else Fraction(value.numerator, value.denominator)
    return int(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, Fraction))


def _decimal(value: Fraction) -> str:
    """Exact decimal for a terminating fraction (`32.5`, up to 8 places), else rounded to 4 places (`3.3333`)."""
    denominator = value.denominator
    for prime in (2, 5):
        while denominator % prime == 0:
            denominator //= prime
    limit = 8 if denominator == 1 else 4
    places = 0
    while places < limit and (value * 10**places).denominator != 1:
        places += 1
    scaled = round(value * 10**places)
    whole, decimals = divmod(abs(scaled), 10**places)
    text = f"{whole}.{decimals:0{places}d}".rstrip("0").rstrip(".") if places else str(whole)
    return f"-{text}" if scaled < 0 else text


def _fraction_text(value: Fraction) -> str:
    return f"{value.numerator}/{value.denominator}" if value.denominator != 1 else str(value.numerator)


def show(value: Any, in_question: bool) -> str:
    """How a value reads in the question (`in_question`) or in the solution."""
    if isinstance(value, Worded):
        if in_question:
            return value.words
        return _fraction_text(value) if isinstance(value, Fraction) else str(int(value))
    if isinstance(value, ShownFraction):
        return _fraction_text(value)
    if isinstance(value, Fraction):
        return _decimal(value)
    if isinstance(value, (int, str)):
        return str(value)
    raise _Fault(f"cannot show a {type(value).__name__} in text")


def mixed_number(value: Any) -> str:
    """`format_frac`: 7/2 -> `3 1/2`."""
    value = Fraction(_number(value, "format_frac"))
    whole = int(value)
    rest = abs(value - whole)
    if rest == 0:
        return str(whole)
    if whole == 0:
        return _fraction_text(value)
    return f"{whole} {_fraction_text(rest)}"


# --- number words and pools (ours) --------------------------------------------------------------------------------

_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen"
).split()
_TENS = "- - twenty thirty forty fifty sixty seventy eighty ninety".split()
_DENOMINATORS = {2: ("half", "halves"), 3: ("third", "thirds"), 4: ("fourth", "fourths"), 5: ("fifth", "fifths"),
                 6: ("sixth", "sixths"), 8: ("eighth", "eighths"), 10: ("tenth", "tenths")}
_UNIT_FRACTION_WORDS = {2: "half", 3: "a third", 4: "a quarter", 5: "a fifth", 6: "a sixth", 8: "an eighth",
                        10: "a tenth"}


def number_words(n: int) -> str:
    """English words for 0 <= n < 1,000,000 (`forty-two`, `one hundred five`)."""
    if n < 0 or n >= 1_000_000:
        raise _Fault(f"no words for {n}")
    if n < 20:
        return _ONES[n]
    if n < 100:
        tens, ones = divmod(n, 10)
        return _TENS[tens] + (f"-{_ONES[ones]}" if ones else "")
    big, rest = divmod(n, 1000) if n >= 1000 else divmod(n, 100)
    head = f"{number_words(big)} thousand" if n >= 1000 else f"{_ONES[big]} hundred"
    return head + (f" {number_words(rest)}" if rest else "")


def _proper_fractions() -> list[Fraction]:
    return sorted(
        {Fraction(n, d) for d in _DENOMINATORS for n in range(1, d)}, key=lambda f: (f.denominator, f.numerator)
    )


def _fraction_words(value: Fraction) -> str:
    singular, plural = _DENOMINATORS[value.denominator]
    return f"{number_words(value.numerator)}-{singular if value.numerator == 1 else plural}"


def _pools() -> dict[str, list[Any]]:
    male = (
        "James Liam Noah Oliver Mateo Diego Carlos Luis Santiago Gabriel Theo Leon Luca Viktor Pavel Ivan Ali Omar "
        "Yusuf Ibrahim Tariq Hassan Arjun Ravi Sanjay Rohan Wei Jin Hiroshi Kenji Kai Jamal Andre Malik Kwame "
        "Tomas Felix Hugo Emeka Xavier"
    ).split()
    female = (
        "Emma Olivia Ava Sophia Mia Amelia Isabella Valentina Camila Lucia Elena Sofia Daphne Nadia Olga Fatima "
        "Aisha Zahra Leila Rania Priya Ananya Meera Mei Lin Yuki Sakura Haruka Keisha Nia Imani Jasmine Kayla "
        "Quinn Tara Chloe Ingrid Amara Beatriz Gabrielle"
    ).split()
    proper = _proper_fractions()
    alph = [WordedFraction(f, _fraction_words(f)) for f in proper]
    nums = [WordedFraction(f, _fraction_text(f)) for f in proper]
    units = [Fraction(1, d) for d in _UNIT_FRACTION_WORDS]
    return {
        "names_male": male,
        "names_female": female,
        "names": male + female,
        "currencies_sym": ["$", "€", "£", "¥", "₹"],
        "fruits": "apple banana orange pear plum kiwi apricot mango grape lemon pineapple watermelon".split(),
        "colors": "red blue green yellow purple orange pink white black brown gray teal".split(),
        "cities": [
            "Tokyo", "Paris", "London", "New York", "Mumbai", "Cairo", "Lagos", "Lima", "Toronto", "Sydney",
            "Berlin", "Istanbul", "Seoul", "Nairobi", "Mexico City", "Buenos Aires", "Jakarta", "Madrid",
        ],
        "sports": "basketball football tennis cricket volleyball badminton hockey baseball rugby golf".split(),
        "weekdays": "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split(),
        "weights_sm": ["ounce", "gram"],
        "weights_med": ["pound", "kilogram"],
        "length_lg": ["mile", "kilometer"],
        "fractions": [WordedFraction(f, _UNIT_FRACTION_WORDS[f.denominator]) for f in units]
        + [WordedFraction(f, _fraction_text(f)) for f in units],
        "fraction_alph": alph,
        "fraction_nums": nums,
        "fraction_alnum": alph + nums,
        "fraction_decimals": [Fraction(n, 10) for n in range(1, 10)] + [Fraction(1, 4), Fraction(3, 4)],
        "multi_times": [WordedInt(n, f"{number_words(n)} times") for n in range(2, 11)],
        "multiple_ice": [WordedInt(2, "twice"), WordedInt(3, "thrice")],
        "multiple": [WordedInt(n, w) for n, w in enumerate(("double", "triple", "quadruple", "quintuple"), 2)],
    }


POOLS: dict[str, list[Any]] = _pools()
"""The value pools templates sample from (`names`, `fraction_alnum`, ...): small lists written for this project."""


# --- the functions templates may call -----------------------------------------------------------------------------


class _Fault(Exception):
    """A template misuses a value or function; becomes a ClozeMathError naming the template and line."""


class _Rejected(Exception):
    """This draw is undefined (a division by zero): draw again."""


def _number(value: Any, what: str) -> int | Fraction:
    if not _is_number(value):
        raise _Fault(f"{what} expects a number, not {type(value).__name__}")
    return _plain(value)


def _integer(value: Any, what: str) -> int:
    value = _number(value, what)
    if not isinstance(value, int):
        raise _Fault(f"{what} expects an integer, not {value}")
    return value


def _size(values: Sequence[Any]) -> int:
    try:
        return len(values)
    except OverflowError:  # range(10**100)
        return MAX_ITEMS + 1


def _sequence(value: Any, what: str) -> Sequence[Any]:
    """A list, tuple, range or string of at most MAX_ITEMS items, checked before anything walks it."""
    if not isinstance(value, (list, tuple, range, str)):
        raise _Fault(f"{what} expects a list, not {type(value).__name__}")
    if _size(value) > MAX_ITEMS:
        raise _Fault(f"{what} of more than {MAX_ITEMS} items")
    return value


def _how_many(value: Any, what: str) -> int:
    count = _integer(value, what)
    if not 0 <= count <= MAX_ITEMS:
        raise _Fault(f"{what} of {count} items")
    return count


def _count(start: Any, stop: Any, step: Any, what: str) -> int:
    if _number(step, what) == 0:
        raise _Fault(f"{what} with step 0")
    count = max(0, math.ceil((_number(stop, what) - _number(start, what)) / step))
    if count > MAX_ITEMS:
        raise _Fault(f"{what} of more than {MAX_ITEMS} items")
    return count


def _range(*args: Any) -> range:
    bounds = [_integer(a, "range") for a in args]
    if not 1 <= len(bounds) <= 3:
        raise _Fault("range takes 1 to 3 arguments")
    return range(*bounds)


def _arange(start: Any, stop: Any = None, step: Any = 1) -> list[Any]:
    """`np.arange` / `frange` over exact decimals: 0.21, 0.22, ... with no float drift."""
    if stop is None:
        start, stop = 0, start
    return [_plain(start + i * step) for i in range(_count(start, stop, step, "arange"))]


def _sample(rng: random.Random, values: Any, k: Any = None) -> Any:
    values = _sequence(values, "sample")
    if not values:
        raise _Fault("sample from an empty list")
    if k is None:
        return rng.choice(values)
    return rng.sample(values, _how_many(k, "sample"))


def _sample_sequential(rng: random.Random, values: Any, k: Any) -> list[Any]:
    """k consecutive values from a random start, wrapping around (weekdays: Saturday, Sunday, Monday)."""
    values = _sequence(values, "sample_sequential")
    k = _how_many(k, "sample_sequential")
    if not 0 < k <= len(values):
        raise _Fault(f"sample_sequential of {k} from {len(values)} values")
    start = rng.randrange(len(values))
    return [values[(start + i) % len(values)] for i in range(k)]


def _shuffle_list(rng: random.Random, values: Any) -> list[Any]:
    shuffled = list(_sequence(values, "shuffle_list"))
    rng.shuffle(shuffled)
    return shuffled


def _randint(rng: random.Random, low: Any, high: Any, size: Any = None) -> Any:
    """`np.random.randint`: integers in [low, high), `size` of them when given."""
    low, high = _integer(low, "randint"), _integer(high, "randint")
    if size is None:
        return rng.randrange(low, high)
    return [rng.randrange(low, high) for _ in range(_how_many(size, "randint"))]


def _numbers_within(low: Any, high: Any) -> list[WordedInt]:
    """The integers low..high (inclusive), shown as words in the question."""
    low = _integer(low, "numbers_within")
    count = _how_many(_integer(high, "numbers_within") - low + 1, "numbers_within")
    return [WordedInt(n, number_words(n)) for n in range(low, low + count)]


def _divides(a: Any, b: Any) -> bool:
    """`divides(a, b)`: b divides a."""
    a, b = _number(a, "divides"), _number(b, "divides")
    return b != 0 and a % b == 0


def _is_int(value: Any) -> bool:
    value = _number(value, "is_int")
    return isinstance(value, int)


def _int(value: Any) -> int:
    return int(_number(value, "int"))


def _round(value: Any, places: Any = None) -> Any:
    value = _number(value, "round")
    if places is None:
        return round(value)
    places = _integer(places, "round")
    if abs(places) > 100:
        raise _Fault(f"round to {places} places")
    return _plain(round(value, places))


def _fraction(numerator: Any, denominator: Any = 1) -> ShownFraction:
    return ShownFraction(Fraction(_number(numerator, "Fraction")) / _number(denominator, "Fraction"))


def _list(values: Any = ()) -> list[Any]:
    return list(_sequence(values, "list"))


def _fix_floats(values: Any) -> list[Any]:
    """Apple's generator rounds float drift away; exact decimals have none, so this only makes a list."""
    return _list(values)


def _numbers(values: Iterable[Any], what: str) -> list[int | Fraction]:
    return [_number(v, what) for v in values]


def _min(*args: Any) -> Any:
    return _plain(min(_numbers(args[0] if len(args) == 1 else args, "min")))


def _max(*args: Any) -> Any:
    return _plain(max(_numbers(args[0] if len(args) == 1 else args, "max")))


def _sum(values: Any) -> Any:
    return _plain(sum(_numbers(_sequence(values, "sum"), "sum")))


def _abs(value: Any) -> Any:
    return abs(_number(value, "abs"))


def _len(values: Any) -> int:
    return len(_sequence(values, "len"))


@dataclass(frozen=True)
class _Builtin:
    run: Callable[..., Any]
    random: bool = False
    """Takes the draw's random generator first; never folded into a constant."""


FUNCTIONS: dict[str, _Builtin] = {
    "range": _Builtin(_range),
    "np.arange": _Builtin(_arange),
    "frange": _Builtin(_arange),
    "sample": _Builtin(_sample, random=True),
    "sample_sequential": _Builtin(_sample_sequential, random=True),
    "shuffle_list": _Builtin(_shuffle_list, random=True),
    "np.random.randint": _Builtin(_randint, random=True),
    "numbers_within": _Builtin(_numbers_within),
    "divides": _Builtin(_divides),
    "is_int": _Builtin(_is_int),
    "int": _Builtin(_int),
    "round": _Builtin(_round),
    "Fraction": _Builtin(_fraction),
    "format_frac": _Builtin(mixed_number),
    "list": _Builtin(_list),
    "fix_floats": _Builtin(_fix_floats),
    "min": _Builtin(_min),
    "max": _Builtin(_max),
    "sum": _Builtin(_sum),
    "abs": _Builtin(_abs),
    "len": _Builtin(_len),
}
"""Every function the released templates call (plus a few harmless ones), by the dotted name they use."""


# --- operators ----------------------------------------------------------------------------------------------------


def _concat(a: Any, b: Any) -> Any:
    if isinstance(a, (str, list, tuple)) and type(a) is type(b):
        if len(a) + len(b) > MAX_ITEMS:
            raise _Fault(f"a sequence of more than {MAX_ITEMS} items")
        return operator.add(a, b)
    raise _Fault(f"cannot add {type(a).__name__} and {type(b).__name__}")


def _add(a: Any, b: Any) -> Any:
    return _plain(a + b) if _is_number(a) and _is_number(b) else _concat(a, b)


def _multiply(a: Any, b: Any) -> Any:
    if _is_number(a) and _is_number(b):
        return _plain(a * b)
    sequence, times = (a, b) if isinstance(a, (str, list, tuple)) else (b, a)
    if not isinstance(sequence, (str, list, tuple)) or not isinstance(_plain(times), int):
        raise _Fault(f"cannot multiply {type(a).__name__} and {type(b).__name__}")
    if len(sequence) * times > MAX_ITEMS:
        raise _Fault(f"a sequence of more than {MAX_ITEMS} items")
    return sequence * int(times)


def _numeric(op: Callable[[Any, Any], Any], symbol: str) -> Callable[[Any, Any], Any]:
    def apply(a: Any, b: Any) -> Any:
        if not (_is_number(a) and _is_number(b)):
            raise _Fault(f"cannot apply {symbol} to {type(a).__name__} and {type(b).__name__}")
        return _plain(op(a, b))

    return apply


def _true_divide(a: Any, b: Any) -> int | Fraction:
    if type(a) is int and type(b) is int and b and a % b == 0:
        return a // b
    return Fraction(a) / b


def _power(base: Any, exponent: Any) -> Any:
    base, exponent = _plain(base), _plain(exponent)
    if not isinstance(exponent, int):
        raise _Fault(f"exponent {exponent} is not an integer")
    size = max(Fraction(base).numerator.bit_length(), Fraction(base).denominator.bit_length(), 1)
    if size * abs(exponent) > MAX_POWER_BITS:
        raise _Fault(f"power too large ({abs(exponent)} is too big an exponent)")
    return Fraction(base) ** exponent


_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: _add,
    ast.Sub: _numeric(operator.sub, "-"),
    ast.Mult: _multiply,
    ast.Div: _numeric(_true_divide, "/"),
    ast.FloorDiv: _numeric(operator.floordiv, "//"),
    ast.Mod: _numeric(operator.mod, "%"),
    ast.Pow: _numeric(_power, "**"),
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.USub: lambda a: _plain(-_number(a, "-")),
    ast.UAdd: lambda a: _number(a, "+"),
    ast.Not: operator.not_,
}
_COMPARE: dict[type[ast.cmpop], Callable[[Any, Any], Any]] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge,
    ast.In: lambda a, b: a in _sequence(b, "in"), ast.NotIn: lambda a, b: a not in _sequence(b, "not in"),
}


def _subscript(container: Any, index: Any) -> Any:
    """`xs[i]`, `xs[:4]`; a worded value is the pair (label, number): `mult[1]` is its number."""
    if isinstance(container, Worded):
        container = (container.words, _plain(container))
    if not isinstance(container, (list, tuple, str)):
        raise _Fault(f"cannot index a {type(container).__name__}")
    if not isinstance(index, slice):
        index = _integer(index, "an index")
    return container[index]


# --- the compiler: whitelisted AST -> closures --------------------------------------------------------------------


class _Scope:
    """One draw: the variables bound so far and the random generator."""

    __slots__ = ("rng", "values")

    def __init__(self, values: dict[str, Any], rng: random.Random) -> None:
        self.values = values
        self.rng = rng


Run = Callable[[_Scope], Any]
_REFUSED_NAMES = {
    ast.Attribute: "attribute access", ast.Lambda: "a lambda", ast.ListComp: "a comprehension",
    ast.SetComp: "a comprehension", ast.DictComp: "a comprehension", ast.GeneratorExp: "a comprehension",
    ast.NamedExpr: "an assignment expression", ast.JoinedStr: "an f-string", ast.Starred: "unpacking",
}


@dataclass
class _Compiler:
    """Turns one expression's AST into a closure; refuses every node type outside the whitelist."""

    variables: frozenset[str]
    reads: set[str] = field(default_factory=set)
    random: bool = False
    """Whether it calls a function that draws (`sample`, ...)."""

    def compile(self, node: ast.AST) -> tuple[Run, bool]:
        """The closure and whether it is constant (reads no variable, draws nothing): constants fold right away."""
        handler = self._HANDLERS.get(type(node))
        if handler is None:
            refused = _REFUSED_NAMES.get(type(node), f"syntax '{type(node).__name__}'")
            raise _Fault(f"{refused} is not allowed")
        run, constant = handler(self, node)
        if constant:
            value = run(_Scope({}, random.Random(0)))
            return (lambda scope: value), True
        return run, False

    def _many(self, nodes: Iterable[ast.AST]) -> tuple[list[Run], bool]:
        compiled = [self.compile(n) for n in nodes]
        return [run for run, _ in compiled], all(constant for _, constant in compiled)

    def _constant(self, node: ast.Constant) -> tuple[Run, bool]:
        value = node.value
        if isinstance(value, float):
            value = _plain(Fraction(repr(value)))
        elif not isinstance(value, (int, str)):
            raise _Fault(f"the constant {value!r} is not allowed")
        return (lambda scope: value), True

    def _name(self, node: ast.Name) -> tuple[Run, bool]:
        name = node.id
        if name in self.variables:
            self.reads.add(name)
            return (lambda scope: scope.values[name]), False
        if name in POOLS:
            pool = POOLS[name]
            return (lambda scope: pool), True
        if name in FUNCTIONS:
            raise _Fault(f"the function '{name}' is used without a call")
        raise _Fault(f"undefined name '{name}'")

    def _call(self, node: ast.Call) -> tuple[Run, bool]:
        name = _dotted_name(node.func)
        if name not in FUNCTIONS:
            raise _Fault(f"call of '{name or ast.unparse(node.func)}', which is not an allowed function")
        if node.keywords:
            raise _Fault(f"keyword arguments to '{name}' are not allowed")
        builtin = FUNCTIONS[name]
        args, constant = self._many(node.args)
        function = builtin.run
        if builtin.random:
            self.random = True
            return (lambda scope: function(scope.rng, *[a(scope) for a in args])), False
        return (lambda scope: function(*[a(scope) for a in args])), constant

    def _binary(self, node: ast.BinOp) -> tuple[Run, bool]:
        apply = _BINARY.get(type(node.op))
        if apply is None:
            raise _Fault(f"the operator '{type(node.op).__name__}' is not allowed")
        (left, right), constant = self._many((node.left, node.right))
        return (lambda scope: apply(left(scope), right(scope))), constant

    def _unary(self, node: ast.UnaryOp) -> tuple[Run, bool]:
        apply = _UNARY.get(type(node.op))
        if apply is None:
            raise _Fault(f"the operator '{type(node.op).__name__}' is not allowed")
        operand, constant = self.compile(node.operand)
        return (lambda scope: apply(operand(scope))), constant

    def _boolean(self, node: ast.BoolOp) -> tuple[Run, bool]:
        values, constant = self._many(node.values)
        if isinstance(node.op, ast.And):
            def run(scope: _Scope) -> Any:
                result = True
                for value in values:
                    result = value(scope)
                    if not result:
                        return result
                return result
        else:
            def run(scope: _Scope) -> Any:
                result = False
                for value in values:
                    result = value(scope)
                    if result:
                        return result
                return result
        return run, constant

    def _compare(self, node: ast.Compare) -> tuple[Run, bool]:
        tests = []
        for op in node.ops:
            if type(op) not in _COMPARE:
                raise _Fault(f"the comparison '{type(op).__name__}' is not allowed")
            tests.append(_COMPARE[type(op)])
        (first, *others), constant = self._many((node.left, *node.comparators))

        def run(scope: _Scope) -> bool:
            left = first(scope)
            for test, other in zip(tests, others, strict=True):
                right = other(scope)
                if not test(left, right):
                    return False
                left = right
            return True

        return run, constant

    def _conditional(self, node: ast.IfExp) -> tuple[Run, bool]:
        (test, then, otherwise), constant = self._many((node.test, node.body, node.orelse))
        return (lambda scope: then(scope) if test(scope) else otherwise(scope)), constant

    def _list_of(self, node: ast.List) -> tuple[Run, bool]:
        items, constant = self._many(node.elts)
        return (lambda scope: [item(scope) for item in items]), constant

    def _tuple_of(self, node: ast.Tuple) -> tuple[Run, bool]:
        items, constant = self._many(node.elts)
        return (lambda scope: tuple(item(scope) for item in items)), constant

    def _item(self, node: ast.Subscript) -> tuple[Run, bool]:
        (container, index), constant = self._many((node.value, node.slice))
        return (lambda scope: _subscript(container(scope), index(scope))), constant

    def _slice(self, node: ast.Slice) -> tuple[Run, bool]:
        parts = [node.lower, node.upper, node.step]
        runs, constant = self._many(p for p in parts if p is not None)
        bounds = iter(runs)
        slots = [next(bounds) if p is not None else None for p in parts]

        def run(scope: _Scope) -> slice:
            return slice(*(None if s is None else _integer(s(scope), "a slice bound") for s in slots))

        return run, constant

    _HANDLERS: ClassVar[dict[type[ast.AST], Callable[[_Compiler, Any], tuple[Run, bool]]]] = {
        ast.Constant: _constant, ast.Name: _name, ast.Call: _call, ast.BinOp: _binary, ast.UnaryOp: _unary,
        ast.BoolOp: _boolean, ast.Compare: _compare, ast.IfExp: _conditional, ast.List: _list_of,
        ast.Tuple: _tuple_of, ast.Subscript: _item, ast.Slice: _slice,
    }
    """The whitelist: every node type an expression may hold, and how it compiles."""


def _dotted_name(node: ast.AST) -> str | None:
    """`np.random.randint` for the attribute chain np -> random -> randint; None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted_name(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


# --- templates ----------------------------------------------------------------------------------------------------


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

    def value(self, scope: _Scope) -> Any:
        """Its value within a draw; a division by zero rejects the draw."""
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
    return Expression(source.strip(), where, frozenset(compiler.reads), compiler.random, run, constant)


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


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
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
    """Parse and check one template file; anything outside the format or the whitelist is a ClozeMathError."""
    path = Path(path)
    data = _read_json(path)
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


# --- instances ----------------------------------------------------------------------------------------------------


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


def _settle(value: Any) -> Any:
    """A `(label, number)` pair becomes a number shown as its label; other values stay as they are."""
    if isinstance(value, tuple) and len(value) == 2 and _is_number(value[1]) and isinstance(value[0], (str, int)):
        label, number = str(value[0]), _plain(value[1])
        return WordedInt(number, label) if isinstance(number, int) else WordedFraction(number, label)
    return value


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


def _instance(sampler: _Sampler, index: int, rng: random.Random, deadline: float) -> Instance:
    template = sampler.template
    for draw in range(1, MAX_DRAWS + 1):
        if time.monotonic() > deadline:
            raise ClozeMathError(
                f"{template.path}: drawing took more than {MAX_SECONDS:.0f} s ({index} instances, the conditions "
                f"failed {draw - 1} draws of the next)"
            )
        if draw == TABULATE_AFTER:
            sampler.tabulate()
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
    """`count` instances of one template; the same seed gives the same instances, whatever other templates exist."""
    rng = random.Random(f"gsm-symbolic/{seed}/{template.path.parent.name}/{template.name}")
    sampler = _Sampler(template)
    deadline = time.monotonic() + MAX_SECONDS
    return [_instance(sampler, index, rng, deadline) for index in range(count)]


# --- variants, problems, files ------------------------------------------------------------------------------------


def templates_folder(variant: str, templates_dir: str | Path | None = None) -> Path:
    """`<templates_dir>/<variant>/`, by default under `$CLOZEMATH_DATA_DIR/gsm_symbolic/templates/`."""
    if variant not in DATASETS:
        raise ClozeMathError(f"unknown GSM-Symbolic variant '{variant}' (known: {', '.join(DATASETS)})")
    if templates_dir is None:
        root = os.environ.get(DATA_DIR_ENV)
        if not root:
            raise ClozeMathError(f"no templates folder: set {DATA_DIR_ENV} or pass a templates folder")
        templates_dir = Path(root) / "gsm_symbolic" / "templates"
    folder = Path(templates_dir) / variant
    if not folder.is_dir():
        raise ClozeMathError(f"{folder}: no such templates folder")
    return folder


def load_templates(variant: str, templates_dir: str | Path | None = None) -> list[Template]:
    folder = templates_folder(variant, templates_dir)
    paths = sorted(folder.glob("*.json"))
    if not paths:
        raise ClozeMathError(f"{folder}: no *.json templates")
    return [load_template(path) for path in paths]


def problem_id(dataset: str, instance: Instance) -> str:
    return f"{dataset}-{instance.template}-{instance.index}"


def to_problem(instance: Instance, dataset: str) -> Problem:
    return Problem(problem_id(dataset, instance), dataset, "test", instance.question, instance.answer, instance.gold)


def _check_count(per_template: int) -> None:
    if per_template < 1:
        raise ClozeMathError(f"per_template must be at least 1, got {per_template}")


def instances(
    variant: Variant, per_template: int, seed: int, templates_dir: str | Path | None = None
) -> list[Problem]:
    """`per_template` seeded instances of every template of a variant, as test Problems (`gsm_p1-0007-2`)."""
    _check_count(per_template)
    templates = load_templates(variant, templates_dir)
    dataset = DATASETS[variant]
    return [
        to_problem(instance, dataset) for template in templates for instance in generate(template, per_template, seed)
    ]


@dataclass(frozen=True)
class Written:
    path: Path
    templates: int
    instances: int
    draws: int
    seconds: float

    def __str__(self) -> str:
        return (
            f"wrote {self.instances} instances of {self.templates} templates to {self.path} in {self.seconds:.1f} s "
            f"({self.instances / max(self.seconds, 1e-9):.0f} instances/s, {self.draws / self.instances:.1f} "
            f"draws per instance)"
        )


def write_jsonl(
    variant: Variant,
    per_template: int,
    seed: int,
    out: str | Path,
    templates_dir: str | Path | None = None,
    progress: bool = True,
) -> Written:
    """Instances as JSONL rows (question, answer, id, template, instance), with a progress bar on stderr."""
    _check_count(per_template)
    templates = load_templates(variant, templates_dir)
    dataset = DATASETS[variant]
    out = Path(out)
    started = time.perf_counter()
    count = draws = 0
    with atomic_writer(out) as handle:  # a template failing midway leaves an earlier `out` as it was
        for template in tqdm(templates, desc=f"gsm-{variant}", unit="template", file=sys.stderr, disable=not progress):
            for instance in generate(template, per_template, seed):
                row = {"id": problem_id(dataset, instance), "template": instance.template,
                       "instance": instance.index, "question": instance.question, "answer": instance.answer}
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
                count += 1
                draws += instance.draws
    return Written(out, len(templates), count, draws, time.perf_counter() - started)
