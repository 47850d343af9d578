"""GSM8K answers graded as lm-evaluation-harness v0.4.12's `gsm8k` task (version 3.0) grades a base model's few-shot
generations: two answer filters, each followed by its `exact_match` metric.

- `strict-match`: the first `#### N` of the generation (N: a sign, digits, `.` and `,`);
- `flexible-extract`: the last number-like run of the generation (two or more of `-$0-9.,`, or an integer).

`exact_match` compares the filtered answer with the gold solution after removing, from both, every `,` and `$`,
everything up to `#### ` and a final `.`, ignoring case. A generation without a match scores 0.

GSM-Symbolic is no harness task, and its golds may be written `45.0` (Apple's GSM-P2), which no filtered `45` would
match as text: its sets compare the filters' answers as numbers (`numeric_match`), within the tolerance every
method's answer is judged by.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from clozemath.data.gold import NUMERIC_TOLERANCE

STRICT_MATCH = "strict-match"
FLEXIBLE_EXTRACT = "flexible-extract"
FILTERS = (STRICT_MATCH, FLEXIBLE_EXTRACT)

_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
_IGNORED = [re.compile(pattern) for pattern in (",", r"\$", r"(?s).*#### ", r"\.$")]


def filtered_answer(name: str, generation: str) -> str | None:
    """The answer a filter extracts: strict-match's first `#### N`, flexible-extract's last number; None if none."""
    if name == STRICT_MATCH:
        found = _STRICT.search(generation)
        return None if found is None else found.group(1)
    if name == FLEXIBLE_EXTRACT:
        matches = _FLEXIBLE.findall(generation)
        return next((group for group in matches[-1] if group), None) if matches else None
    raise ValueError(f"unknown harness filter '{name}' (known: {', '.join(FILTERS)})")


def _comparable(text: str) -> str:
    for pattern in _IGNORED:
        text = pattern.sub("", text)
    return text.lower()


def exact_match(answer: str | None, gold_solution: str) -> bool:
    """The harness's `exact_match` of a filtered answer against the gold (a whole solution or its number)."""
    return answer is not None and _comparable(answer.strip()) == _comparable(gold_solution)


def numeric_match(answer: str | None, gold_solution: str) -> bool:
    """`exact_match`'s clean-up, then the answer and the gold compared as numbers (within `NUMERIC_TOLERANCE`); an
    answer that is no number is wrong."""
    if answer is None:
        return False
    try:
        return abs(float(_comparable(answer.strip())) - float(_comparable(gold_solution))) <= NUMERIC_TOLERANCE
    except ValueError:
        return False


Match = Callable[[str | None, str], bool]
"""How a filtered answer is compared with the gold: `exact_match` or `numeric_match`."""


def harness_verdicts(generation: str, gold: str, match: Match = exact_match) -> dict[str, bool]:
    """Filter name -> whether its answer matches the gold."""
    return {name: match(filtered_answer(name, generation), gold) for name in FILTERS}
