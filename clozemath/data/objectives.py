"""Training samples per objective: LM, cloze (progressive equation demasking), random-span infilling, MFT noise."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SampleKind = Literal["lm", "cloze", "random_span"]


@dataclass(frozen=True)
class Sample:
    """Prefix and target as text, special tokens written by name: `<SEP>`, `<M_0>`, `<mask>`, `<EOS>`."""

    problem_id: str
    kind: SampleKind
    prefix: str
    target: str
