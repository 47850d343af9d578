"""Training samples per objective: LM, cloze (progressive equation demasking), random-span infilling, MFT noise.

Text convention (one rule for every objective, so that methods differ in one thing only). With P the formatted
prompt (`Question: ...\\nAnswer:`) and Y the clean solution:

- LM sample:         prefix `P<SEP>`,     target ` Y<EOS>`
- infilling sample:  prefix `P Y'<SEP>`,  target `<M_0> a<M_1> b<EOS>`   (P and Y' joined by one space)

where Y' is Y, less GSM8K's closing `#### N` line (it would give the always-masked last equation's result away), with
each masked piece replaced by its sentinel (the whitespace around the piece stays in Y'), and a, b are the masked
pieces, each written after its sentinel with exactly one space, as the LM target writes Y after `<SEP>`. No other
whitespace is put next to a special token. A masked piece never has whitespace at its ends: an equation is masked
without the whitespace around it, a random span runs from a token's first visible character to a token's last one.
When tokenized, each name becomes its one token and the text between names is tokenized on its own
(`clozemath.data.tokenize`), so ` Y` and ` a` start with the tokenizer's word-initial tokens.

Randomness (which members of a group are masked, where random spans fall, which problems get an extra LM copy) comes
from a per-problem RNG derived from (seed, problem id, purpose): the samples of a problem do not depend on the
order of the problems nor on how they are sharded.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

import torch

from clozemath.config import DataConfig, MethodConfig, RandomSpanConfig, SpanShape
from clozemath.data.segment import Segment, equation_units, segment_solution, without_final_answer
from clozemath.data.sources import Problem
from clozemath.data.samples import INFILLING_KINDS, Sample, SampleKind
from clozemath.data.tokenize import EOS, IGNORE_INDEX, SEP, sentinel
from clozemath.errors import ClozeMathError

Piece = tuple[str, bool]
"""A stretch of the solution and whether it is masked; a sample's pieces joined give back the solution."""


def problem_rng(seed: int, problem_id: str, purpose: str) -> random.Random:
    """An RNG of its own for one problem and one use (string seeds are hashed with SHA-512: stable across runs)."""
    return random.Random(f"{seed}/{problem_id}/{purpose}")


def format_prompt(template: str, question: str) -> str:
    try:
        return template.format(question=question)
    except (KeyError, IndexError, ValueError) as exc:
        raise ClozeMathError(f"data.prompt_template: cannot format it with a question ({exc!r})") from None


def lm_sample(problem_id: str, prompt: str, solution: str) -> Sample:
    return Sample(problem_id, "lm", f"{prompt}{SEP}", f" {solution}{EOS}")


def infilling_sample(problem_id: str, kind: SampleKind, prompt: str, pieces: Sequence[Piece]) -> Sample:
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


def cloze_samples(
    problem_id: str, prompt: str, segments: Sequence[Segment], units: Sequence[Sequence[int]], rng: random.Random
) -> list[Sample]:
    """Progressive demasking: for t = 1..k, mask units t..k of F (the paper's M(F))."""
    halves = group_halves(units, rng)
    return [
        infilling_sample(problem_id, "cloze", prompt, cloze_pieces(segments, {i for half in halves[t:] for i in half}))
        for t in range(len(units))
    ]


TokenOffsets = Callable[[str], list[tuple[int, int]]]
"""A tokenizer's character offsets `[start, end)` of each token of a text (`clozemath.data.tokenize.token_offsets`)."""

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


def random_span_samples(
    problem_id: str,
    prompt: str,
    solution: str,
    count: int,
    config: RandomSpanConfig,
    token_offsets: TokenOffsets,
    rng: random.Random,
) -> list[Sample]:
    """`count` random-span samples of one solution, taking the configured shapes (short, long) in turn from a random
    first one, each masking other tokens than the ones before it where the solution allows."""
    tokens = visible_tokens(solution, token_offsets(solution))
    first = rng.randrange(len(config.shapes))
    drawn: list[list[tuple[int, int]]] = []
    for index in range(count):
        drawn.append(_new_spans(len(tokens), config.shapes[(first + index) % len(config.shapes)], rng, drawn))
    return [
        infilling_sample(problem_id, "random_span", prompt, random_span_pieces(solution, tokens, spans))
        for spans in drawn
    ]


def samples_from_segments(
    problem_id: str,
    prompt: str,
    segments: Sequence[Segment],
    units: Sequence[Sequence[int]],
    method: MethodConfig,
    seed: int,
    token_offsets: TokenOffsets | None = None,
) -> list[Sample]:
    """One LM sample, then the method's infilling samples (k of them for k units of F), unbalanced; random spans need
    the model tokenizer's `token_offsets`.

    Y is the segments joined, which segmentation guarantees to be the clean solution. Infilling samples show Y without
    GSM8K's `#### N` line: their last equation is always masked, and that line would give its result away.
    """
    if not method.trains:
        raise ClozeMathError(f"method '{method.name}' does not train: it has no training samples")
    solution = "".join(segment.text for segment in segments)
    samples = [lm_sample(problem_id, prompt, solution)] if "lm" in method.objectives else []
    shown = without_final_answer(segments)  # the final answer line is text: the units' indices stay valid
    if "cloze" in method.objectives:
        samples += cloze_samples(problem_id, prompt, shown, units, problem_rng(seed, problem_id, "cloze"))
    if "random_span" in method.objectives:
        assert method.random_span is not None  # the config validator pairs the objective with its settings
        if token_offsets is None:
            raise ClozeMathError(f"method '{method.name}': random spans are drawn over tokens, give a tokenizer")
        rng = problem_rng(seed, problem_id, "random_span")
        shown_solution = "".join(segment.text for segment in shown)
        samples += random_span_samples(
            problem_id, prompt, shown_solution, len(units), method.random_span, token_offsets, rng
        )
    return samples


def build_samples(
    problem: Problem, method: MethodConfig, prompt_template: str, seed: int, token_offsets: TokenOffsets | None = None,
    max_length: int | None = None,
) -> list[Sample]:
    """A problem's samples before balancing: Ray Data's flat_map calls this once per problem.

    With `max_length` (tokens), a solution with more units of F than that gets no infilling sample: none would fit,
    as each unit takes at least a token of its own (a sentinel, or its number), and k samples of k units each
    would take time and memory quadratic in k (a valid 5 MB row holds ~99,000 equations).
    """
    segments = segment_solution(problem.dataset, problem.solution)
    prompt = format_prompt(prompt_template, problem.question)
    units = equation_units(segments)
    if max_length is not None and len(units) > max_length:
        units = []
    return samples_from_segments(problem.id, prompt, segments, units, method, seed, token_offsets)


def count_kinds(samples: Iterable[Sample]) -> Counter[str]:
    return Counter(sample.kind for sample in samples)


def sample_counts(num_units: int, method: MethodConfig) -> Counter[str]:
    """How many samples of each kind `samples_from_segments` makes of a solution with `num_units` units of F,
    without building them (building k samples of k units each is quadratic in k)."""
    counts: Counter[str] = Counter()
    if "lm" in method.objectives:
        counts["lm"] = 1
    for kind in ("cloze", "random_span"):
        if kind in method.objectives and num_units:
            counts[kind] = num_units
    return counts


def lm_repeats(counts: Counter[str] | dict[str, int], lm_share: float) -> float:
    """Mean number of copies of each LM sample that brings LM : infilling to about lm_share : (1 - lm_share).

    At least 1: LM samples are repeated, never dropped (`it` and `mft`, without infilling, keep one copy each).
    """
    num_lm = counts.get("lm", 0)
    num_infilling = sum(counts.get(kind, 0) for kind in INFILLING_KINDS)
    if num_lm == 0:
        return 1.0
    return max(1.0, num_infilling * lm_share / ((1.0 - lm_share) * num_lm))


def lm_copies(problem_id: str, repeats: float, seed: int) -> int:
    """floor(repeats) copies, one more with probability frac(repeats): the dataset total lands on the target."""
    whole = math.floor(repeats)
    return whole + int(problem_rng(seed, problem_id, "balance").random() < repeats - whole)


def balance(samples: Iterable[Sample], repeats: float, seed: int) -> list[Sample]:
    """Repeat each LM sample `lm_copies` times, keep the rest; works on any subset (a problem, a shard, all)."""
    out: list[Sample] = []
    for sample in samples:
        out.extend([sample] * lm_copies(sample.problem_id, repeats, seed) if sample.kind == "lm" else [sample])
    return out


def objective_counts(problems: Iterable[Problem], lm_share: float, seed: int) -> dict[str, int]:
    """How many samples each objective makes on these problems (`sample_counts`), and the balanced total.

    `lm`: one per problem before balancing; `cloze`: one per unit of F (random-span infilling makes as many);
    `lm_balanced`: the LM copies once balanced against the cloze samples at `lm_share`; `balanced_total`: ClozeMath's
    training set (lm_balanced + cloze).
    """
    clozemath = MethodConfig(name="clozemath", objectives=["lm", "cloze"], lm_share=lm_share)
    counts: Counter[str] = Counter()
    problem_ids = []
    for problem in problems:
        counts += sample_counts(len(equation_units(segment_solution(problem.dataset, problem.solution))), clozemath)
        problem_ids.append(problem.id)
    repeats = lm_repeats(counts, lm_share)
    lm_balanced = sum(lm_copies(problem_id, repeats, seed) for problem_id in problem_ids)
    return {"lm": counts["lm"], "cloze": counts["cloze"], "lm_balanced": lm_balanced,
            "balanced_total": lm_balanced + counts["cloze"]}


def dataset_samples(
    problems: Iterable[Problem], method: MethodConfig, data: DataConfig, token_offsets: TokenOffsets | None = None
) -> list[Sample]:
    """Every training sample of a dataset, balanced, in problem order (LM copies first, then infilling)."""
    if data.seed is None:
        raise ClozeMathError("data.seed is unset (an experiment sets it from train.seed)")
    template, seed = data.prompt_template, data.seed
    unbalanced = [
        s for problem in problems for s in build_samples(problem, method, template, seed, token_offsets, data.max_length)
    ]
    return balance(unbalanced, lm_repeats(count_kinds(unbalanced), method.lm_share), seed)


# --------------------------------------------------------------------------------------------------------------
# MFT (Masked Thought): token noise on the target, drawn afresh at every training step


def mft_rate(step: int, total_steps: int, r_max: float) -> float:
    """Masked Thought's schedule: a linear warm-up to r_max over the first ~66% of training."""
    return min(r_max, r_max * step / (0.66 * total_steps + 1))


def apply_mft_noise(
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    rate: float,
    noise: Literal["mask", "random"],
    mask_id: int,
    noise_ids: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """New input ids: each target token (labels != -100) replaced with probability `rate` by `<mask>` or a token
    drawn uniformly from `noise_ids` (the tokenizer's ordinary tokens, as Masked Thought draws them: never a
    special, reserved or padding row). The prefix, the padding and the labels are left as they are.

    `generator` and `noise_ids` must live on `input_ids`' device.
    """
    hit = (labels != IGNORE_INDEX) & (
        torch.rand(input_ids.shape, generator=generator, device=input_ids.device) < rate
    )
    if noise == "mask":
        replacement = torch.full_like(input_ids, mask_id)
    else:
        drawn = torch.randint(0, len(noise_ids), input_ids.shape, generator=generator, device=input_ids.device)
        replacement = noise_ids[drawn].to(input_ids.dtype)
    return torch.where(hit, replacement, input_ids)
