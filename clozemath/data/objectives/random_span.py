"""The random-span objective (the paper's "W/o Equation masking"): T5's span corruption over the solution's tokens,
as many samples as the solution has units of F, the configured span shapes (short, long) in turn."""

from __future__ import annotations

import random
from collections.abc import Sequence

from clozemath.config import MethodConfig, SpanShape
from clozemath.data.objectives.base import Objective, Piece, Solution, infilling_sample
from clozemath.data.samples import Sample
from clozemath.errors import ClozeMathError

_SPAN_DRAWS = 20
"""Draws per random-span sample before a repeat of an earlier sample of the problem is accepted (short solutions)."""


def visible_tokens(text: str, offsets: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The character ranges of the tokens that show something, trimmed of whitespace: whitespace-only tokens
    (`\n`) dropped, tokens sharing a character (one character split into byte tokens) merged."""
    ranges: list[tuple[int, int]] = []
    for start, end in offsets:
        piece = text[start:end]
        core = piece.strip()
        if not core:
            continue
        start += len(piece) - len(piece.lstrip())
        end = start + len(core)
        if ranges and start < ranges[-1][1]:
            ranges[-1] = (ranges[-1][0], max(end, ranges[-1][1]))
        else:
            ranges.append((start, end))
    return ranges


def _composition(total: int, parts: int, rng: random.Random, minimum: int) -> list[int]:
    """`total` split at random into `parts` integers, each at least `minimum` (requires total >= parts * minimum)."""
    free = total - parts * minimum
    bars = sorted(rng.sample(range(free + parts - 1), parts - 1))
    edges = [-1, *bars, free + parts - 1]
    return [minimum + edges[i + 1] - edges[i] - 1 for i in range(parts)]


def random_spans(num_tokens: int, shape: SpanShape, rng: random.Random) -> list[tuple[int, int]]:
    """Token spans [start, end) covering about `shape.coverage` of the tokens, `shape.mean_span_tokens` long on average.

    The T5 recipe: the masked count and the span count are fixed, then both the masked and the kept tokens are split
    at random into runs, kept runs between spans never empty.
    """
    if num_tokens == 0:
        return []
    num_masked = min(num_tokens, max(1, round(shape.coverage * num_tokens)))
    num_kept = num_tokens - num_masked
    num_spans = max(1, min(round(num_masked / shape.mean_span_tokens), num_masked, num_kept + 1))
    span_lengths = _composition(num_masked, num_spans, rng, minimum=1)
    inner_gaps = _composition(num_kept - (num_spans - 1), num_spans + 1, rng, minimum=0)
    spans, position = [], inner_gaps[0]
    for index, length in enumerate(span_lengths):
        spans.append((position, position + length))
        position += length + inner_gaps[index + 1] + 1
    return spans


def random_span_pieces(
    solution: str, tokens: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
) -> list[Piece]:
    """The solution with the characters of each token span masked (from its first token's first visible character
    to its last token's last one)."""
    pieces: list[Piece] = []
    cursor = 0
    for first, end in spans:
        start, stop = tokens[first][0], tokens[end - 1][1]
        pieces += [(solution[cursor:start], False), (solution[start:stop], True)]
        cursor = stop
    pieces.append((solution[cursor:], False))
    return [p for p in pieces if p[0]]


def _new_spans(
    num_tokens: int, shape: SpanShape, rng: random.Random, earlier: Sequence[list[tuple[int, int]]]
) -> list[tuple[int, int]]:
    """Spans of `shape` unlike every earlier sample's, where `_SPAN_DRAWS` draws find such."""
    for _ in range(_SPAN_DRAWS):
        spans = random_spans(num_tokens, shape, rng)
        if spans not in earlier:
            break
    return spans


def random_span_samples(solution: Solution, method: MethodConfig, rng: random.Random) -> list[Sample]:
    """As many samples as the solution has units of F, taking the method's span shapes in turn from a random first
    one, each masking other tokens than the ones before it where the solution allows."""
    if solution.token_offsets is None:
        raise ClozeMathError(f"method '{method.name}': random spans are drawn over tokens, give a tokenizer")
    assert method.random_span is not None  # the config validator pairs the objective with its settings
    shapes = method.random_span.shapes
    text = solution.shown_text
    tokens = visible_tokens(text, solution.token_offsets(text))
    first = rng.randrange(len(shapes))
    drawn: list[list[tuple[int, int]]] = []
    for index in range(len(solution.units)):
        drawn.append(_new_spans(len(tokens), shapes[(first + index) % len(shapes)], rng, drawn))
    return [
        infilling_sample(
            solution.problem_id, RANDOM_SPAN.name, solution.prompt, random_span_pieces(text, tokens, spans)
        )
        for spans in drawn
    ]


RANDOM_SPAN = Objective("random_span", random_span_samples, needs_offsets=True, settings=("random_span",))
