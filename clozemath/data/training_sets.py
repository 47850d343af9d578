"""The training sets, each declared once by its family: where its problems come from, how a data row becomes a
problem (its fields, the rule that reads the gold answer from the solution) and how a solution splits into equations
(the segmentation rule of `clozemath.data.segment`).

Planning (`data.dataset`), sources, segmentation, the CLI's `--dataset`, the report and the benchmarks read them from
here: a new training set in a format already known is one entry in `TRAINING_SETS`; a new format also needs its gold
rule (`clozemath.data.gold`) or its segmentation rule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from clozemath.data.gold import boxed_gold, numeric_gold
from clozemath.registry import Registry

EquationRule = Literal["calculator_annotations", "latex_relations"]
"""How `clozemath.data.segment` finds a solution's equations: one per GSM8K `<<expr=result>>` calculator annotation
(stripped from the solution a model sees), or the relation-bearing parts of LaTeX math spans (MATH)."""


@dataclass(frozen=True)
class TrainingSet:
    name: str
    """As `data.dataset`, the `train_set` tag, the report and the data folder (`$CLOZEMATH_DATA_DIR/<name>/`) name
    it."""
    question: str
    """The field of a data row holding the question."""
    solution: str
    """The field holding the worked solution."""
    gold: Callable[[str, str], str]
    """(solution, where) -> the gold answer; a solution without one is an error naming `where`."""
    hub: str
    """The Hugging Face hub dataset read when no local file is given."""
    hub_configs: tuple[str, ...]
    """Its configs, read in order and joined."""
    equations: EquationRule


GSM8K = TrainingSet(
    name="gsm8k", question="question", solution="answer", gold=numeric_gold,
    hub="openai/gsm8k", hub_configs=("main",), equations="calculator_annotations",
)
MATH = TrainingSet(
    name="math", question="problem", solution="solution", gold=boxed_gold,
    hub="EleutherAI/hendrycks_math",
    hub_configs=("algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory",
                 "prealgebra", "precalculus"),
    equations="latex_relations",
)
TRAINING_SETS: Registry[TrainingSet] = Registry("training set", [(s.name, s) for s in (GSM8K, MATH)])
"""Every training set by name, the paper's first in its tables' order."""
training_set_names = TRAINING_SETS.names
training_set = TRAINING_SETS.__getitem__
