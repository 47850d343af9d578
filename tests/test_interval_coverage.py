"""Do the report's 95% intervals cover 95% of the time? Simulated evaluations with a known difference (issue 45).

Each simulated data set is one comparison as a grid makes it: 1,319 test problems (500 in two cases) drawn from a
population, each with a difficulty shared by both methods and a method-by-problem effect; each trained run with a seed
effect of its own; every answer right with the logistic probability of the sum. The truth is the population
difference (over problems and seeds) for the seed-aware interval, and the difference of the trained models at hand
over the problems' population for the problems-only one. Coverage is counted over 1,000 data sets a case (standard
error ~0.7 points) from a fixed seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from clozemath.intervals import RunTables, problems_interval, seeds_interval

PROBLEMS = 1319
DIFFICULTY_SD = 2.0
"""Problem difficulty on the logit scale: most problems almost always or almost never solved, as in GSM8K."""
METHOD_BY_PROBLEM_SD = 0.4
BASE_LOGIT = 0.2
DATA_SETS = 1000
COVERAGE = (0.92, 0.98)

pytestmark = pytest.mark.slow  # ~1 minute of simulation


_NODES, _WEIGHTS = np.polynomial.hermite_e.hermegauss(80)


def _expected_accuracy(logits: np.ndarray | float, spread: float) -> np.ndarray:
    """E[logistic(logit + spread * Z)] for each logit, Z standard normal (Gauss-Hermite quadrature)."""
    values = np.asarray(logits, dtype=float)[..., None] + spread * _NODES
    return (_WEIGHTS / (1 + np.exp(-values))).sum(axis=-1) / _WEIGHTS.sum()


def _logistic(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


@dataclass(frozen=True)
class Case:
    seeds: int
    seed_sd: float
    """Seed effect on the logit scale: 0.05 is ~0.5 points of accuracy, 0.7 ~7 points (Qwen IT's spread)."""
    effect: float
    """The method's logit shift over the reference's: 0 is a null difference, 0.4 ~6 points."""
    reference_trained: bool
    """False: the reference is a base model, one untrained run."""
    paired: bool = False
    """Seed s of both methods shares a seed effect (as `train.paired_seeds` declares), each adding a small own one."""
    reference_seeds: int | None = None
    """The reference's trained runs when they differ from the method's (a diverged run left out, Table 4's 3 seeds
    against the main grid's 5)."""
    reference_seed_sd: float | None = None
    """The reference's seed effect when it differs from the method's."""
    problems: int = PROBLEMS

    @property
    def reference_runs(self) -> int:
        return (self.reference_seeds or self.seeds) if self.reference_trained else 1

    @property
    def reference_sd(self) -> float:
        if not self.reference_trained:
            return 0.0
        return self.seed_sd if self.reference_seed_sd is None else self.reference_seed_sd

    def population_difference(self) -> float:
        problem_sd = np.hypot(DIFFICULTY_SD, METHOD_BY_PROBLEM_SD)
        if self.paired:
            method_sd = reference_sd = np.hypot(problem_sd, np.hypot(self.seed_sd, self.seed_sd / 4))
        else:
            method_sd, reference_sd = (np.hypot(problem_sd, sd) for sd in (self.seed_sd, self.reference_sd))
        return float(_expected_accuracy(BASE_LOGIT + self.effect, method_sd)
                     - _expected_accuracy(BASE_LOGIT, reference_sd))

    def simulate(self, generator: np.random.Generator) -> tuple[RunTables, float]:
        """One data set, and the difference of its trained models over the population of problems."""
        difficulty = generator.normal(0, DIFFICULTY_SD, self.problems)
        if self.paired:
            shared = generator.normal(0, self.seed_sd, self.seeds)
            method_seeds = shared + generator.normal(0, self.seed_sd / 4, self.seeds)
            reference_seeds = shared + generator.normal(0, self.seed_sd / 4, self.seeds)
        else:
            method_seeds = generator.normal(0, self.seed_sd, self.seeds)
            reference_seeds = generator.normal(0, self.reference_sd, self.reference_runs)
        method_logits = BASE_LOGIT + self.effect + method_seeds[:, None]
        reference_logits = BASE_LOGIT + reference_seeds[:, None]
        tables = []
        for logits in (method_logits, reference_logits):
            own = generator.normal(0, METHOD_BY_PROBLEM_SD, self.problems)
            probability = _logistic(logits + difficulty + own)
            tables.append((generator.random(probability.shape) < probability).astype(float))
        problem_sd = np.hypot(DIFFICULTY_SD, METHOD_BY_PROBLEM_SD)
        models = (_expected_accuracy(method_logits[:, 0], problem_sd).mean()
                  - _expected_accuracy(reference_logits[:, 0], problem_sd).mean())
        return RunTables(tables[0], tables[1]), float(models)


def coverage(case: Case, seed_aware: bool) -> float:
    generator = np.random.default_rng(2026)
    population = 100 * case.population_difference()
    covered = 0
    for _ in range(DATA_SETS):
        tables, models = case.simulate(generator)
        if seed_aware:
            interval, truth = seeds_interval(tables, paired=case.paired), population
        else:
            interval, truth = problems_interval(tables), 100 * models
        covered += interval.low <= truth <= interval.high
    return covered / DATA_SETS


SEED_CASES = [Case(seeds, sd, effect, trained) for seeds in (3, 5) for sd in (0.05, 0.7) for effect in (0.0, 0.4)
              for trained in (True, False)]


@pytest.mark.parametrize("case", SEED_CASES, ids=lambda c: f"S{c.seeds}-sd{c.seed_sd}-d{c.effect}-"
                         f"{'trained' if c.reference_trained else 'base'}")
def test_the_seed_aware_interval_covers_the_population_difference(case: Case) -> None:
    low, high = COVERAGE
    assert low <= coverage(case, seed_aware=True) <= high


def _shape(case: Case) -> str:
    return (f"S{case.seeds}v{case.reference_runs}-sd{case.seed_sd}v{case.reference_sd}-d{case.effect}"
            f"-P{case.problems}")


STUDY_SHAPES = [Case(2, sd, effect, True) for sd in (0.05, 0.7) for effect in (0.0, 0.4)] + [
    Case(4, 0.7, 0.0, True, reference_seeds=5),
    Case(4, 0.05, 0.4, True, reference_seeds=5),
    Case(5, 0.7, 0.0, True, reference_seeds=3),
    Case(4, 0.7, 0.4, True, reference_seeds=3),
    Case(3, 0.7, 0.0, True, problems=500),
    Case(3, 0.05, 0.4, True, problems=500),
]
"""The shapes the Qwen study compares besides 3 and 5 seeds a side: 2 seeds (its 3x budget arm so far), 4 against 5
(a diverged run left out), 5 or 4 against 3 (ClozeMath against Table 4's ablations), 500 problems (the MATH-500 subset
and GSM-Symbolic's sets)."""


@pytest.mark.parametrize("case", STUDY_SHAPES, ids=_shape)
def test_the_seed_aware_interval_covers_at_the_seed_and_problem_counts_a_study_compares(case: Case) -> None:
    low, high = COVERAGE
    assert low <= coverage(case, seed_aware=True) <= high


@pytest.mark.parametrize("case", [Case(5, 0.7, 0.0, True, reference_seed_sd=0.05),
                                  Case(3, 0.7, 0.0, True, reference_seed_sd=0.05),
                                  Case(5, 0.05, 0.4, True, reference_seeds=3, reference_seed_sd=0.7)], ids=_shape)
def test_the_seed_aware_interval_covers_when_one_side_s_seeds_spread_far_more(case: Case) -> None:
    """Welch-Satterthwaite's degrees of freedom run a little short of 95% here (measured 0.943-0.948)."""
    low, high = COVERAGE
    assert low <= coverage(case, seed_aware=True) <= high


def test_at_two_seeds_a_side_with_the_spread_on_one_side_the_interval_covers_a_little_less() -> None:
    """The interval's weak spot: 2 seeds a side, one side's seeds ~7 points apart and the other's ~0.5. Welch-
    Satterthwaite's degrees of freedom (between 1 and 2) are then too many and coverage falls to ~92% (measured 0.916
    here, 0.924 over 2,000 other data sets). Drawing each side's chi-square on its own (the plain generalized pivotal
    quantity) brings this case to 0.936 but widens the equal-spread intervals at 2 seeds up to 2.2-fold (coverage
    0.96-0.98), so the report keeps Welch-Satterthwaite; a verdict at 2 seeds is provisional anyway."""
    assert 0.90 <= coverage(Case(2, 0.7, 0.0, True, reference_seed_sd=0.05), seed_aware=True) <= COVERAGE[1]


@pytest.mark.parametrize("case", [Case(5, 0.7, 0.4, True, paired=True), Case(5, 0.7, 0.0, True, paired=True),
                                  Case(3, 0.2, 0.4, True, paired=True)], ids=["S5-large", "S5-large-null", "S3-small"])
def test_paired_seeds_cover_too(case: Case) -> None:
    """At 3 paired seeds whose shared effect moves accuracy by ~7 points the paired differences are far from normal
    (a seed's shared effect scales its difference) and coverage falls to ~90% (measured: 0.903 and 0.910); such a
    verdict is provisional anyway, having fewer than 5 seeds."""
    low, high = COVERAGE
    assert low <= coverage(case, seed_aware=True) <= high


@pytest.mark.parametrize("case", [Case(3, 0.7, 0.0, True), Case(5, 0.05, 0.4, False)],
                         ids=["S3-large-seeds-null", "S5-small-seeds-base"])
def test_the_problems_interval_covers_the_trained_models_difference(case: Case) -> None:
    low, high = COVERAGE
    assert low <= coverage(case, seed_aware=False) <= high


def test_the_old_seed_bootstrap_would_have_failed_this_test() -> None:
    """The percentile bootstrap over seeds, then problems, that the report used before: below 92% at 3 seeds with
    seed effects like Qwen IT's (it shrinks the seeds' variance by (S - 1) / S and has normal tails). Kept here, not
    in the package, as the evidence that the coverage test can fail."""
    case = Case(3, 0.7, 0.0, False)
    generator = np.random.default_rng(2026)
    truth, covered = 100 * case.population_difference(), 0
    for _ in range(300):
        tables, _ = case.simulate(generator)
        draws = np.random.default_rng(0)
        differences = tables.method - tables.reference  # the base's one run against each seed: 3 x problems
        problem_counts = draws.multinomial(PROBLEMS, np.full(PROBLEMS, 1 / PROBLEMS), size=2000)
        seed_counts = draws.multinomial(3, np.full(3, 1 / 3), size=2000)
        means = ((problem_counts @ differences.T / PROBLEMS) * seed_counts).sum(axis=1) / 3
        low, high = 100 * np.percentile(means, [2.5, 97.5])
        covered += low <= truth <= high
    assert covered / 300 < COVERAGE[0]
