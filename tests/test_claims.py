"""The paper's claims (Tables 1-4, Figure 3) against a replication's runs (`clozemath.claims`, `paper_claims` of
`clozemath report`'s summary): each claim's verdict from the seed-aware interval on its own evaluation, a budget arm's
verdict beside it and whether it changes the matched one, Figure 3 from the curves, and the claims no run tested."""

from __future__ import annotations

from clozemath.claims import PAPER_CLAIMS, PAPER_MODELS
from clozemath.records import ACCURACY, eval_metric
from clozemath.report import TrialResult
from clozemath.report.compare import comparisons, paper_claims
from clozemath.report.figure import CurvePoint

PROBLEMS = 400


def right_on(count: int, offset: int = 0) -> dict[str, bool]:
    """Right on problems [offset, offset + count) of `PROBLEMS`."""
    return {f"p{i:03d}": offset <= i < offset + count for i in range(PROBLEMS)}


class Predictions:
    """Each run's per-problem correctness by (set, decoding), as `PredictionArtifacts.correctness` gives it."""

    def __init__(self) -> None:
        self.found: dict[tuple[str, tuple[str, str]], dict[str, bool]] = {}

    def correctness(self, run_id: str, column: tuple[str, str]) -> dict[str, bool] | None:
        return self.found.get((run_id, column))


def trials(predictions: Predictions, method: str, right: dict[tuple[str, str], list[int]]) -> list[TrialResult]:
    """One GSM8K-trained run a seed of `method`, right on `right[column][seed]` problems of each evaluation."""
    seeds = len(next(iter(right.values())))
    found = []
    for seed in range(seeds):
        run_id = f"{method}/{seed}"
        metrics = {}
        for column, counts in right.items():
            predictions.found[run_id, column] = right_on(counts[seed], offset=seed)
            metrics[eval_metric(*column, ACCURACY)] = counts[seed] / PROBLEMS
        found.append(TrialResult(run_id, "qwen2.5-coder-1.5b-instruct", method, "gsm8k", str(seed), metrics))
    return found


def test_each_claim_is_judged_on_its_own_evaluation_and_a_budget_arm_that_changes_it_is_named() -> None:
    """Five seeds each, 400 problems. On GSM8K beam ClozeMath is right on 280 and MFT on 200: Table 1's claim holds
    (+20 points). On CoT-decoding ClozeMath is 40 below MFT: Table 2's claim is reversed. Base ran greedy only (as
    the harness decodes it), so Table 1's MFT > Base sets MFT's beams beside it, as Table 1 does (MFT 200 with beam,
    base 100: holds, +25 points; MFT's greedy would give the same here, so the line's numbers tell). At 3x the budget (arm=budget3x) ClozeMath
    and MFT tie on GSM8K beam: that arm changes Table 1's verdict, and the list says so. Figure 3: ClozeMath below
    MFT at the first of two checkpoints, above at the last. Nothing trained on MATH: its claims are not run yet."""
    predictions = Predictions()
    beam, greedy, cot = ("gsm8k", "beam"), ("gsm8k", "greedy"), ("gsm8k", "cot")
    results = [
        *trials(predictions, "clozemath", {beam: [280] * 5, greedy: [250] * 5, cot: [160] * 5}),
        *trials(predictions, "mft", {beam: [200] * 5, greedy: [160] * 5, cot: [200] * 5}),
        *trials(predictions, "base", {greedy: [100]}),
        *trials(predictions, "clozemath (arm=budget3x)", {beam: [240] * 5}),
        *trials(predictions, "mft (arm=budget3x)", {beam: [240] * 5}),
    ]
    found = comparisons(results, predictions, "beam")
    pairs = {(c.method, c.reference, c.evaluation) for rows in found.values() for c in rows}
    assert ("clozemath (arm=budget3x)", "mft (arm=budget3x)", beam) in pairs  # the arm compared within itself
    assert ("mft", "base", beam) in pairs and ("mft", "base", greedy) in pairs and ("mft", "base", cot) not in pairs
    curves = {"qwen2.5-coder-1.5b-instruct": {
        "clozemath": [CurvePoint(28, 30.0, 28.0, 32.0, 5), CurvePoint(284, 55.0, 54.0, 56.0, 5)],
        "mft": [CurvePoint(28, 50.0, 49.0, 51.0, 5), CurvePoint(284, 50.0, 48.0, 52.0, 5)]}}
    text = paper_claims(found, curves, "beam")
    lines = text.splitlines()
    assert lines[0].startswith("**The paper's claims on Qwen2.5-Coder-1.5B-Instruct**")
    groups: dict[str, list[str]] = {}
    counts: dict[str, int] = {}
    for line in lines[1:]:
        if line.startswith("- ") and line.endswith(":"):  # "- Hold, 2:", its claims below it
            heading, _, count = line[2:-1].rpartition(", ")
            group, counts[heading] = groups.setdefault(heading, []), int(count)
        elif line.startswith("  - "):
            group.append(line[4:])
    assert counts == {heading: len(claims) for heading, claims in groups.items()}

    def under(heading: str) -> list[str]:
        return groups[heading]

    held = under("Hold")
    assert len(held) == 2
    assert held[0].startswith("Table 1 (GSM8K-trained, GSM8K beam): ClozeMath > MFT. Paper: 74.22 vs 70.20 on "
                              "DeepSeek-Math-7B; ahead on 4 of 4 models. Here: +20.00 [")
    assert "5 and 5 runs × 400 problems." in held[0] and "provisional" not in held[0]
    assert " At arm=budget3x: not resolved, +0.00 [" in held[0]
    assert held[1].startswith("Table 1 (GSM8K-trained, GSM8K beam): MFT > Base. Paper: 70.20 vs 59.21")
    assert "Here: +25.00 [" in held[1] and "5 and 1 runs × 400 problems." in held[1]
    (reversed_one,) = under("Reversed")
    assert reversed_one.startswith("Table 2 (GSM8K-trained, GSM8K cot): ClozeMath > MFT. Paper: 77.10 vs "
                                           "76.50 on DeepSeek-Math-7B; ahead on 4 of 4 models. Here: -10.00 [")
    (figure,) = under("Described (no interval)")
    assert figure.endswith("Here: above at 1 of 2 checkpoints (means over 5 and 5 seeds: 30.0 vs 50.0 at the first, "
                           "step 28; 55.0 vs 50.0 at the last, step 284); the curves keep accuracies, not predictions.")
    not_run = under("Not run yet")
    assert ("Table 1 (MATH-trained, MATH): ClozeMath > MFT. Paper: 36.90 vs 33.42 on DeepSeek-Math-7B; ahead on 4 of "
            "4 models.") in not_run
    assert len(not_run) == len(PAPER_CLAIMS) - 4  # all but Table 1's two on GSM8K, Table 2 and Figure 3
    assert lines[-1] == ("- Grid variants (arm=budget3x) change the verdict of Table 1 ClozeMath > MFT "
                         "(arm=budget3x).")


def test_runs_that_test_none_of_the_claims_give_no_list() -> None:
    """Two seeds of IT alone (no pair the paper orders, no curve): the summary gets no list of sixteen claims not
    run."""
    predictions = Predictions()
    found = comparisons(trials(predictions, "it", {("gsm8k", "greedy"): [200, 210]}), predictions)
    assert paper_claims(found, {}, "beam") == ""


def test_the_paper_side_of_every_claim_is_its_tables_numbers() -> None:
    """Each claim with numbers gives one a model of the paper (Table 4: DeepSeek-Math-7B alone), and says on how many
    of them the paper's better method was ahead: Table 3's P2 after GSM8K training is the one where MFT led on
    DeepSeek-Math-7B (20.20 against 20.00)."""
    for claim in PAPER_CLAIMS:
        if claim.statement:
            continue
        assert len(claim.paper_better) == len(claim.paper_worse) in (1, len(PAPER_MODELS)), claim
    p2 = next(c for c in PAPER_CLAIMS if (c.source, c.train_set, c.eval_set) == ("Table 3", "gsm8k", "gsm_p2"))
    assert p2.paper_text() == "20.00 vs 20.20 on DeepSeek-Math-7B; ahead on 3 of 4 models"
    assert [c.worse for c in PAPER_CLAIMS if c.source == "Table 4"] == [
        "it_prefixlm", "clozemath_causal", "it", "random_span"]


def test_a_budget_arms_method_is_compared_with_the_same_method_without_the_arm() -> None:
    """Five seeds each, 400 problems, GSM8K beam. MFT at 3x the budget is right on 240, MFT on 200: the arm's MFT is
    compared with MFT, +10 points, an interval that excludes 0. IT at 3x is compared with IT once (IT is every
    method's reference anyway). ClozeMath at 3x has no ClozeMath without the arm here, so no such pair."""
    predictions = Predictions()
    beam = ("gsm8k", "beam")
    results = [
        *trials(predictions, "it", {beam: [220] * 5}),
        *trials(predictions, "mft", {beam: [200] * 5}),
        *trials(predictions, "it (arm=budget3x)", {beam: [210] * 5}),
        *trials(predictions, "mft (arm=budget3x)", {beam: [240] * 5}),
        *trials(predictions, "clozemath (arm=budget3x)", {beam: [230] * 5}),
    ]
    rows = [c for found in comparisons(results, predictions).values() for c in found]
    (mft,) = [c for c in rows if (c.method, c.reference) == ("mft (arm=budget3x)", "mft")]
    assert round(mft.gap, 6) == 10.0
    assert mft.seeds is not None and mft.seeds.excludes_zero and mft.seeds.low > 0
    assert [c.reference for c in rows if c.method == "it (arm=budget3x)"].count("it") == 1
    assert not [c for c in rows if (c.method, c.reference) == ("clozemath (arm=budget3x)", "clozemath")]


def test_an_arm_of_one_seed_has_no_verdict_changes_none_and_gives_its_runs_interval_over_the_problems() -> None:
    """The paper's arm runs one seed a method. ClozeMath at arm=paper is right on problems 0-239, MFT at arm=paper on
    0-229: 10 problems of 400 apart, every one ClozeMath's, so over the problems alone these two runs differ by +2.50
    points with an interval above 0. But one seed's seed-to-seed variance is unknown: the arm's claim has no
    verdict and cannot change the matched runs' (Table 1 holds at +20 there), and the last line says so rather than
    count it as a change."""
    predictions = Predictions()
    beam = ("gsm8k", "beam")
    results = [
        *trials(predictions, "clozemath", {beam: [280] * 5}),
        *trials(predictions, "mft", {beam: [200] * 5}),
        *trials(predictions, "clozemath (arm=paper)", {beam: [240]}),
        *trials(predictions, "mft (arm=paper)", {beam: [230]}),
    ]
    lines = paper_claims(comparisons(results, predictions), {}, "beam").splitlines()
    (table1,) = [line for line in lines if line.startswith("  - Table 1 (GSM8K-trained, GSM8K beam)")]
    matched, _, arm = table1.partition(" At arm=paper: ")
    assert "Here: +20.00 [" in matched
    assert arm.startswith("not tested, +2.50, no interval: one seed of a trained method")
    low, high = (float(x) for x in arm.split("over the problems alone, these runs held fixed: [")[1]
                 .split("]")[0].split(", "))
    assert 0 < low < 2.5 < high, arm
    assert arm.endswith("1 and 1 runs × 400 problems."), arm
    assert lines[-1] == ("- Grid variants (arm=paper) change the verdict of none of the claims they judged; "
                         "arm=paper left 1 claim unjudged (no interval).")
