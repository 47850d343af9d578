"""What an objective is: a name and a sample builder, reading a problem's solution as `Solution` holds it."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from clozemath.config import MethodConfig
from clozemath.data.samples import EOS, SEP, Sample, sentinel
from clozemath.data.segment import Segment

TokenOffsets = Callable[[str], list[tuple[int, int]]]
"""A tokenizer's character offsets `[start, end)` of each token of a text (`clozemath.data.tokenize.token_offsets`)."""

Piece = tuple[str, bool]
"""A stretch of the solution and whether it is masked; a sample's pieces joined give back the solution."""


@dataclass(frozen=True)
class Solution:
    """One problem's solution as every objective reads it."""

    problem_id: str
    prompt: str
    """P, the formatted prompt (`Question: ...\\nAnswer:`)."""
    segments: Sequence[Segment]
    """Y, the clean solution, segmented (joined they give Y back)."""
    shown: Sequence[Segment]
    """Y less GSM8K's closing `#### N` line, what an infilling sample shows: its last equation is always masked, and
    that line would give its result away. The units' indices hold in it."""
    units: Sequence[Sequence[int]]
    """The units of F (indices into the segments); none where there are too many to fit (`build_samples`)."""
    token_offsets: TokenOffsets | None
    """The model tokenizer's, for objectives that work on tokens (else None)."""

    @property
    def text(self) -> str:
        return "".join(segment.text for segment in self.segments)

    @property
    def shown_text(self) -> str:
        return "".join(segment.text for segment in self.shown)


SampleBuilder = Callable[[Solution, MethodConfig, random.Random], list[Sample]]
"""A problem's samples of one objective; the RNG is the problem's own for that objective (`problem_rng`)."""


@dataclass(frozen=True)
class Objective:
    name: str
    """As methods list it (`method.objectives`) and its samples carry it (`Sample.kind`)."""
    build: SampleBuilder
    needs_offsets: bool = False
    """Whether `build` reads the tokenizer's character offsets (`Solution.token_offsets`)."""
    draws: bool = True
    """Whether `build` draws from its RNG (its samples then depend on the seed). True unless known otherwise: a
    builder wrongly said not to draw would share a preprocessing cache across seeds."""
    settings: tuple[str, ...] | None = None
    """The `MethodConfig` fields `build` reads, beside `name` in its messages (e.g. `random_span`'s own settings);
    None: it may read any, so all of them count (`sample_inputs`)."""


def problem_rng(seed: int, problem_id: str, purpose: str) -> random.Random:
    """An RNG of its own for one problem and one use (string seeds are hashed with SHA-512: stable across runs)."""
    return random.Random(f"{seed}/{problem_id}/{purpose}")


def infilling_sample(problem_id: str, kind: str, prompt: str, pieces: Sequence[Piece]) -> Sample:
    """The sample that hides the masked pieces behind sentinels `<M_0>, <M_1>, ...` in order."""
    visible, hidden = [], []
    for text, masked in pieces:
        if masked:
            name = sentinel(len(hidden))
            visible.append(name)
            hidden.append(f"{name} {text}")
        else:
            visible.append(text)
    return Sample(problem_id, kind, f"{prompt} {''.join(visible)}{SEP}", f"{''.join(hidden)}{EOS}")
