"""The functions and operators a template's expressions may use, each checked: sizes, number sizes, types."""

from __future__ import annotations

import ast
import math
import operator
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from clozemath.data.gsm_symbolic.values import (
    MAX_NUMBER_BITS,
    ShownFraction,
    Worded,
    WordedInt,
    _Fault,
    charge,
    _is_number,
    _number,
    _plain,
    mixed_number,
    number_words,
)


MAX_ITEMS = 1_000_000
"""Longest list (or string) an expression may build."""

MAX_POWER_BITS = MAX_NUMBER_BITS
"""Largest power an expression may compute, in bits (checked before computing it)."""


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


def _walked(value: Any, what: str) -> Sequence[Any]:
    """`_sequence`, charged an item of work per item (it is copied, summed or searched)."""
    value = _sequence(value, what)
    charge(len(value))
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
    count = _count(start, stop, step, "arange")
    charge(count)
    return [_plain(start + i * step) for i in range(count)]


def _sample(rng: random.Random, values: Any, k: Any = None) -> Any:
    values = _sequence(values, "sample")
    if not values:
        raise _Fault("sample from an empty list")
    if k is None:
        return rng.choice(values)
    k = _how_many(k, "sample")
    charge(k + (0 if isinstance(values, range) else len(values)))  # a list is copied first
    return rng.sample(values, k)


def _sample_sequential(rng: random.Random, values: Any, k: Any) -> list[Any]:
    """k consecutive values from a random start, wrapping around (weekdays: Saturday, Sunday, Monday)."""
    values = _sequence(values, "sample_sequential")
    k = _how_many(k, "sample_sequential")
    charge(k)
    if not 0 < k <= len(values):
        raise _Fault(f"sample_sequential of {k} from {len(values)} values")
    start = rng.randrange(len(values))
    return [values[(start + i) % len(values)] for i in range(k)]


def _shuffle_list(rng: random.Random, values: Any) -> list[Any]:
    shuffled = list(_walked(values, "shuffle_list"))
    rng.shuffle(shuffled)
    return shuffled


def _randint(rng: random.Random, low: Any, high: Any, size: Any = None) -> Any:
    """`np.random.randint`: integers in [low, high), `size` of them when given."""
    low, high = _integer(low, "randint"), _integer(high, "randint")
    if size is None:
        return rng.randrange(low, high)
    size = _how_many(size, "randint")
    charge(size)
    return [rng.randrange(low, high) for _ in range(size)]


def _numbers_within(low: Any, high: Any) -> list[WordedInt]:
    """The integers low..high (inclusive), shown as words in the question."""
    low = _integer(low, "numbers_within")
    count = _how_many(_integer(high, "numbers_within") - low + 1, "numbers_within")
    charge(count)
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
    return list(_walked(values, "list"))


def _fix_floats(values: Any) -> list[Any]:
    """Apple's generator rounds float drift away; exact decimals have none, so this only makes a list."""
    return _list(values)


def _numbers(values: Iterable[Any], what: str) -> list[int | Fraction]:
    return [_number(v, what) for v in _walked(values, what)]


def _min(*args: Any) -> Any:
    return _plain(min(_numbers(args[0] if len(args) == 1 else args, "min")))


def _max(*args: Any) -> Any:
    return _plain(max(_numbers(args[0] if len(args) == 1 else args, "max")))


def _sum(values: Any) -> Any:
    return _plain(sum(_numbers(values, "sum")))


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
        charge(len(a) + len(b))
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
    charge(len(sequence) * max(int(times), 0))
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
    ast.In: lambda a, b: a in _searched(b, "in"), ast.NotIn: lambda a, b: a not in _searched(b, "not in"),
}


def _searched(values: Any, what: str) -> Sequence[Any]:
    """A sequence `in` looks through: a range answers at once, a list or string item by item."""
    return _sequence(values, what) if isinstance(values, range) else _walked(values, what)


def _subscript(container: Any, index: Any) -> Any:
    """`xs[i]`, `xs[:4]`; a worded value is the pair (label, number): `mult[1]` is its number."""
    if isinstance(container, Worded):
        container = (container.words, _plain(container))
    if not isinstance(container, (list, tuple, str)):
        raise _Fault(f"cannot index a {type(container).__name__}")
    if not isinstance(index, slice):
        return container[_integer(index, "an index")]
    part = container[index]
    charge(len(part))
    return part
