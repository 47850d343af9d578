"""Values in GSM-Symbolic templates: exact numbers, numbers shown as words or fractions, how a value shows in
a question or a solution; number words and the value pools templates draw from."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from fractions import Fraction
from typing import Any


MAX_NUMBER_BITS = 10_000
"""Largest number (numerator and denominator) a value may hold, in bits: about 3,000 digits, under Python's limit of
4,300 digits on converting an integer to text, and small enough that no chain of operations can exhaust memory."""


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


# --- the work a template costs -------------------------------------------------------------------------------------


class OverBudget(Exception):
    """A template went past its budget (`Meter`): it is refused as a whole, whatever draw it was on. Its message
    names the budget: `work (N units)` or `time (N s)`."""


class Meter:
    """The work and time one template may take, charged as its expressions run: a unit is one node of an expression
    evaluated, one item of a list built or walked, or 64 bits of a number computed. Since a draw holds nothing it
    was not charged for, the units also bound its memory (tens of bytes a unit at most)."""

    __slots__ = ("spent", "limit", "deadline", "seconds", "_next_clock")

    CLOCK_EVERY = 20_000
    """Units between two looks at the clock."""

    def __init__(self, limit: int, seconds: float) -> None:
        self.spent = 0
        self.limit = limit
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self._next_clock = self.CLOCK_EVERY

    def charge(self, units: int) -> None:
        self.spent += units
        if self.spent > self.limit:
            raise OverBudget(f"work ({self.limit:,} units)")
        if self.spent >= self._next_clock:
            self._next_clock = self.spent + self.CLOCK_EVERY
            if time.monotonic() > self.deadline:
                raise OverBudget(f"time ({self.seconds:.0f} s)")


_local = threading.local()


@contextmanager
def metered(meter: Meter) -> Iterator[Meter]:
    """Charge the work done in this thread within the block to `meter`."""
    outer = getattr(_local, "meter", None)
    _local.meter = meter
    try:
        yield meter
    finally:
        _local.meter = outer


def charge(units: int) -> None:
    """Charge `units` of work to this thread's meter, if it has one (`metered`)."""
    meter = getattr(_local, "meter", None)
    if meter is not None:
        meter.charge(units)


def _plain(value: Any) -> Any:
    """Numbers as plain int/Fraction (integral Fractions become ints), at most MAX_NUMBER_BITS and charged by their
    size; anything else unchanged. Every arithmetic result passes here."""
    if isinstance(value, bool) or not isinstance(value, (int, Fraction)):
        return value
    numerator, denominator = (value, 1) if isinstance(value, int) else (value.numerator, value.denominator)
    bits = max(numerator.bit_length(), denominator.bit_length())
    if bits > MAX_NUMBER_BITS:
        raise _Fault(f"a number of more than {MAX_NUMBER_BITS} bits")
    if bits > 64:
        charge(bits >> 6)
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


# --- faults and coercions -----------------------------------------------------------------------------------------


class _Fault(Exception):
    """A template misuses a value or function; becomes a ClozeMathError naming the template and line."""


class _Rejected(Exception):
    """This draw is undefined (a division by zero): draw again."""


def _number(value: Any, what: str) -> int | Fraction:
    if not _is_number(value):
        raise _Fault(f"{what} expects a number, not {type(value).__name__}")
    return _plain(value)


def _settle(value: Any) -> Any:
    """A `(label, number)` pair becomes a number shown as its label; other values stay as they are."""
    if isinstance(value, tuple) and len(value) == 2 and _is_number(value[1]) and isinstance(value[0], (str, int)):
        label, number = str(value[0]), _plain(value[1])
        return WordedInt(number, label) if isinstance(number, int) else WordedFraction(number, label)
    return value
