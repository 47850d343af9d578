"""Gold answers from solutions (GSM8K's number after `####`, MATH's last `\\boxed{...}`), and how close a numeric
answer must come to its gold."""

from __future__ import annotations

import math
import re

from clozemath.errors import ClozeMathError

NUMERIC_TOLERANCE = 1e-4
"""How close a numeric answer must come to the gold to be correct."""

_BOX_OPENERS = ("\\boxed", "\\fbox")
_BARE_BOX_ARGUMENT_RE = re.compile(r" +([^\s$]+)")


def boxed_span(text: str) -> tuple[int, int] | None:
    """Offsets of the content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`) in `text`."""
    start = max(text.rfind(opener) for opener in _BOX_OPENERS)
    if start < 0:
        return None
    opener = next(o for o in _BOX_OPENERS if text.startswith(o, start))
    i = start + len(opener)
    if text.startswith(" ", i):  # `\boxed 5`: the argument runs to the next `$` or space
        match = _BARE_BOX_ARGUMENT_RE.match(text, i)
        return match.span(1) if match else None
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return i + 1, j
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`) in `text`, nested braces handled."""
    span = boxed_span(text)
    return None if span is None else text[span[0] : span[1]]


def gsm8k_gold(solution: str) -> str:
    """The number after `####`, commas removed."""
    _, sep, tail = solution.rpartition("####")
    if not sep:
        raise ValueError("no '####' answer line")
    return tail.strip().replace(",", "")


def is_number(text: str) -> bool:
    """Whether a gold answer is a finite number as the numeric graders read it (`$`, a trailing `.` and the Unicode
    minus allowed): `#### banana` or `#### nan` would make every prediction of its problem wrong."""
    try:
        return math.isfinite(float(text.replace("$", "").replace("\u2212", "-").rstrip(".")))
    except ValueError:
        return False


def numeric_gold(solution: str, where: str) -> str:
    """The number after `####`; a solution without one, or with text there, is an error naming `where` (its line)."""
    try:
        answer = gsm8k_gold(solution)
    except ValueError:
        raise ClozeMathError(f"{where}: the answer has no '#### N' line") from None
    if not is_number(answer):
        raise ClozeMathError(f"{where}: the answer's '#### {answer[:40]}' is not a number")
    return answer


def boxed_gold(solution: str, where: str) -> str:
    """The last `\\boxed{}`'s content; a solution without one is an error naming `where` (its line)."""
    answer = last_boxed(solution)
    if answer is None:
        raise ClozeMathError(f"{where}: the solution has no \\boxed{{}} answer")
    return answer
