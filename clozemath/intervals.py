"""How sure a difference in accuracy is (`clozemath report`): method minus reference on the problems both answered,
with two 95% intervals that answer two questions.

- `problems_difference`: would the difference hold on other problems like these, the trained models held fixed? A
  percentile bootstrap over problems of the per-problem difference of the mean correctness over each side's runs.
- `seeds_difference`: would it hold for other training seeds too (the one a verdict rests on)? The problems and the
  seeds are crossed (every run answers the same problems), so the variance of the difference has a problems' part and
  a seeds' part per side, and the seed-by-problem noise belongs to one of them only: the seeds' part is each side's
  variance of its runs' accuracies less the residual mean square of its runs x problems table over the problems
  (the noise the problems' part already holds; a method-of-moments estimate of crossed random effects, truncated at
  0). With 3-5 seeds that part is known to only 2-4 degrees of freedom, so the interval is a generalized pivotal
  quantity (Weerahandi 1993): the problems' part taken as known (n - 1 degrees of freedom, n ~ 1,000), the seeds'
  part from its scaled chi-square distribution (Welch-Satterthwaite degrees of freedom when both sides are
  trained). With the problems' part negligible it is Welch's t interval over the runs' accuracies.

Seeds are not paired across methods: seed 1 of ClozeMath and seed 1 of IT share nothing by default. Where a grid
shares LoRA's initialisation and the data order across methods by design (`train.paired_seeds`), the seeds' part is
the variance of the paired runs' differences instead. A side that was not trained (a base model) has no seeds'
part; a trained side with one seed has one nobody can estimate, so `seeds_difference` gives no interval for it.

Coverage was checked by simulation (`tests/test_interval_coverage.py`): logistic problem, method-by-problem and seed
effects, 1,319 problems, 3 and 5 seeds, seed effects from none to ~7 points, null and non-null differences. The seed
interval covered the population difference 94.9-96.1% of the time in 16 such cases, the problems interval the fixed
models' difference 94.7-95.4%, paired seeds 94-96% at 5 seeds but ~90% at 3 seeds whose shared effect moves accuracy
by several points (that effect scales a seed's paired difference, far from normal). The percentile bootstrap over
seeds, then problems, that it replaced covered ~79% at 3 seeds. At the other shapes a study compares (2 seeds a side,
4 against 5, 5 or 4 against 3, 500 problems) the seed interval covered 93.9-97.2%; where one side's seeds spread ~7
points and the other's ~0.5, 94.3-94.8% at 3-5 seeds and ~92% at 2 (Welch-Satterthwaite's degrees of freedom run
short there; drawing each side's chi-square on its own fixes that case but widens the rest up to 2.2-fold).

The seed interval's ends are the pivotal quantity's quantiles computed, not drawn: a verdict is the sign of an end,
and 10,000 draws had put one at -0.0014 where it lies at +0.015 (the report's GSM-P2 comparison without the diverged
run, 2026-12-05). The problems' bootstrap draws from a fixed seed: the same predictions give the same report.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from scipy import optimize, special, stats

Correctness = Mapping[str, bool]
"""Problem id -> whether the answer was right."""
BySeed = Mapping[str, Correctness]
"""Seed -> the correctness of that seed's run."""

DRAWS = 10_000
DRAW_SEED = 0
"""The problems' bootstrap: its resamples, from a fixed seed."""
LEVEL = 0.95
MIN_SEEDS = 5
"""A verdict resting on fewer trained seeds a side is provisional."""


@dataclass(frozen=True)
class Difference:
    """Method minus reference, in percentage points, with its interval."""

    points: float
    low: float
    high: float
    method_runs: int
    reference_runs: int
    problems: int
    """Problems every run of both sides answered."""
    paired: bool = False
    """The seeds were paired by design (`train.paired_seeds`)."""

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


@dataclass(frozen=True)
class RunTables:
    """Each side's runs x shared problems table of correctness (0 or 1), runs in seed order."""

    method: np.ndarray
    reference: np.ndarray

    @classmethod
    def of(cls, method: BySeed, reference: BySeed) -> RunTables | None:
        """The tables of the problems every run of both sides answered; None when a side has no runs or they share
        no problem."""
        if not method or not reference:
            return None
        ids = sorted(set.intersection(*(set(runs) for runs in (*method.values(), *reference.values()))))
        if not ids:
            return None
        method_table, reference_table = (np.array([[float(side[s][i]) for i in ids] for s in sorted(side)])
                                         for side in (method, reference))
        return cls(method_table, reference_table)

    @property
    def problems(self) -> int:
        return self.method.shape[1]

    def per_problem(self) -> np.ndarray:
        """Each problem's mean correctness over the method's runs minus the reference's."""
        return self.method.mean(axis=0) - self.reference.mean(axis=0)

    def difference(self, low: float, high: float, paired: bool = False) -> Difference:
        return Difference(100 * float(self.per_problem().mean()), 100 * low, 100 * high, len(self.method),
                          len(self.reference), self.problems, paired)


def problems_difference(method: BySeed, reference: BySeed, draws: int = DRAWS, seed: int = DRAW_SEED,
                        level: float = LEVEL) -> Difference | None:
    """The difference of the sides' mean accuracies over their runs, with its percentile bootstrap interval over
    the problems (the runs held fixed); None when a side has no runs or they share no problem."""
    tables = RunTables.of(method, reference)
    return None if tables is None else problems_interval(tables, draws, seed, level)


def problems_interval(tables: RunTables, draws: int = DRAWS, seed: int = DRAW_SEED, level: float = LEVEL
                      ) -> Difference:
    low, high = bootstrap_interval(tables.per_problem(), draws, seed, level)
    return tables.difference(low, high)


def seeds_difference(method: BySeed, reference: BySeed, *, method_trained: bool = True,
                     reference_trained: bool = True, paired: bool = False, level: float = LEVEL
                     ) -> Difference | None:
    """The same difference with its interval over the problems and the training seeds (see the module); `paired`:
    seed s of the method with seed s of the reference (the seeds both have). None when a side has no runs, they
    share no problem, or a trained side has one run (its seeds' variance is unknown)."""
    if paired:
        shared = set(method) & set(reference)
        method, reference = ({s: side[s] for s in shared} for side in (method, reference))
    tables = RunTables.of(method, reference)
    if tables is None:
        return None
    if (method_trained and len(tables.method) < 2) or (reference_trained and len(tables.reference) < 2):
        return None
    return seeds_interval(tables, paired, level)


def seeds_interval(tables: RunTables, paired: bool = False, level: float = LEVEL) -> Difference:
    """`seeds_difference` on the tables (paired: their rows are the same seeds, in order)."""
    per_problem = tables.per_problem()
    problems_part = float(per_problem.var(ddof=1)) / tables.problems if tables.problems > 1 else 0.0
    if paired:
        seed_parts = [_seeds_part(tables.method - tables.reference)] if len(tables.method) > 1 else []
    else:
        seed_parts = [_seeds_part(table) for table in (tables.method, tables.reference) if len(table) > 1]
    point = float(per_problem.mean())
    half = _pivotal_half_width(problems_part, seed_parts, level)
    low, high = point - half, point + half
    return tables.difference(low, high, paired)


def _residual_mean_square(table: np.ndarray) -> float:
    """The seed-by-problem mean square of a runs x problems table (two-way ANOVA without replication): the noise of
    one run on one problem beyond what the run and the problem explain."""
    runs, problems = table.shape
    if runs < 2 or problems < 2:
        return 0.0
    residual = table - table.mean(axis=1, keepdims=True) - table.mean(axis=0, keepdims=True) + table.mean()
    return float((residual**2).sum()) / ((runs - 1) * (problems - 1))


def _seeds_part(table: np.ndarray) -> tuple[float, int]:
    """A side's share of the variance of the difference from its seeds (the variance of its runs' accuracies less
    the seed-by-problem noise in them, over its run count) and that estimate's degrees of freedom; for paired seeds,
    `table` is the method's table minus the reference's, its runs' accuracies the paired differences."""
    runs, problems = table.shape
    accuracies = table.mean(axis=1)
    seed_variance = max(0.0, float(accuracies.var(ddof=1)) - _residual_mean_square(table) / problems)
    return seed_variance / runs, runs - 1


def _quantile_rule(nodes: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """Probabilities at which to take the chi-square's quantiles, and their weights: Gauss-Legendre on (0, 1) through
    u^2 (3 - 2u), which flattens the integrand at both ends (the quantile function's log singularity at 1). The
    half-width comes within ~1e-10 (relative) of adaptive quadrature's at 1-8 degrees of freedom."""
    x, w = np.polynomial.legendre.leggauss(nodes)
    u = (x + 1) / 2
    return u * u * (3 - 2 * u), w / 2 * 6 * u * (1 - u)


_QUANTILES, _QUANTILE_WEIGHTS = _quantile_rule()


def _pivotal_half_width(problems_part: float, seed_parts: list[tuple[float, int]], level: float) -> float:
    """The half-width q of the interval `point -+ q` that holds `level` of `Z * sqrt(problems_part + seeds_part * df /
    chi2(df))`: Z standard normal, the seeds' parts summed, df their Welch-Satterthwaite degrees of freedom. Its
    coverage at q is the mean over the chi-square's quantiles of `2 Phi(q / scale) - 1`, solved for `level`."""
    z = float(special.ndtri(0.5 + level / 2))
    seeds_part = sum(part for part, _ in seed_parts)
    if seeds_part <= 0:
        return z * float(np.sqrt(problems_part))
    df = seeds_part**2 / sum(part**2 / freedom for part, freedom in seed_parts if part > 0)
    scale = np.sqrt(problems_part + seeds_part * df / stats.chi2.ppf(_QUANTILES, df))

    def beyond(q: float) -> float:
        return float(_QUANTILE_WEIGHTS @ (2 * special.ndtr(q / scale) - 1)) - level

    low, high = z * float(scale.min()), z * float(scale.max())  # the root lies between them
    if beyond(low) >= 0:  # the scales all but equal: a difference of rounding
        return low
    if beyond(high) <= 0:
        return high
    return float(optimize.brentq(beyond, low, high, xtol=1e-12))


def bootstrap_interval(per_problem: np.ndarray, draws: int, seed: int, level: float) -> tuple[float, float]:
    """Percentile interval of the mean over resampled problems of `per_problem`.

    A resample's mean depends only on how many of its n problems carry each distinct value (a few dozen at most:
    differences of means over a handful of runs), so each draw takes those counts from a multinomial with the
    values' frequencies: the same distribution as drawing n problem indices, at a cost that does not grow with n.
    """
    values, counts = np.unique(per_problem, return_counts=True)
    n = len(per_problem)
    resampled = np.random.default_rng(seed).multinomial(n, counts / n, size=draws) @ values / n
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(resampled, [tail, 100 - tail])
    return float(low), float(high)
