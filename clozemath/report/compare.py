"""Which differences between methods are more than noise: each pair of methods on every (eval set, decoding), the
difference with its seed-aware and problems-only intervals (`clozemath.intervals`) from the per-problem
predictions, and the paper's orderings and claims (Tables 1-4, Figure 3) against them (`clozemath.claims`)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from clozemath.claims import (
    NOT_RUN, PAPER_CLAIMS, PAPER_GSM8K, Claim, ClaimCheck, Comparison, claims_list, orderings_paragraph,
    paper_pairs,
)
from clozemath.intervals import BySeed, problems_difference, seeds_difference
from clozemath.report.artifacts import PredictionArtifacts
from clozemath.report.figure import Curves, CurvePoint
from clozemath.report.names import (
    BASE_DECODING,
    REFERENCES,
    REPLICATION_METHODS,
    REPLICATION_NAMES,
    Block,
    Column,
    column_name,
    method_name,
    model_name,
    ordered,
    split_variant,
    with_variant,
)
from clozemath.report.runs import TrialResult, accuracy_metric, blocks, eval_columns, measured_on, percents


def _by_seed(trials: list[TrialResult], column: Column, artifacts: PredictionArtifacts) -> BySeed | None:
    """Seed -> per-problem correctness of these trials; None when one of them has no predictions."""
    found = {}
    for r in trials:
        correctness = artifacts.correctness(r.run_id, column)
        if correctness is None:
            return None
        found[r.seed] = correctness
    return found


def _compared_pairs(measured: set[str]) -> list[tuple[str, str]]:
    """The (method, reference) pairs of one evaluation: every pair the paper's numbers order, its better method
    first (`clozemath.claims`); the same pairs among the methods of each grid variant (`clozemath (arm=budget3x)`
    against `mft (arm=budget3x)`: whether a budget arm changes a verdict); each variant's method against the same
    method without it (`clozemath (arm=budget3x)` against `clozemath`: what the arm does to that method); then each
    other trained method (a grid's variant) against IT and against base."""
    pairs = paper_pairs(measured, REPLICATION_METHODS)
    others = ordered(measured - set(PAPER_GSM8K) - {"base"}, REPLICATION_METHODS)
    variants: dict[str, set[str]] = {}
    for method in others:
        name, variant = split_variant(method)
        variants.setdefault(variant, set()).add(name)
    within = [(with_variant(better, variant), with_variant(worse, variant)) for variant, names in variants.items()
              if variant for better, worse in paper_pairs(names, REPLICATION_METHODS)]
    own = [(method, name) for method in others for name, variant in [split_variant(method)]
           if variant and name in measured and name not in REFERENCES]
    return pairs + within + own + [(method, reference) for method in others for reference in REFERENCES
                                   if reference in measured]


def trains(method: str) -> bool:
    """Whether the method's runs were trained (each seed a model of its own); a base model is one untrained run."""
    return split_variant(method)[0] != "base"


def _pairs_seeds(trials: list[TrialResult]) -> bool:
    """Every trial declares its seeds paired with the other methods' by design (`train.paired_seeds`)."""
    return bool(trials) and all(r.params.get("train.paired_seeds") == "True" for r in trials)


def _trained_seeds(method: str, reference: str, compared: BySeed, against: BySeed) -> int:
    counts = [len(runs) for name, runs in ((method, compared), (reference, against)) if trains(name)]
    return min(counts, default=0)


def _compare(trials: list[TrialResult], method: str, reference: str, column: Column,
             artifacts: PredictionArtifacts, reference_column: Column | None = None) -> Comparison:
    """`method` on `column` against `reference` on the same, or on `reference_column` (a base model decoded as the
    harness decodes it, against a trained method's beams: Table 1's comparison)."""
    against_column = reference_column or column
    compared, against = measured_on(trials, method, column), measured_on(trials, reference, against_column)
    gap = statistics.fmean(percents(compared, column)) - statistics.fmean(percents(against, against_column))
    compared_seeds = _by_seed(compared, column, artifacts)
    against_seeds = _by_seed(against, against_column, artifacts)
    if compared_seeds is None or against_seeds is None:
        seeds = min((len({r.seed for r in side}) for name, side in ((method, compared), (reference, against))
                     if trains(name)), default=0)
        return Comparison(column, method, reference, gap, None, None, "no per-problem predictions", seeds)
    trained_seeds = _trained_seeds(method, reference, compared_seeds, against_seeds)
    paired = _pairs_seeds(compared + against) and trains(method) and trains(reference)
    seeds = seeds_difference(compared_seeds, against_seeds, method_trained=trains(method),
                             reference_trained=trains(reference), paired=paired)
    problems = problems_difference(compared_seeds, against_seeds)
    missing = ""
    if problems is None:
        missing = "the runs share no problem"
    elif seeds is None:
        missing = "one seed of a trained method: its seed-to-seed variance is unknown"
    return Comparison(column, method, reference, gap, seeds, problems, missing, trained_seeds)


def comparisons(results: list[TrialResult], artifacts: PredictionArtifacts, decoding: str | None = None
                ) -> dict[Block, list[Comparison]]:
    """Per training set and model, on every (eval set, decoding): each pair of methods the paper orders, and each
    other trained method against IT and base. With `decoding` (the report's, of Tables 1, 3 and 4), a base model
    that was decoded only as the harness decodes it (`BASE_DECODING`) is compared there too, as those tables set it
    beside the trained methods' `decoding`."""
    found: dict[Block, list[Comparison]] = {}
    for block, trials in blocks(results).items():
        found[block] = []
        for column in eval_columns(trials):
            measured = {r.method for r in trials if accuracy_metric(column) in r.metrics}
            base_column = (column[0], BASE_DECODING)
            across = (column[1] == decoding != BASE_DECODING and "base" not in measured
                      and bool(measured_on(trials, "base", base_column)))
            pairs = _compared_pairs(measured | {"base"} if across else measured)
            found[block] += [_compare(trials, method, reference, column, artifacts,
                                      base_column if across and reference == "base" else None)
                             for method, reference in pairs if not (across and method == "base")]
    return found


def orderings(found: dict[Block, list[Comparison]], decoding: str, results: list[TrialResult]) -> str:
    """The paper's orderings against this replication on GSM8K-trained runs evaluated on GSM8K with `decoding` (else
    greedy): a paragraph per model (`clozemath.claims.orderings_paragraph`); where there is none, why (`results`: the
    trials reported)."""
    paragraphs = []
    for (train_set, model), rows in found.items():
        if train_set != "gsm8k":
            continue
        decodings = [d for d in (decoding, BASE_DECODING) if any(c.evaluation == ("gsm8k", d) for c in rows)]
        if not decodings:
            continue
        evaluation = ("gsm8k", decodings[0])
        paired = [c for c in rows if c.evaluation == evaluation and (c.method, c.reference) in
                  paper_pairs({c.method, c.reference}, REPLICATION_METHODS)]
        text = orderings_paragraph(paired, lambda m: method_name(m, REPLICATION_NAMES),
                                   f"{column_name(evaluation)} ({model_name(model)})")
        if text:
            paragraphs.append(text)
    return "\n\n".join(paragraphs) or no_orderings(results, decoding)


def no_orderings(results: list[TrialResult], decoding: str) -> str:
    """Why the trials give none of the paper's orderings to check, in a sentence."""
    heading = "**The paper's orderings:** none to check here"
    if not results:
        return f"{heading}: no trial to report."
    gsm8k = [r for r in results if r.train_set == "gsm8k"]
    if not gsm8k:
        sets = ", ".join(sorted({r.train_set for r in results}))
        return f"{heading}: the paper orders methods trained on GSM8K, and these trials trained on {sets}."
    decodings = list(dict.fromkeys((decoding, BASE_DECODING)))
    if not any(accuracy_metric(("gsm8k", d)) in r.metrics for d in decodings for r in gsm8k):
        return (f"{heading}: no trial trained on GSM8K was evaluated on GSM8K test with {' or '.join(decodings)} "
                "decoding.")
    methods = ordered({r.method for r in gsm8k}, REPLICATION_METHODS)
    paper = [m for m in methods if m in PAPER_GSM8K]
    if len(paper) < 2:
        known = ", ".join(method_name(m, REPLICATION_NAMES) for m in ordered(PAPER_GSM8K, REPLICATION_METHODS))
        ran = ", ".join(method_name(m, REPLICATION_NAMES) for m in methods)
        return (f"{heading}: the paper orders pairs of {known}, each pair of one model on one decoding; these trials "
                f"ran {ran}{' alone' if len(methods) == 1 else ''}. A grid of two or more of them (e.g. "
                "`configs/grids/replication.yaml`) gives its verdicts.")
    decoded = "; ".join(
        f"{method_name(m, REPLICATION_NAMES)}: "
        + ", ".join(sorted({c[1] for r in gsm8k if r.method == m for c in eval_columns([r]) if c[0] == "gsm8k"}))
        for m in paper)
    return (f"{heading}: the paper orders methods of one model decoded alike on GSM8K test, and no two of these were "
            f"({decoded}).")


@dataclass(frozen=True)
class NoiseFloor:
    """How much one training run differs from its repetition (same config, same seed: `train.rerun`) on one
    evaluation: the floor under which a difference between methods could be the machine's, not the method's."""

    evaluation: Column
    method: str
    pairs: int
    """(seed, rerun) pairs against that seed's rerun 0."""
    mean_gap: float
    """Mean absolute accuracy difference, points."""
    max_gap: float
    differing: float | None
    """Share of the problems whose verdict differs between the two runs, percent (None without predictions)."""


def noise_floors(results: list[TrialResult], artifacts: PredictionArtifacts) -> dict[Block, list[NoiseFloor]]:
    """Per training set and model, every method and evaluation whose seeds were rerun (`train.rerun` > 0): each
    rerun against its seed's rerun 0."""
    found: dict[Block, list[NoiseFloor]] = {}
    for block, trials in blocks(results).items():
        rows = []
        for column in eval_columns(trials):
            for method in ordered({r.method for r in trials}, REPLICATION_METHODS):
                runs = measured_on(trials, method, column)
                first = {r.seed: r for r in runs if r.rerun == 0}
                pairs = [(first[r.seed], r) for r in runs if r.rerun > 0 and r.seed in first]
                if pairs:
                    rows.append(_noise_floor(column, method, pairs, artifacts))
        if rows:
            found[block] = rows
    return found


def _noise_floor(column: Column, method: str, pairs: list[tuple[TrialResult, TrialResult]],
                 artifacts: PredictionArtifacts) -> NoiseFloor:
    gaps = [abs(a - b) for first, again in pairs for a, b in [percents([first, again], column)]]
    shares = []
    for first, again in pairs:
        one, two = artifacts.correctness(first.run_id, column), artifacts.correctness(again.run_id, column)
        if one is None or two is None:
            break
        shared = set(one) & set(two)
        shares.append(100 * sum(one[i] != two[i] for i in shared) / len(shared) if shared else 0.0)
    differing = statistics.fmean(shares) if len(shares) == len(pairs) else None
    return NoiseFloor(column, method, len(pairs), statistics.fmean(gaps), max(gaps), differing)


def paper_claims(found: dict[Block, list[Comparison]], curves: Curves, decoding: str) -> str:
    """Every claim of the paper's Tables 1-4 and Figure 3 against each model's runs (`clozemath.claims.claims_list`):
    the comparison of the claim's methods on its evaluation with `decoding` (else greedy, as base models are
    decoded; Table 2's with CoT-decoding), the same among each grid variant's runs, and Figure 3's curves described;
    nothing for a model whose runs test none of them."""
    models = ordered({model for _, model in found} | set(curves), ())
    lists = []
    for model in models:
        checks = [_claim_check(claim, found.get((claim.train_set, model), []), curves.get(model, {}), decoding)
                  for claim in PAPER_CLAIMS]
        if all(check.verdict == NOT_RUN for check in checks):  # runs of none of the claims' methods: no list
            continue
        lists.append(claims_list(checks, lambda m: method_name(m, REPLICATION_NAMES), column_name, model_name(model)))
    return "\n\n".join(lists)


def _claim_check(claim: Claim, rows: list[Comparison], curves: dict[str, list[CurvePoint]], decoding: str
                 ) -> ClaimCheck:
    if claim.source == "Figure 3":
        return ClaimCheck(claim, described=_curves_described(curves.get(claim.better), curves.get(claim.worse)))
    decodings = [claim.decoding] if claim.decoding else [decoding, BASE_DECODING]

    def find(better: str, worse: str) -> Comparison | None:
        return next((c for d in decodings for c in rows if c.evaluation == (claim.eval_set, d)
                     and (c.method, c.reference) == (better, worse)), None)

    variants = ordered({split_variant(c.method)[1] for c in rows} - {""}, ())
    arms = tuple((variant, arm) for variant in variants
                 if (arm := find(with_variant(claim.better, variant), with_variant(claim.worse, variant))) is not None)
    return ClaimCheck(claim, find(claim.better, claim.worse), arms)


def _curves_described(better: list[CurvePoint] | None, worse: list[CurvePoint] | None) -> str:
    """Figure 3's claim as the curves show it: at how many shared checkpoints the better method's mean over seeds is
    above, and the first and last of them ("" when either method has no curve: the claim is then not run)."""
    if not better or not worse:
        return ""
    shared = list(zip(better, worse))
    above = sum(b.mean > w.mean for b, w in shared)
    (first_b, first_w), (last_b, last_w) = shared[0], shared[-1]
    return (f"above at {above} of {len(shared)} checkpoints (means over {first_b.seeds} and {first_w.seeds} seeds: "
            f"{first_b.mean:.1f} vs {first_w.mean:.1f} at the first, step {first_b.step:.0f}; {last_b.mean:.1f} vs "
            f"{last_w.mean:.1f} at the last, step {last_b.step:.0f}); the curves keep accuracies, not predictions")
