"""How sure a difference in accuracy is: a paired bootstrap over problems, pooled over seeds (`clozemath report`).

Two methods evaluated on the same problems are compared problem by problem (aligned by problem id). Seed s of the
method is paired with seed s of the reference; a side with a single seed (a base model, which is not trained) pairs
with every seed of the other. A bootstrap replicate resamples the problems once, the same resample for every seed
pair, and takes the mean over the pairs of (accuracy of the method - accuracy of the reference); the interval is
the 2.5 and 97.5 percentiles of 10,000 replicates drawn with a fixed seed, so a report is reproducible.
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


def paired_difference(
    method: BySeed, reference: BySeed, replicates: int = REPLICATES, seed: int = BOOTSTRAP_SEED, level: float = LEVEL
) -> Difference | None:
    """The pooled difference and its interval; None when no seeds pair or the paired runs share no problem."""
    pairs = seed_pairs(method.keys(), reference.keys())
    if not pairs:
        return None
    ids = sorted(set.intersection(*(set(method[m]) & set(reference[r]) for m, r in pairs)))
    if not ids:
        return None
    wins = np.array([[int(method[m][i]) - int(reference[r][i]) for i in ids] for m, r in pairs]).sum(axis=0)
    low, high = bootstrap_interval(wins, len(pairs), replicates, seed, level)
    return Difference(100 * wins.mean() / len(pairs), 100 * low, 100 * high, len(pairs), len(ids))


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
