"""Training samples per objective: LM, cloze (progressive equation demasking), random-span infilling, MFT noise.

Text convention (one rule for every objective, so that methods differ in one thing only). With P the formatted
prompt (`Question: ...\\nAnswer:`) and Y the clean solution:

- LM sample:         prefix `P<SEP>`,     target ` Y<EOS>`
- infilling sample:  prefix `P Y'<SEP>`,  target `<M_0> a<M_1> b<EOS>`   (P and Y' joined by one space)

where Y' is Y with each masked piece replaced by its sentinel (the whitespace around the piece stays in Y'), and
a, b are the masked pieces, each written after its sentinel with exactly one space, as the LM target writes Y
after `<SEP>`. No other whitespace is put next to a special token. A masked piece never has whitespace at its
ends: an equation is masked without the whitespace around it, a random span runs from a word's first character
to a word's last one. When tokenized, each name becomes its one token and the text between names is tokenized on
its own (`clozemath.data.tokenize`), so ` Y` and ` a` start with the tokenizer's word-initial tokens.

Randomness (which members of a group are masked, where random spans fall, which problems get an extra LM copy) comes
from a per-problem RNG derived from (seed, problem id, purpose): the samples of a problem do not depend on the
order of the problems nor on how they are sharded.
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import torch

from clozemath.config import DataConfig, MethodConfig, RandomSpanConfig
from clozemath.data.segment import Segment, equation_units, segment_solution
from clozemath.data.sources import Problem
from clozemath.data.tokenize import EOS, IGNORE_INDEX, SEP, sentinel
from clozemath.errors import ClozeMathError

SampleKind = Literal["lm", "cloze", "random_span"]
INFILLING_KINDS: tuple[SampleKind, ...] = ("cloze", "random_span")

_WORD = re.compile(r"\S+")


@dataclass(frozen=True)
class Sample:
    """Prefix and target as text, special tokens written by name: `<SEP>`, `<M_0>`, `<mask>`, `<EOS>`."""

    problem_id: str
    kind: SampleKind
    prefix: str
    target: str

    def to_dict(self) -> dict[str, str]:
        """A row for Ray Data (`Sample(**row)` reads it back)."""
        return asdict(self)


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
    """The members masked when each unit is masked: all of a lone equation, a random half (at least one) of a group.

    Drawn once per problem, so progressive demasking reveals the same hidden members of a group throughout.
    """
    return [list(unit) if len(unit) == 1 else sorted(rng.sample(list(unit), max(1, len(unit) // 2))) for unit in units]


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


def _composition(total: int, parts: int, rng: random.Random, minimum: int) -> list[int]:
    """`total` split at random into `parts` integers, each at least `minimum` (requires total >= parts * minimum)."""
    free = total - parts * minimum
    bars = sorted(rng.sample(range(free + parts - 1), parts - 1))
    edges = [-1, *bars, free + parts - 1]
    return [minimum + edges[i + 1] - edges[i] - 1 for i in range(parts)]


def random_span_words(num_words: int, config: RandomSpanConfig, rng: random.Random) -> list[tuple[int, int]]:
    """Word spans [start, end) covering about `coverage` of the words, `mean_span_words` long on average.

    The T5 recipe on words: the masked count and the span count are fixed, then both the masked and the kept
    words are split at random into runs, kept runs between spans never empty.
    """
    if num_words == 0:
        return []
    num_masked = min(num_words, max(1, round(config.coverage * num_words)))
    num_kept = num_words - num_masked
    num_spans = max(1, min(round(num_masked / config.mean_span_words), num_masked, num_kept + 1))
    span_lengths = _composition(num_masked, num_spans, rng, minimum=1)
    inner_gaps = _composition(num_kept - (num_spans - 1), num_spans + 1, rng, minimum=0)
    spans, position = [], inner_gaps[0]
    for index, length in enumerate(span_lengths):
        spans.append((position, position + length))
        position += length + inner_gaps[index + 1] + 1
    return spans


def random_span_pieces(solution: str, spans: Sequence[tuple[int, int]]) -> list[Piece]:
    words = [match.span() for match in _WORD.finditer(solution)]
    pieces: list[Piece] = []
    cursor = 0
    for first, end in spans:
        start, stop = words[first][0], words[end - 1][1]
        pieces += [(solution[cursor:start], False), (solution[start:stop], True)]
        cursor = stop
    pieces.append((solution[cursor:], False))
    return [p for p in pieces if p[0]]


def random_span_samples(
    problem_id: str, prompt: str, solution: str, count: int, config: RandomSpanConfig, rng: random.Random
) -> list[Sample]:
    """`count` independent random-span samples of one solution."""
    num_words = sum(1 for _ in _WORD.finditer(solution))
    return [
        infilling_sample(
            problem_id, "random_span", prompt, random_span_pieces(solution, random_span_words(num_words, config, rng))
        )
        for _ in range(count)
    ]


def samples_from_segments(
    problem_id: str,
    prompt: str,
    segments: Sequence[Segment],
    units: Sequence[Sequence[int]],
    method: MethodConfig,
    seed: int,
) -> list[Sample]:
    """One LM sample, then the method's infilling samples (k of them for k units of F), unbalanced.

    Y is the segments joined, which segmentation guarantees to be the clean solution.
    """
    if not method.trains:
        raise ClozeMathError(f"method '{method.name}' does not train: it has no training samples")
    solution = "".join(segment.text for segment in segments)
    samples = [lm_sample(problem_id, prompt, solution)] if "lm" in method.objectives else []
    if "cloze" in method.objectives:
        samples += cloze_samples(problem_id, prompt, segments, units, problem_rng(seed, problem_id, "cloze"))
    if "random_span" in method.objectives:
        assert method.random_span is not None  # the config validator pairs the objective with its settings
        rng = problem_rng(seed, problem_id, "random_span")
        samples += random_span_samples(problem_id, prompt, solution, len(units), method.random_span, rng)
    return samples


def build_samples(
    problem: Problem, method: MethodConfig, prompt_template: str, seed: int, max_length: int | None = None
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
    return samples_from_segments(problem.id, prompt, segments, units, method, seed)


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


PAPER_SPANS = {
    "random_span_short": RandomSpanConfig(coverage=0.15, mean_span_words=3),
    "random_span_long": RandomSpanConfig(coverage=0.5, mean_span_words=12),
}
"""The paper's random-span ablations, as in configs/methods/random_span_{short,long}.yaml."""


def objective_counts(problems: Iterable[Problem], lm_share: float, seed: int) -> dict[str, int]:
    """How many samples each objective makes on these problems (`sample_counts`), and the balanced total.

    `lm`: one per problem before balancing; `lm_balanced`: its copies once balanced against the cloze samples at
    `lm_share`; `balanced_total`: ClozeMath's training set (lm_balanced + cloze).
    """
    clozemath = MethodConfig(name="clozemath", objectives=["lm", "cloze"], lm_share=lm_share)
    span_methods = {
        key: MethodConfig(name=key, objectives=["random_span"], random_span=spans) for key, spans in PAPER_SPANS.items()
    }
    counts: Counter[str] = Counter()
    problem_ids = []
    for problem in problems:
        num_units = len(equation_units(segment_solution(problem.dataset, problem.solution)))
        counts += sample_counts(num_units, clozemath)
        for key, method in span_methods.items():
            counts[key] += sample_counts(num_units, method).total()
        problem_ids.append(problem.id)
    repeats = lm_repeats(Counter(lm=counts["lm"], cloze=counts["cloze"]), lm_share)
    lm_balanced = sum(lm_copies(problem_id, repeats, seed) for problem_id in problem_ids)
    return {
        **{key: counts[key] for key in ("lm", "cloze", *span_methods)},
        "lm_balanced": lm_balanced,
        "balanced_total": lm_balanced + counts["cloze"],
    }


def dataset_samples(problems: Iterable[Problem], method: MethodConfig, data: DataConfig) -> list[Sample]:
    """Every training sample of a dataset, balanced, in problem order (LM copies first, then infilling)."""
    unbalanced = [
        s for problem in problems for s in build_samples(problem, method, data.prompt_template, data.seed, data.max_length)
    ]
    return balance(unbalanced, lm_repeats(count_kinds(unbalanced), method.lm_share), data.seed)


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
    vocab_size: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """New input ids: each target token (labels != -100) replaced with probability `rate` by `<mask>` or a
    uniformly random token. The prefix, the padding and the labels are left as they are.

    `generator` must live on `input_ids`' device.
    """
    hit = (labels != IGNORE_INDEX) & (
        torch.rand(input_ids.shape, generator=generator, device=input_ids.device) < rate
    )
    if noise == "mask":
        replacement = torch.full_like(input_ids, mask_id)
    else:
        replacement = torch.randint(
            0, vocab_size, input_ids.shape, generator=generator, device=input_ids.device, dtype=input_ids.dtype
        )
    return torch.where(hit, replacement, input_ids)
