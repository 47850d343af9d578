"""The paper's orderings of methods, and whether a replication's comparisons bear them out (`clozemath report`).

The paper reports every method of ours only for DeepSeek-Math-7B on GSM8K (beam search): Base, MFT and ClozeMath in
Table 1, the ablations, IT among them, in Table 4. Its numbers order each pair of methods; a replication's difference
for that pair, with its seed-aware interval (`clozemath.intervals.seeds_difference`), either holds the paper's order
(the interval is above 0), reverses it (below 0), or cannot tell (the interval holds 0). A verdict resting on fewer
than `MIN_SEEDS` seeds of a trained method is provisional, and says so.
"""

from __future__ import annotations

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


def _phrase(comparison: Comparison, name: Callable[[str], str], with_scale: bool) -> str:
    assert comparison.seeds is not None
    interval = f"[{comparison.seeds.low:+.2f}, {comparison.seeds.high:+.2f}]"
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
