"""Balancing: LM samples repeated until they are `lm_share` of a method's training set, against every other
objective's samples (the infilling ones)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping

from clozemath.data.objectives.base import problem_rng
from clozemath.data.objectives.cloze import CLOZE
from clozemath.data.objectives.lm import LM
from clozemath.data.samples import Sample
from clozemath.data.segment import equation_units, segment_solution
from clozemath.data.sources import Problem


def lm_repeats(counts: Mapping[str, int], lm_share: float) -> float:
    """Mean number of copies of each LM sample that brings LM : infilling to about lm_share : (1 - lm_share).

    `counts`: samples per kind before balancing. At least 1: LM samples are repeated, never dropped (`it` and `mft`,
    without infilling, keep one copy each).
    """
    num_lm = counts.get(LM.name, 0)
    num_infilling = sum(count for kind, count in counts.items() if kind != LM.name)
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
        out.extend([sample] * lm_copies(sample.problem_id, repeats, seed) if sample.kind == LM.name else [sample])
    return out


def objective_counts(problems: Iterable[Problem], lm_share: float, seed: int) -> dict[str, int]:
    """How many samples ClozeMath's objectives make on these problems, without building them (k samples of k units
    each would take time and memory quadratic in k), and the balanced total.

    `lm`: one per problem before balancing; `cloze`: one per unit of F (random-span infilling makes as many);
    `lm_balanced`: the LM copies once balanced against the cloze samples at `lm_share`; `balanced_total`: ClozeMath's
    training set (lm_balanced + cloze).
    """
    counts: Counter[str] = Counter()
    problem_ids = []
    for problem in problems:
        counts[LM.name] += 1
        counts[CLOZE.name] += len(equation_units(segment_solution(problem.dataset, problem.solution)))
        problem_ids.append(problem.id)
    repeats = lm_repeats(counts, lm_share)
    lm_balanced = sum(lm_copies(problem_id, repeats, seed) for problem_id in problem_ids)
    return {"lm": counts[LM.name], "cloze": counts[CLOZE.name], "lm_balanced": lm_balanced,
            "balanced_total": lm_balanced + counts[CLOZE.name]}
