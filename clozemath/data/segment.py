"""Split a solution into text and equation segments: the paper's y_1..y_m, with F the equation indices."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Segment:
    kind: Literal["text", "equation"]
    text: str
    group: int | None = None
    """Equation segments sharing a group id (lines of one multi-line display or system) form one unit of F."""
