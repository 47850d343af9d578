"""Answer extraction and grading."""

from __future__ import annotations

import re

_BOX_OPENERS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`) in `text`, nested braces handled."""
    start = max(text.rfind(opener) for opener in _BOX_OPENERS)
    if start < 0:
        return None
    opener = next(o for o in _BOX_OPENERS if text.startswith(o, start))
    i = start + len(opener)
    if text.startswith(" ", i):  # `\boxed 5`: the argument runs to the next `$` or space
        match = re.match(r" +([^\s$]+)", text[i:])
        return match.group(1) if match else None
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def gsm8k_gold(solution: str) -> str:
    """The number after `####`, commas removed."""
    _, sep, tail = solution.rpartition("####")
    if not sep:
        raise ValueError("no '####' answer line")
    return tail.strip().replace(",", "")
