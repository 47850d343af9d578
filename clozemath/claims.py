"""The paper's orderings of methods, and whether a replication's comparisons bear them out (`clozemath report`).

The paper reports every method of ours only for DeepSeek-Math-7B on GSM8K (beam search): Base, MFT and ClozeMath in
Table 1, the ablations, IT among them, in Table 4. Its numbers order each pair of methods; a replication's difference
for that pair, with its seed-aware interval (`clozemath.intervals.seeds_difference`), either holds the paper's order
(the interval is above 0), reverses it (below 0), or cannot tell (the interval holds 0). A verdict resting on fewer
than `MIN_SEEDS` seeds of a trained method is provisional, and says so.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass

from clozemath.intervals import MIN_SEEDS, Difference

PAPER_GSM8K = {
    "clozemath": 74.22, "clozemath_causal": 72.71, "it_prefixlm": 71.79, "it": 71.57, "random_span": 71.19,
    "mft": 70.20, "base": 59.21,
}
"""DeepSeek-Math-7B-base on GSM8K test, accuracy in percent, beam search (5 beams): Table 1 (Base, MFT, ClozeMath;
Base few-shot through lm-evaluation-harness) and Table 4 (W/o Text infilling = it_prefixlm, W/o PrefixLM =
clozemath_causal, W/o Text-infilling & W/o PrefixLM = it, W/o Equation masking = random_span). By these numbers IT
(71.57) is above MFT (70.20); the paper states no comparison of the two."""
PAPER_SETTING = "DeepSeek-Math-7B, GSM8K, beam search (Tables 1 and 4)"

HOLDS, REVERSED, UNRESOLVED, UNTESTED = "holds", "reversed", "not resolved", "not tested"
JUDGED = (HOLDS, REVERSED, UNRESOLVED)


@dataclass(frozen=True)
class Comparison:
    """Method minus reference on one evaluation (set, decoding), in points: the difference of the means over seeds,
    and the two intervals where per-problem predictions allow them."""

    evaluation: tuple[str, str]
    method: str
    reference: str
    gap: float
    seeds: Difference | None
    """Over seeds and problems: what a verdict rests on."""
    problems: Difference | None
    """Over problems, the trained models held fixed."""
    missing: str = ""
    """Why there is no seed-aware interval (no predictions, one seed of a trained method, ...); empty when there is."""
    trained_seeds: int = 0
    """The fewest seeds of a trained side (a base model's one run not counted)."""

    @property
    def provisional(self) -> bool:
        return self.trained_seeds < MIN_SEEDS


def provisional_label(comparison: Comparison) -> str:
    """", provisional: 3 seeds" where a verdict rests on fewer than `MIN_SEEDS` seeds of a trained method."""
    if not comparison.provisional:
        return ""
    seeds = comparison.trained_seeds
    return f", provisional: {seeds} seed{'s' if seeds != 1 else ''}"


def paper_pairs(methods: Collection[str], order: Collection[str]) -> list[tuple[str, str]]:
    """Every pair of these methods that the paper's numbers order, the better first; by the better's place in
    `order`, then the worse one's."""
    known = [m for m in order if m in methods and m in PAPER_GSM8K]
    return [(better, worse) for better in known for worse in known if PAPER_GSM8K[better] > PAPER_GSM8K[worse]]


def verdict(comparison: Comparison) -> str:
    """How this replication's difference (method minus reference, the paper's better first) bears out the order."""
    if comparison.seeds is None:
        return UNTESTED
    if comparison.seeds.low > 0:
        return HOLDS
    if comparison.seeds.high < 0:
        return REVERSED
    return UNRESOLVED


def _scale(difference: Difference) -> str:
    """What a difference pools: "5 and 5 runs × 1,319 problems"."""
    return f"{difference.method_runs} and {difference.reference_runs} runs × {difference.problems:,} problems"


def _interval(difference: Difference) -> str:
    """"[-9.76, +6.27]"."""
    return f"[{difference.low:+.2f}, {difference.high:+.2f}]"


def _phrase(comparison: Comparison, name: Callable[[str], str], with_scale: bool) -> str:
    assert comparison.seeds is not None
    interval = _interval(comparison.seeds)
    scale = f", {_scale(comparison.seeds)}" if with_scale else ""
    return (f"{name(comparison.method)} > {name(comparison.reference)} ({comparison.seeds.points:+.2f} {interval}"
            f"{scale}{provisional_label(comparison)})")


def orderings_paragraph(comparisons: list[Comparison], name: Callable[[str], str], evaluation: str) -> str:
    """Which of the paper's orderings hold here, which are reversed and which this replication cannot tell (a
    markdown paragraph, for the README); `comparisons` are the paper's pairs, its better method first. A verdict
    from fewer than `MIN_SEEDS` seeds says it is provisional."""
    if not comparisons:
        return ""
    # One scale for all in the heading; where they differ (a grid of 3 seeds beside one of 5), each gives its own.
    scales = {_scale(c.seeds) for c in comparisons if c.seeds is not None}
    each_own = len(scales) > 1
    by_verdict: dict[str, list[str]] = {HOLDS: [], REVERSED: [], UNRESOLVED: [], UNTESTED: []}
    for comparison in comparisons:
        label = verdict(comparison)
        text = (_phrase(comparison, name, each_own) if comparison.seeds is not None
                else f"{name(comparison.method)} > {name(comparison.reference)} ({comparison.gap:+.2f}, no interval: "
                     f"{comparison.missing})")
        by_verdict[label].append(text)
    scale = "each with its runs and problems" if each_own else next(iter(scales), "no predictions")
    lines = [(f"**The paper's orderings on {evaluation}** (the paper's numbers: {PAPER_SETTING}; here: the difference "
              f"in points with its 95% interval over training seeds and test problems, {scale}; a verdict from fewer "
              f"than {MIN_SEEDS} seeds of a trained method is provisional):")]
    wording = {HOLDS: "Hold", REVERSED: "Reversed", UNRESOLVED: "Not resolved (the interval holds 0)",
               UNTESTED: "Not tested"}
    for label, phrases in by_verdict.items():
        if phrases:
            lines.append(f"- {wording[label]}, {len(phrases)}: " + "; ".join(phrases) + ".")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------
# The paper's claims, each table's and Figure 3's, against a replication (issue 46: "which of the paper's claims
# hold, are reversed, or are unresolved at this scale, and whether the budget arm changes any of them")

PAPER_MODELS = ("DeepSeek-Math-7B", "Llama-3.1-8B", "Llama-3.2-3B", "Llama-3.2-1B")
"""The paper's models, in its tables' column order."""
NOT_RUN, DESCRIBED = "not run yet", "described, no interval"


@dataclass(frozen=True)
class Claim:
    """One ordering the paper reports: `better` above `worse`, trained on `train_set`, evaluated on `eval_set`."""

    source: str
    """Where the paper reports it: "Table 1"."""
    train_set: str
    eval_set: str
    better: str
    worse: str
    paper_better: tuple[float, ...] = ()
    """The paper's accuracies of `better`, one a model of `PAPER_MODELS` (the first ones where fewer)."""
    paper_worse: tuple[float, ...] = ()
    decoding: str | None = None
    """The decoding the paper's table used where it is not the report's (Table 2: CoT-decoding)."""
    statement: str = ""
    """What the paper says, where it gives no numbers (Figure 3)."""

    def paper_text(self) -> str:
        """"74.22 vs 70.20 on DeepSeek-Math-7B; ahead on 4 of 4 models"."""
        if self.statement:
            return self.statement
        pairs = list(zip(self.paper_better, self.paper_worse))
        ahead = sum(better > worse for better, worse in pairs)
        first = f"{self.paper_better[0]:.2f} vs {self.paper_worse[0]:.2f} on {PAPER_MODELS[0]}"
        return first if len(pairs) == 1 else f"{first}; ahead on {ahead} of {len(pairs)} models"


_T1 = {  # Table 1, GSM8K then MATH, per model
    ("gsm8k", "clozemath"): (74.22, 70.00, 53.15, 27.89), ("gsm8k", "mft"): (70.20, 64.82, 45.03, 21.15),
    ("gsm8k", "base"): (59.21, 49.58, 17.66, 4.62),
    ("math", "clozemath"): (36.90, 22.88, 11.18, 5.00), ("math", "mft"): (33.42, 20.94, 10.14, 4.52),
    ("math", "base"): (31.68, 18.06, 4.54, 3.84),
}
_T3 = {  # Table 3: (training set, evaluation set) -> (ClozeMath, MFT) per model
    ("gsm8k", "gsm_symbolic"): ((65.65, 63.40, 46.70, 23.95), (63.05, 60.90, 40.45, 18.55)),
    ("gsm8k", "gsm_p1"): ((49.25, 47.65, 28.6, 11.25), (44.25, 41.30, 22.5, 8.30)),
    ("gsm8k", "gsm_p2"): ((20.00, 22.50, 10.20, 3.20), (20.20, 22.30, 6.80, 1.30)),
    ("math", "gsm_symbolic"): ((58.35, 45.85, 25.10, 4.05), (55.50, 39.85, 17.40, 4.10)),
    ("math", "gsm_p1"): ((40.25, 23.90, 8.45, 1.60), (35.00, 21.80, 7.85, 1.40)),
    ("math", "gsm_p2"): ((16.90, 8.50, 1.80, 1.00), (14.70, 7.50, 2.30, 1.00)),
}
PAPER_CLAIMS: tuple[Claim, ...] = (
    *(Claim("Table 1", data, data, better, worse, _T1[data, better], _T1[data, worse])
      for data in ("gsm8k", "math") for better, worse in (("clozemath", "mft"), ("mft", "base"))),
    Claim("Table 2", "gsm8k", "gsm8k", "clozemath", "mft", (77.10, 75.97, 57.39, 31.84), (76.50, 74.30, 55.27, 28.80),
           decoding="cot"),
    *(Claim("Table 3", data, evaluation, "clozemath", "mft", *_T3[data, evaluation])
      for data in ("gsm8k", "math") for evaluation in ("gsm_symbolic", "gsm_p1", "gsm_p2")),
    *(Claim("Table 4", "gsm8k", "gsm8k", "clozemath", ablation, (PAPER_GSM8K["clozemath"],), (PAPER_GSM8K[ablation],))
      for ablation in ("it_prefixlm", "clozemath_causal", "it", "random_span")),
    Claim("Figure 3", "gsm8k", "gsm8k", "clozemath", "mft",
          statement="above at every recorded checkpoint (DeepSeek-Math-7B; \"more sample efficient than MFT\")"),
)
"""Every ordering the paper's Tables 1-4 and Figure 3 report for its methods, in the paper's order. Table 3's P2 after
GSM8K training is one the paper calls "only a slight performance gap" (MFT ahead on DeepSeek-Math-7B); Table 4 holds
DeepSeek-Math-7B alone, and says each ablation falls below ClozeMath."""


@dataclass(frozen=True)
class ClaimCheck:
    """A claim against one model's runs: the matched runs' comparison, each grid variant's (a budget arm's), or, for
    a claim no interval can judge (Figure 3's curves hold accuracies, not predictions), what the runs show."""

    claim: Claim
    comparison: Comparison | None = None
    arms: tuple[tuple[str, Comparison], ...] = ()
    """(variant, its comparison): `arm=budget3x`'s runs compared as the matched runs are."""
    described: str = ""

    @property
    def verdict(self) -> str:
        if self.described:
            return DESCRIBED
        return NOT_RUN if self.comparison is None else verdict(self.comparison)

    def changed_by(self) -> list[str]:
        """The variants whose verdict differs from the matched runs' (both judged: a variant with no interval, such
        as one seed of an arm, changes nothing)."""
        if self.verdict not in JUDGED:
            return []
        return [arm for arm, comparison in self.arms if verdict(comparison) in JUDGED
                and verdict(comparison) != self.verdict]

    def unjudged_arms(self) -> list[str]:
        """The variants that ran this claim without an interval to judge it by."""
        return [arm for arm, comparison in self.arms if verdict(comparison) == UNTESTED]


def _here(comparison: Comparison) -> str:
    """"-1.83 [-9.76, +6.27], 2 and 3 runs × 1,319 problems, provisional: 2 seeds"; without a seed-aware interval,
    the one over the problems alone where there is one (it says whether these very runs differ, not the methods)."""
    if comparison.seeds is None:
        text = f"{comparison.gap:+.2f}, no interval: {comparison.missing}"
        if comparison.problems is not None:
            text += (f"; over the problems alone, these runs held fixed: {_interval(comparison.problems)}, "
                     f"{_scale(comparison.problems)}")
        return text
    return (f"{comparison.seeds.points:+.2f} {_interval(comparison.seeds)}, {_scale(comparison.seeds)}"
            f"{provisional_label(comparison)}")


def _claim_line(check: ClaimCheck, name: Callable[[str], str], title: Callable[[tuple[str, str]], str]) -> str:
    claim = check.claim
    evaluation = check.comparison.evaluation if check.comparison else (claim.eval_set, claim.decoding or "")
    where = f"{claim.source} ({claim.train_set.upper()}-trained, {title(evaluation).strip()})"
    line = f"{where}: {name(claim.better)} > {name(claim.worse)}. Paper: {claim.paper_text()}."
    if check.described:
        line += f" Here: {check.described}."
    elif check.comparison is not None:
        line += f" Here: {_here(check.comparison)}."
    for arm, comparison in check.arms:
        line += f" At {arm}: {verdict(comparison)}, {_here(comparison)}."
    return line


def claims_list(checks: list[ClaimCheck], name: Callable[[str], str], title: Callable[[tuple[str, str]], str],
                model: str) -> str:
    """The paper's claims against one model's runs, grouped by verdict (a markdown list), and which verdicts a grid
    variant (a budget arm) changes."""
    wording = {HOLDS: "Hold", REVERSED: "Reversed", UNRESOLVED: "Not resolved (the interval holds 0)",
               UNTESTED: "Not tested (no interval)", DESCRIBED: "Described (no interval)", NOT_RUN: "Not run yet"}
    lines = [f"**The paper's claims on {model}** (the paper: its numbers, DeepSeek-Math-7B first; here: the difference "
             "in points with its 95% interval over training seeds and test problems; a verdict from fewer than "
             f"{MIN_SEEDS} seeds of a trained method is provisional; \"at arm=...\": the same claim among one grid "
             "variant's runs, such as a budget arm):"]
    for label, heading in wording.items():
        group = [check for check in checks if check.verdict == label]
        if group:
            lines.append(f"- {heading}, {len(group)}:")
            lines += [f"  - {_claim_line(check, name, title)}" for check in group]
    arms = sorted({arm for check in checks for arm, _ in check.arms})
    changed = [f"{check.claim.source} {name(check.claim.better)} > {name(check.claim.worse)} "
               f"({', '.join(check.changed_by())})" for check in checks if check.changed_by()]
    if arms:
        unjudged = Counter(arm for check in checks for arm in check.unjudged_arms())
        untested = [f"{arm} left {count} claim{'s' if count != 1 else ''} unjudged"
                    for arm, count in sorted(unjudged.items())]
        lines.append(f"- Grid variants ({', '.join(arms)}) change the verdict of "
                     + ("; ".join(changed) if changed else "none of the claims they judged")
                     + (f"; {', '.join(untested)} (no interval)" if untested else "")
                     + ".")
    return "\n".join(lines)
