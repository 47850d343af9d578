"""GSM8K answers graded as lm-evaluation-harness v0.4.12's `gsm8k` task (version 3.0) grades a base model's few-shot
generations: two answer filters, each followed by its `exact_match` metric.

- `strict-match`: the first `#### N` of the generation (N: a sign, digits, `.` and `,`);
- `flexible-extract`: the last number-like run of the generation (two or more of `-$0-9.,`, or an integer).

`exact_match` compares the filtered answer with the gold solution after removing, from both, every `,` and `$`,
everything up to `#### ` and a final `.`, ignoring case. A generation without a match scores 0.
"""

from __future__ import annotations

import re

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


def harness_verdicts(generation: str, gold: str) -> dict[str, bool]:
    """Filter name -> whether its answer exactly matches the gold."""
    return {name: exact_match(filtered_answer(name, generation), gold) for name in FILTERS}
