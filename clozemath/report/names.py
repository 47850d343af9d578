"""How the report names and orders things: models, methods, training and evaluation sets, decodings.

Training sets and decodings come in their registries' order (`training_set_names()`, `decoding_names()`), read when
a report is made, so that one declared or registered there is reported too."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from clozemath.tasks import get_task, task_names

MODEL_NAMES = {
    "deepseek-math-7b": "DeepSeek-Math", "llama-3.1-8b": "Llama-3.1-8B", "llama-3.2-3b": "Llama-3.2-3B",
    "llama-3.2-1b": "Llama-3.2-1B", "smollm2-135m": "SmolLM2-135M-Instruct",
    "qwen2.5-coder-1.5b-instruct": "Qwen2.5-Coder-1.5B-Instruct",
}
METHOD_NAMES = {
    "base": "Base", "mft": "MFT", "clozemath": "ClozeMath",
    "it_prefixlm": "W/o Text infilling", "clozemath_causal": "W/o PrefixLM",
    "it": "W/o Text-infilling & W/o PrefixLM",
    "random_span": "W/o Equation masking",
}
ABLATIONS = ("it_prefixlm", "clozemath_causal", "it", "random_span")
SYMBOLIC_SETS = ("gsm_symbolic", "gsm_p1", "gsm_p2")
"""Table 3's evaluation sets."""
BASE_DECODING = "greedy"
"""Base models are decoded as lm-evaluation-harness decodes them; their accuracy is its GSM8K strict-match."""
REPLICATION_METHODS = ("base", "it", "mft", "clozemath", "it_prefixlm", "clozemath_causal", "random_span")
"""The order of the results and comparisons tables: the baselines, the paper's methods, then the other ablations."""
REFERENCES = ("it", "base")
"""What each trained method is compared against."""

Column = tuple[str, str]
"""(eval set, decoding)."""
REPLICATION_NAMES = {**METHOD_NAMES, "it": "IT"}
"""Beside base, MFT and ClozeMath, `it` is the instruction-tuning baseline: every table but Table 4 (whose rows are
METHOD_NAMES', the paper's ablation names) names it so."""
Block = tuple[str, str]
"""(training set, model)."""


def set_title(name: str) -> str:
    """The evaluation set as tables name it (its registry title; an unknown set by its own name)."""
    return get_task(name).title if name in task_names() else name


def model_name(model: str) -> str:
    return MODEL_NAMES.get(model, model)


def method_name(method: str, names: dict[str, str] = REPLICATION_NAMES) -> str:
    """The method's name in a table, with a grid variant's axis values (`IT (lr=0.0001)`)."""
    name, _, variant = method.partition(" (")
    return f"{names.get(name, name)} ({variant}" if variant else names.get(method, method)


def split_variant(method: str) -> tuple[str, str]:
    """`it (arm=budget3x)` -> (`it`, `arm=budget3x`); a method of no grid variant -> (it, "")."""
    name, _, variant = method.partition(" (")
    return name, variant.removesuffix(")")


def with_variant(name: str, variant: str) -> str:
    """The method `name` of the grid variant `variant` (`split_variant`'s inverse)."""
    return f"{name} ({variant})" if variant else name


def ordered(names: Iterable[str], preferred: Sequence[str]) -> list[str]:
    """In `preferred`'s order, a grid variant (`it (lr=0.0001)`) after its method's place, variants by the numbers in
    them (5e-05 before 0.0001), the names `preferred` lacks after, alphabetically."""

    def key(name: str) -> tuple[int, str, list[str | float]]:
        base, _, variant = name.partition(" (")
        listed = name if name in preferred else base
        if listed in preferred:
            return preferred.index(listed), "", _natural(variant)
        return len(preferred), base, _natural(variant)

    return sorted(set(names), key=key)


NUMBER = re.compile(r"(\d+(?:\.\d+)?(?:e[-+]?\d+)?)")


def _natural(text: str) -> list[str | float]:
    """`text` split into its words and numbers, the numbers as numbers: words fall at even places, numbers at odd."""
    return [float(part) if k % 2 else part for k, part in enumerate(NUMBER.split(text))]


def rank(name: str, preferred: Sequence[str]) -> tuple[int, str]:
    return (preferred.index(name) if name in preferred else len(preferred), name)


def column_name(column: Column) -> str:
    return f"{set_title(column[0])} {column[1]}"
