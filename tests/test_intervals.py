"""The report's intervals on hand-made correctness (`clozemath.intervals`); their coverage is simulated in
`test_interval_coverage.py`."""

from __future__ import annotations

import math

import numpy as np
import pytest

from clozemath.intervals import problems_difference, seeds_difference


def right_on(count: int, problems: int, offset: int = 0) -> dict[str, bool]:
    """Correctness on `problems` problems `p000`...: right on `count` of them, from `offset` on."""
    return {f"p{i:05d}": offset <= i < offset + count for i in range(problems)}


T_975 = {2: 4.302653, 4: 2.776445}
"""Student's t, 97.5th percentile, by degrees of freedom (printed tables)."""


def test_identical_predictions_differ_by_zero_with_a_zero_interval_over_problems() -> None:
    runs = {"0": right_on(30, 100), "1": right_on(50, 100, offset=20)}
    difference = problems_difference(runs, runs)
    assert difference is not None
    assert (difference.points, difference.low, difference.high) == (0, 0, 0)
    assert (difference.method_runs, difference.reference_runs, difference.problems) == (2, 2, 100)


def test_right_where_the_reference_is_always_wrong_is_plus_100() -> None:
    difference = problems_difference({"0": right_on(40, 40)}, {"0": right_on(0, 40)})
    assert difference is not None
    assert (difference.points, difference.low, difference.high) == (100, 100, 100) and difference.excludes_zero


def test_a_clear_difference_on_many_problems_excludes_zero() -> None:
    """Right on 600 of 1,000 problems, the reference on 500 of them: +10 points; the bootstrap sd of a mean of 0/1
    differences with p = 0.1 is sqrt(0.1 * 0.9 / 1000) = 0.949 points, so the interval is about 10 ± 1.86."""
    difference = problems_difference({"0": right_on(600, 1000)}, {"0": right_on(500, 1000)})
    assert difference is not None and difference.points == pytest.approx(10)
    half_width = 1.96 * 100 * math.sqrt(0.1 * 0.9 / 1000)
    assert difference.low == pytest.approx(10 - half_width, abs=0.3)
    assert difference.high == pytest.approx(10 + half_width, abs=0.3)
    assert difference.excludes_zero


def test_one_more_right_answer_in_20_problems_is_not_a_real_difference() -> None:
    """+5 points. A resample misses that problem with probability (19/20)^20 = 0.36 > 2.5%, so the low end is 0;
    the problem is drawn k ~ Binomial(20, 1/20) times, P(k <= 2) = 0.92 < 97.5% <= P(k <= 3) = 0.98: high = 15."""
    difference = problems_difference({"0": right_on(6, 20)}, {"0": right_on(5, 20)})
    assert difference is not None
    assert (difference.points, difference.low, difference.high) == (pytest.approx(5), 0, pytest.approx(15))
    assert not difference.excludes_zero


def test_the_problems_interval_matches_resampling_problem_indices() -> None:
    """The module draws counts per distinct value; resampling 1,319 problem ids directly gives the same interval."""
    generator = np.random.default_rng(7)
    ids = [f"q{i}" for i in range(1319)]
    method = {s: dict(zip(ids, map(bool, generator.random(1319) < 0.4))) for s in "012"}
    reference = {s: dict(zip(ids, map(bool, generator.random(1319) < 0.35))) for s in "01"}
    per_problem = (np.mean([[method[s][i] for i in ids] for s in "012"], axis=0)
                   - np.mean([[reference[s][i] for i in ids] for s in "01"], axis=0))
    resampled = per_problem[np.random.default_rng(1).integers(0, 1319, size=(10_000, 1319))].mean(axis=1)
    low, high = 100 * np.percentile(resampled, [2.5, 97.5])
    difference = problems_difference(method, reference)
    assert difference is not None and difference.points == pytest.approx(100 * per_problem.mean())
    assert (difference.low, difference.high) == (pytest.approx(low, abs=0.15), pytest.approx(high, abs=0.15))


def test_only_the_problems_every_run_answered_are_compared() -> None:
    reference = {**right_on(0, 10), "extra": True}
    difference = problems_difference({"0": right_on(10, 10)}, {"0": reference, "1": right_on(0, 10)})
    assert difference is not None and difference.problems == 10 and difference.points == 100


def test_seeds_are_not_paired_by_name_unless_declared() -> None:
    """Methods trained apart share nothing at equal seed numbers: relabelling one side's seeds changes nothing, and
    sides whose seeds carry different names still compare (the old pairing by name found no pair there)."""
    method = {"0": right_on(200, 1000), "1": right_on(400, 1000), "2": right_on(300, 1000)}
    reference = {"0": right_on(150, 1000), "1": right_on(350, 1000), "2": right_on(250, 1000)}
    relabelled = {"7": reference["0"], "8": reference["2"], "9": reference["1"]}
    assert seeds_difference(method, reference) == seeds_difference(method, relabelled)
    assert problems_difference(method, reference) == problems_difference(method, relabelled)


def test_paired_seeds_cancel_what_each_pair_shares() -> None:
    """Seed s of both methods moves them alike (accuracies 20/40/30 against 15/35/25): +5 every pair. Unpaired,
    the seeds' spread (sd 10 points a side) swamps the +5; paired, the pairs agree and the interval is the
    problems' alone, near +5 and above 0."""
    method = {"0": right_on(200, 1000), "1": right_on(400, 1000), "2": right_on(300, 1000)}
    reference = {"0": right_on(150, 1000), "1": right_on(350, 1000), "2": right_on(250, 1000)}
    unpaired = seeds_difference(method, reference)
    paired = seeds_difference(method, reference, paired=True)
    assert unpaired is not None and paired is not None and paired.paired and not unpaired.paired
    assert unpaired.points == paired.points == pytest.approx(5)
    assert unpaired.low < 0 < unpaired.high
    assert 0 < paired.low < 5 < paired.high < 10


def test_with_seeds_far_apart_the_interval_is_students_t_over_them() -> None:
    """A base model (one untrained run, right on none of 10,000 problems) against three seeds right on 20%, 40% and
    60%: +40 points; the problems add almost nothing (their part of the variance is ~1e-5 against the seeds'
    0.04 / 3), so the interval is 40 ± t(2) * sqrt(0.04 / 3) * 100 = 40 ± 49.7, to a tenth of a point."""
    method = {"0": right_on(2000, 10_000), "1": right_on(4000, 10_000), "2": right_on(6000, 10_000)}
    base = {"0": right_on(0, 10_000)}
    difference = seeds_difference(method, base, reference_trained=False)
    assert difference is not None and difference.points == pytest.approx(40)
    half_width = T_975[2] * math.sqrt(0.04 / 3) * 100
    assert difference.low == pytest.approx(40 - half_width, abs=0.1)
    assert difference.high == pytest.approx(40 + half_width, abs=0.1)
    assert not difference.excludes_zero


def test_two_trained_sides_far_apart_take_welchs_degrees_of_freedom() -> None:
    """Three seeds a side at 20/40/60% and 10/30/50% (equal spreads): +10 points; Welch's degrees of freedom are
    2 + 2 = 4, so the interval is 10 ± t(4) * sqrt(0.04 / 3 + 0.04 / 3) * 100 = 10 ± 45.3, to a tenth of a point."""
    method = {"0": right_on(2000, 10_000), "1": right_on(4000, 10_000), "2": right_on(6000, 10_000)}
    reference = {"0": right_on(1000, 10_000), "1": right_on(3000, 10_000), "2": right_on(5000, 10_000)}
    difference = seeds_difference(method, reference)
    assert difference is not None and difference.points == pytest.approx(10)
    half_width = T_975[4] * math.sqrt(2 * 0.04 / 3) * 100
    assert difference.low == pytest.approx(10 - half_width, abs=0.1)
    assert difference.high == pytest.approx(10 + half_width, abs=0.1)


def test_the_seed_intervals_ends_are_the_pivotal_quantitys_quantiles_to_a_thousandth_of_a_point() -> None:
    """A verdict is the sign of an end, so the ends are computed, not drawn (10,000 draws once put an end at -0.0014
    where it lay at +0.015). Sides of 2 and 3 seeds, 1,319 problems, the problems' part and the seeds' alike in size
    (Welch-Satterthwaite's degrees of freedom between 1 and 3): the ends against the quantile found by adaptive
    quadrature over the chi-square's density, with the parts estimated here from the tables as the module defines
    them."""
    from scipy import integrate, optimize, special, stats

    generator = np.random.default_rng(11)
    ids = [f"q{i}" for i in range(1319)]
    method = {s: dict(zip(ids, map(bool, generator.random(1319) < p))) for s, p in (("0", 0.52), ("1", 0.56))}
    reference = {s: dict(zip(ids, map(bool, generator.random(1319) < p)))
                 for s, p in (("0", 0.50), ("1", 0.47), ("2", 0.53))}
    difference = seeds_difference(method, reference)
    assert difference is not None

    tables = [np.array([[float(side[s][i]) for i in ids] for s in sorted(side)]) for side in (method, reference)]
    per_problem = tables[0].mean(axis=0) - tables[1].mean(axis=0)
    problems_part = per_problem.var(ddof=1) / len(ids)
    parts = []
    for table in tables:
        runs = len(table)
        residual = table - table.mean(axis=1, keepdims=True) - table.mean(axis=0, keepdims=True) + table.mean()
        noise = (residual**2).sum() / ((runs - 1) * (len(ids) - 1))
        parts.append((max(0.0, table.mean(axis=1).var(ddof=1) - noise / len(ids)) / runs, runs - 1))
    seeds_part = sum(part for part, _ in parts)
    df = seeds_part**2 / sum(part**2 / freedom for part, freedom in parts)
    assert 1 < df < 3 and 0.2 < seeds_part / problems_part < 5

    def coverage(q: float) -> float:
        def density(v: float) -> float:
            return (2 * special.ndtr(q / np.sqrt(problems_part + seeds_part * df / v)) - 1) * stats.chi2.pdf(v, df)
        return integrate.quad(density, 0, np.inf, limit=200)[0] - 0.95

    half = 100 * optimize.brentq(coverage, 1e-6, 10.0, xtol=1e-12)
    assert difference.points == pytest.approx(100 * per_problem.mean())
    assert difference.low == pytest.approx(difference.points - half, abs=1e-3)
    assert difference.high == pytest.approx(difference.points + half, abs=1e-3)


def test_seeds_that_agree_add_nothing_beyond_the_problems() -> None:
    """Every seed gives the same answers: the seed-by-problem noise is counted once, so the seed-aware interval is the
    problems' one (up to the bootstrap's draws), not wider (the old hierarchical bootstrap counted it twice)."""
    generator = np.random.default_rng(3)
    answers = generator.random(1319) < 0.55
    reference_answers = generator.random(1319) < 0.5
    ids = [f"q{i}" for i in range(1319)]
    method = {s: dict(zip(ids, map(bool, answers))) for s in "01234"}
    reference = {s: dict(zip(ids, map(bool, reference_answers))) for s in "01234"}
    seeds, problems = seeds_difference(method, reference), problems_difference(method, reference)
    assert seeds is not None and problems is not None
    assert seeds.low == pytest.approx(problems.low, abs=0.2) and seeds.high == pytest.approx(problems.high, abs=0.2)


def test_a_trained_side_with_one_seed_has_no_seed_aware_interval() -> None:
    """Its seed-to-seed variance cannot be estimated from one run; an untrained base model's one run has none."""
    three = {s: right_on(100 + 10 * int(s), 400) for s in "012"}
    one = {"0": right_on(90, 400)}
    assert seeds_difference(three, one) is None
    assert seeds_difference(one, three) is None
    assert seeds_difference(three, one, reference_trained=False) is not None
    assert problems_difference(three, one) is not None
