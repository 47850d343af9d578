"""How sure a difference in accuracy is: paired bootstraps over problems and over seeds (`clozemath report`).

Two methods evaluated on the same problems are compared problem by problem (aligned by problem id). Seed s of the
method is paired with seed s of the reference; a side with a single seed (a base model, which is not trained) pairs
with every seed of the other. Two intervals, each the 2.5 and 97.5 percentiles of 10,000 replicates drawn with a
fixed seed (a report is reproducible) of the mean over the pairs of (accuracy of the method - accuracy of the
reference):
- `paired_difference`: a replicate resamples the problems once, the same resample for every seed pair; the trained
  models are held fixed, so it leaves out how much another training seed would change them;
- `hierarchical_difference`: a replicate resamples the seed pairs, then the problems; it answers whether the
  difference would hold for other training seeds too, and is the one a headline claim rests on.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np

Correctness = Mapping[str, bool]
"""Problem id -> whether the answer was right."""
BySeed = Mapping[str, Correctness]
"""Seed -> the correctness of that seed's run."""

REPLICATES = 10_000
BOOTSTRAP_SEED = 0
LEVEL = 0.95


@dataclass(frozen=True)
class Difference:
    """Method minus reference, in percentage points, with its bootstrap interval."""

    points: float
    low: float
    high: float
    pairs: int
    """Seed pairs pooled."""
    problems: int
    """Problems every paired run answered."""

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


def seed_pairs(method: Collection[str], reference: Collection[str]) -> list[tuple[str, str]]:
    """(method seed, reference seed) pairs: a single seed pairs with every seed of the other side, else seed s with
    seed s (seeds only one side has are left out)."""
    if len(reference) == 1:
        return [(seed, only) for seed in sorted(method) for only in reference]
    if len(method) == 1:
        return [(only, seed) for only in method for seed in sorted(reference)]
    return [(seed, seed) for seed in sorted(set(method) & set(reference))]


def _paired(method: BySeed, reference: BySeed) -> tuple[list[tuple[str, str]], list[str], np.ndarray] | None:
    """The seed pairs, the problems every paired run answered, and per pair and problem the method's right answer
    minus the reference's (a pairs x problems matrix of -1, 0, 1); None when no seeds pair or no problem is shared."""
    pairs = seed_pairs(method.keys(), reference.keys())
    if not pairs:
        return None
    ids = sorted(set.intersection(*(set(method[m]) & set(reference[r]) for m, r in pairs)))
    if not ids:
        return None
    return pairs, ids, np.array([[int(method[m][i]) - int(reference[r][i]) for i in ids] for m, r in pairs])


def paired_difference(
    method: BySeed, reference: BySeed, replicates: int = REPLICATES, seed: int = BOOTSTRAP_SEED, level: float = LEVEL
) -> Difference | None:
    """The pooled difference and its interval over problems (the runs held fixed); None when no seeds pair or the
    paired runs share no problem."""
    paired = _paired(method, reference)
    if paired is None:
        return None
    pairs, ids, diffs = paired
    wins = diffs.sum(axis=0)
    low, high = bootstrap_interval(wins, len(pairs), replicates, seed, level)
    return Difference(100 * wins.mean() / len(pairs), 100 * low, 100 * high, len(pairs), len(ids))


def hierarchical_difference(
    method: BySeed, reference: BySeed, replicates: int = REPLICATES, seed: int = BOOTSTRAP_SEED, level: float = LEVEL
) -> Difference | None:
    """The pooled difference and its interval over seeds and problems; None as for `paired_difference`.

    A replicate draws the seed pairs with replacement (a pair is the unit: seed s of the method with seed s of the
    reference, a one-seed side with every seed of the other), then the problems with replacement, the same draw for
    every drawn pair (the seeds answered the same problems: they are crossed, not nested, so one draw keeps the
    problems' shared difficulty, as the bootstrap of a crossed design resamples each factor once, Owen 2007); its
    value is the mean over the drawn pairs of the method's accuracy minus the reference's on the drawn problems. With
    one seed pair it is `paired_difference`'s interval (the same draws); where each pair differs alike on all its
    problems, the problems' draw changes nothing and it is the seeds' interval alone.
    """
    paired = _paired(method, reference)
    if paired is None:
        return None
    pairs, ids, diffs = paired
    n, p = len(ids), len(pairs)
    # Problems with the same column of differences (one value per pair) are interchangeable in a resample: draw how
    # many of the n draws fall on each distinct column instead of n indices (as in `bootstrap_interval`).
    columns, counts = np.unique(diffs, axis=1, return_counts=True)
    generator = np.random.default_rng(seed)
    problem_draws = generator.multinomial(n, counts / n, size=replicates)  # replicates x distinct columns
    seed_draws = generator.multinomial(p, np.full(p, 1 / p), size=replicates)  # replicates x pairs
    per_pair = problem_draws @ columns.T / n  # each pair's mean difference on the drawn problems
    means = (seed_draws * per_pair).sum(axis=1) / p
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(means, [tail, 100 - tail])
    return Difference(100 * diffs.mean(), 100 * float(low), 100 * float(high), p, n)


def bootstrap_interval(wins: np.ndarray, pairs: int, replicates: int, seed: int, level: float) -> tuple[float, float]:
    """Percentile interval of the mean over resampled problems of `wins / pairs` (per problem: the method's right
    answers minus the reference's, summed over the seed pairs).

    A resample's mean depends only on how many of its n problems carry each distinct value of `wins` (there are at
    most 2 * pairs + 1), so each replicate draws those counts from a multinomial with the values' frequencies: the
    same distribution as drawing n problem indices, at a cost that does not grow with n times the replicates.
    """
    values, counts = np.unique(wins, return_counts=True)
    n = len(wins)
    draws = np.random.default_rng(seed).multinomial(n, counts / n, size=replicates)
    means = draws @ values / (n * pairs)
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)
