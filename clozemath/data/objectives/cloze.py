"""The cloze objective: progressive equation demasking, for t = 1..k units t..k of F masked (the paper's M(F))."""

from __future__ import annotations

import random
from collections.abc import Sequence

from clozemath.config import MethodConfig
from clozemath.data.objectives.base import Objective, Piece, Solution, infilling_sample
from clozemath.data.samples import Sample
from clozemath.data.segment import Segment


def _masked_piece(text: str) -> list[Piece]:
    """Mask `text` without the whitespace at its ends."""
    core = text.strip()
    start = text.index(core) if core else 0
    end = start + len(core)
    return [p for p in ((text[:start], False), (core, True), (text[end:], False)) if p[0]]


def group_halves(units: Sequence[Sequence[int]], rng: random.Random) -> list[list[int]]:
    """The members masked when each unit is masked: all of a lone equation, a random half of a group.

    Half of an odd group rounds down or up at random, with even odds (a 3-equation group hides 1 or 2): groups are
    masked 50% on average, as the paper says. Drawn once per problem, so progressive demasking reveals the same hidden
    members of a group throughout.
    """
    return [list(unit) if len(unit) == 1 else sorted(rng.sample(list(unit), _half(len(unit), rng))) for unit in units]


def _half(size: int, rng: random.Random) -> int:
    return size // 2 + (size % 2 == 1 and rng.random() < 0.5)


def cloze_pieces(segments: Sequence[Segment], masked: set[int]) -> list[Piece]:
    pieces: list[Piece] = []
    for index, segment in enumerate(segments):
        pieces.extend(_masked_piece(segment.text) if index in masked else [(segment.text, False)])
    return pieces


def cloze_samples(solution: Solution, method: MethodConfig, rng: random.Random) -> list[Sample]:
    """One sample per unit of F: sample t masks units t..k of the solution shown."""
    halves = group_halves(solution.units, rng)
    return [
        infilling_sample(solution.problem_id, CLOZE.name, solution.prompt,
                         cloze_pieces(solution.shown, {i for half in halves[t:] for i in half}))
        for t in range(len(solution.units))
    ]


CLOZE = Objective("cloze", cloze_samples, settings=())
