"""Predictions: the record every evaluation writes (JSONL, one `Prediction` a line), read back, regraded, scored
(`clozemath score`), and turned into metrics and the results table."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from clozemath.data.sources import read_jsonl
from clozemath.errors import ClozeMathError
from clozemath.files import atomic_writer
from clozemath.records import (
    CUT_SHARE,
    EVAL_PREFIX,
    FALLBACK_SHARE,
    FLEXIBLE_ACCURACY,
    LENIENT_ACCURACY,
    STRICT_ACCURACY,
    UNCUT_ACCURACY,
    eval_metric,
    parse_eval_metric,
    tally_metrics,
)
from clozemath.tasks import get_task
from clozemath.tasks.base import CUT_RULE, FALLBACK_RULE, MARKED_RULES
from clozemath.tasks.harness import FLEXIBLE_EXTRACT, STRICT_MATCH, filtered_answer, harness_verdicts
from clozemath.tasks.mathverify import file_budget_s, grading_threads, total_budget


@dataclass(frozen=True)
class Prediction:
    id: str
    dataset: str
    decoding: str
    prompt: str
    generation: str
    extracted: str | None
    gold: str
    correct: bool
    confidence: float | None
    harness: dict[str, bool] | None = None
    """Few-shot GSM8K-like predictions (base models): lm-evaluation-harness's verdict per answer filter (strict-match,
    flexible-extract), `extracted` and `correct` being strict-match's; None where clozemath's rules grade."""
    finish_reason: str | None = None
    """eos, stop (a stop string) or length (cut at `max_new_tokens`); None in files written before it was recorded."""
    generated_tokens: int | None = None
    """Tokens generated, end-of-sequence excluded."""
    rule: str | None = None
    """How `extracted` was found (`clozemath.tasks`): strict (after `####`), boxed, final_answer, flexible (the
    last number, a fallback), cut (a generation cut at `max_new_tokens` before it marked an answer: wrong, `extracted`
    being the last number the fallback would have taken) or none; for the harness's grading, strict (strict-match's
    `#### N`) or none. None in files written before it was recorded."""
    lenient: bool | None = None
    """The verdict had the fallback read cut generations too (the rule before 2026-12-02); None where it equals
    `correct`."""


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "id": (str,), "dataset": (str,), "decoding": (str,), "prompt": (str,), "generation": (str,),
    "extracted": (str, type(None)), "gold": (str,), "correct": (bool,), "confidence": (int, float, type(None)),
    "harness": (dict, type(None)),
    "finish_reason": (str, type(None)), "generated_tokens": (int, type(None)), "rule": (str, type(None)),
    "lenient": (bool, type(None)),
}
_REQUIRED = ("id", "dataset", "generation", "gold")  # the rest default: `score` regrades from these
_DEFAULTS: dict[str, Any] = {
    "decoding": "", "prompt": "", "extracted": None, "correct": False, "confidence": None, "harness": None,
    "finish_reason": None, "generated_tokens": None, "rule": None, "lenient": None,
}
CUT_WARNING_SHARE = 0.2
"""The results table warns when more than this share of a set's generations ran to `max_new_tokens`."""


def _has_type(value: Any, allowed: tuple[type, ...]) -> bool:
    return bool in allowed if isinstance(value, bool) else isinstance(value, allowed)  # JSON true is no number


def prediction_from_row(row: dict[str, Any], where: str) -> Prediction:
    """A prediction from a JSON object (its fields; others ignored); a missing or mistyped field is an error naming
    `where`."""
    values = {}
    for spec in fields(Prediction):
        if spec.name not in row:
            if spec.name in _REQUIRED:
                raise ClozeMathError(f"{where}: missing field '{spec.name}'")
            values[spec.name] = _DEFAULTS[spec.name]
            continue
        value = row[spec.name]
        if not _has_type(value, _FIELD_TYPES[spec.name]):
            raise ClozeMathError(f"{where}: field '{spec.name}' has the wrong type ({type(value).__name__})")
        values[spec.name] = value
    try:
        get_task(values["dataset"])
    except ClozeMathError as exc:
        raise ClozeMathError(f"{where}: {exc}") from None
    return _matched_as_its_set_matches(_judged_by_the_cut_rule(Prediction(**values), lenient_recorded="lenient" in row))


def _judged_by_the_cut_rule(prediction: Prediction, lenient_recorded: bool) -> Prediction:
    """A prediction written before the cut rule (no `lenient` field), judged by it: a cut generation whose answer the
    last-number fallback found is wrong, its old verdict kept as `lenient`. The rule and finish reason it records
    are all that takes, so compact exports (without the generations) are re-judged too."""
    if lenient_recorded or prediction.rule != FALLBACK_RULE or prediction.finish_reason != "length":
        return prediction
    return replace(prediction, correct=False, rule=CUT_RULE, lenient=prediction.correct)


def _matched_as_its_set_matches(prediction: Prediction) -> Prediction:
    """A prediction the harness's filters graded, matched to its gold as its set matches now (`Task.harness_match`:
    GSM-Symbolic's as numbers since 2026-12-05, where `45` missed a gold `45.0`). Strict-match's answer is `extracted`;
    flexible-extract's is found again in the generation, and a compact export, which has none, keeps its verdict."""
    if prediction.harness is None:
        return prediction
    match = get_task(prediction.dataset).harness_match
    strict = match(prediction.extracted, prediction.gold)
    flexible = (match(filtered_answer(FLEXIBLE_EXTRACT, prediction.generation), prediction.gold)
                if prediction.generation else prediction.harness.get(FLEXIBLE_EXTRACT, False))
    return replace(prediction, correct=strict, harness={STRICT_MATCH: strict, FLEXIBLE_EXTRACT: flexible})


def read_predictions(path: str | Path) -> list[Prediction]:
    file = Path(path)
    if not file.is_file():
        raise ClozeMathError(f"{file}: no such predictions file")
    predictions = [prediction_from_row(row, where) for where, row in read_jsonl(file)]
    if not predictions:
        raise ClozeMathError(f"{file}: no predictions in it (an empty file)")
    return predictions


def write_predictions(path: str | Path, predictions: Iterable[Prediction], append: bool = False) -> None:
    """Write the predictions file whole (atomically), or `append` to a partial one as predictions stream in."""
    file = Path(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    with file.open("a", encoding="utf-8") if append else atomic_writer(file) as handle:
        for prediction in predictions:
            handle.write(json.dumps(asdict(prediction), ensure_ascii=False) + "\n")


@dataclass(frozen=True)
class Verdict:
    extracted: str | None
    correct: bool
    harness: dict[str, bool] | None
    rule: str
    lenient: bool | None = None


def grade_generation(dataset: str, generation: str, gold: str, harness: bool, ended: bool = True) -> Verdict:
    """clozemath's grading (`ended`: the generation ended before `max_new_tokens`), or (`harness`, for few-shot
    GSM8K-like sets) the harness's filters, strict-match first."""
    task = get_task(dataset)
    if harness and task.harness_filters:
        verdicts = harness_verdicts(generation, gold, task.harness_match)
        extracted = filtered_answer(STRICT_MATCH, generation)
        return Verdict(extracted, verdicts[STRICT_MATCH], verdicts, "none" if extracted is None else "strict")
    graded = task.grade(generation, gold, ended=ended)
    return Verdict(graded.extracted, graded.correct, None, graded.rule, graded.lenient)


def regrade(predictions: list[Prediction]) -> list[Prediction]:
    """The predictions with `extracted`, `correct`, `rule` (and the harness's verdicts, where it graded) recomputed
    from `generation` and `gold`; a thread per core, so that as many math-verify checks run at once."""
    pool = ThreadPoolExecutor(max_workers=grading_threads())
    try:
        return list(pool.map(_regraded, predictions))
    finally:
        pool.shutdown(cancel_futures=True)  # on Ctrl-C, only the checks already running are waited for


def _regraded(prediction: Prediction) -> Prediction:
    by_harness = prediction.harness is not None
    try:
        verdict = grade_generation(prediction.dataset, prediction.generation, prediction.gold, by_harness,
                                   ended=prediction.finish_reason != "length")
    except ClozeMathError as exc:
        raise ClozeMathError(f"prediction '{prediction.id}': {exc}") from None
    return replace(prediction, extracted=verdict.extracted, correct=verdict.correct, harness=verdict.harness,
                   rule=verdict.rule, lenient=verdict.lenient)


def _tally(correct: int, total: int) -> dict[str, float | int]:
    return {"accuracy": correct / total if total else 0.0, "correct": correct, "total": total}


def score_predictions(predictions: list[Prediction]) -> dict[str, Any]:
    """`{"overall": tally, "groups": {"<dataset>/<decoding>": tally}}`, a tally being accuracy, correct, total;
    a group without a decoding is named by its dataset alone."""
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for prediction in predictions:
        key = f"{prediction.dataset}/{prediction.decoding}" if prediction.decoding else prediction.dataset
        counts[key][0] += prediction.correct
        counts[key][1] += 1
    correct = sum(c for c, _ in counts.values())
    return {
        "overall": _tally(correct, len(predictions)),
        "groups": {key: _tally(c, n) for key, (c, n) in sorted(counts.items())},
    }


def print_score(path: str | Path, as_json: bool = False) -> None:
    """Regrade a predictions file and print its accuracy (the `clozemath score` command)."""
    predictions = read_predictions(path)
    with total_budget(file_budget_s(len(predictions))) as budget:
        regraded = regrade(predictions)
    scores = score_predictions(regraded)
    scores["changed"] = sum(old.correct != new.correct for old, new in zip(predictions, regraded))
    scores["math_verify_timeouts"] = budget.timed_out
    if as_json:
        print(json.dumps(scores, indent=2))
        return
    width = max([len("overall"), *map(len, scores["groups"])])
    print(f"{'set':<{width}}  {'correct':>7}  {'total':>6}  accuracy")
    for key, tally in [*scores["groups"].items(), ("overall", scores["overall"])]:
        print(f"{key:<{width}}  {tally['correct']:>7}  {tally['total']:>6}  {100 * tally['accuracy']:7.2f}%")
    print(f"regraded {len(predictions)} predictions: {scores['changed']} verdicts changed")
    if budget.timed_out:
        print(f"math-verify: {budget.timed_out} checks ran out of time (the file's {budget.seconds:.0f} s in all) "
              "and were graded by normalized string equality")


def strict_and_flexible(prediction: Prediction) -> tuple[bool, bool] | None:
    """Whether the answer is right counting only an answer the format marks (strict), and counting the last-number
    fallback too (flexible); the harness's strict-match and flexible-extract where it graded. None when the
    prediction records neither its rule nor the harness's verdicts (a file from before)."""
    if prediction.harness is not None:
        return prediction.harness.get(STRICT_MATCH, False), prediction.harness.get(FLEXIBLE_EXTRACT, False)
    if prediction.rule is None:
        return None
    return prediction.correct and prediction.rule in MARKED_RULES, prediction.correct


@dataclass
class _Tally:
    """One set and decoding's counts, for `metrics`."""

    correct: int = 0
    total: int = 0
    finish_recorded: int = 0
    cut: int = 0
    uncut_correct: int = 0
    rule_recorded: int = 0
    fallback: int = 0
    graded_both: int = 0
    strict: int = 0
    flexible: int = 0
    lenient: int = 0
    by_filter: Counter[str] = field(default_factory=Counter)

    def add(self, prediction: Prediction) -> None:
        self.correct += prediction.correct
        self.lenient += prediction.correct if prediction.lenient is None else prediction.lenient
        self.total += 1
        self.by_filter.update(prediction.harness or {})
        if prediction.finish_reason is not None:
            self.finish_recorded += 1
            self.cut += prediction.finish_reason == "length"
            self.uncut_correct += prediction.correct and prediction.finish_reason != "length"
        if prediction.rule is not None:
            self.rule_recorded += 1
            self.fallback += prediction.rule == FALLBACK_RULE
        verdicts = strict_and_flexible(prediction)
        if verdicts is not None:
            self.graded_both += 1
            self.strict += verdicts[0]
            self.flexible += verdicts[1]

    def stats(self) -> dict[str, float]:
        """The statistics that every prediction of the group records the inputs of."""
        out: dict[str, float] = {name: hits / self.total for name, hits in self.by_filter.items()}
        if self.rule_recorded == self.total:
            out[LENIENT_ACCURACY] = self.lenient / self.total
        if self.finish_recorded:
            out[CUT_SHARE] = self.cut / self.finish_recorded
            uncut = self.finish_recorded - self.cut
            if uncut and self.finish_recorded == self.total:
                out[UNCUT_ACCURACY] = self.uncut_correct / uncut
        if self.rule_recorded == self.total:
            out[FALLBACK_SHARE] = self.fallback / self.total
        if self.graded_both == self.total:
            out[STRICT_ACCURACY] = self.strict / self.total
            out[FLEXIBLE_ACCURACY] = self.flexible / self.total
        return out


def metrics(predictions: Iterable[Prediction]) -> dict[str, float]:
    """`eval/<set>/<decoding>/accuracy`, `.../correct`, `.../total` for every set (dataset) and decoding present; then
    what shows how the answers were graded:
    - `cut_share`: the share of generations cut at `max_new_tokens` (of those that record why they ended), and
      `uncut_accuracy`, the accuracy over the others;
    - `strict_accuracy` and `flexible_accuracy` (`strict_and_flexible`), and `fallback_share`, the share of answers
      found by the last-number fallback;
    - `lenient_accuracy`: the accuracy had the fallback read cut generations too (the rule before 2026-12-02);
    - where the harness graded (base models), its filters' accuracies, `.../strict-match` and `.../flexible-extract`.
    A statistic is left out where some prediction of the group predates what it needs."""
    tallies: dict[tuple[str, str], _Tally] = defaultdict(_Tally)
    for prediction in predictions:
        tallies[(prediction.dataset, prediction.decoding)].add(prediction)
    out: dict[str, float] = {}
    for (dataset, decoding), tally in sorted(tallies.items()):
        out.update(tally_metrics(dataset, decoding, tally.correct, tally.total))
        out.update({eval_metric(dataset, decoding, name): value for name, value in tally.stats().items()})
    return out


def results_table(values: dict[str, float]) -> str:
    """A markdown table of `eval/<set>/<decoding>/...` metrics: set, decoding, correct, total, accuracy, the share cut
    at max_new_tokens and problems/s (where measured); then a warning line for each set and decoding with more than
    `CUT_WARNING_SHARE` of its generations cut."""
    return _results_table({None: values})


def trials_results_table(trials: Mapping[str, dict[str, float]]) -> str:
    """`results_table` of a few trials side by side (name -> its metrics): their rows, named in a first column."""
    return _results_table(dict(trials))


def _results_table(tables: Mapping[str | None, dict[str, float]]) -> str:
    named = any(name is not None for name in tables)
    lines = [("| trial " if named else "") + "| set | decoding | correct | total | accuracy | cut at max_new_tokens | "
             "problems/s |", ("| --- " if named else "") + "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    warnings = []
    for name, metrics in tables.items():
        groups: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
        for key, value in metrics.items():
            metric = parse_eval_metric(key)
            if metric is not None and metric.prefix == EVAL_PREFIX:
                groups[(metric.set_name, metric.decoding)][metric.stat] = value
        for (dataset, decoding), group in sorted(groups.items()):
            speed = f"{group['problems_per_s']:.2f}" if "problems_per_s" in group else "-"
            cut = f"{100 * group['cut_share']:.1f}%" if "cut_share" in group else "-"
            lines.append(
                (f"| {name} " if named else "") + f"| {dataset} | {decoding} | {int(group['correct'])} | "
                f"{int(group['total'])} | {100 * group['accuracy']:.2f}% | {cut} | {speed} |"
            )
            if group.get("cut_share", 0.0) > CUT_WARNING_SHARE:
                warnings.append(
                    f"warning: {f'{name}: ' if named else ''}{dataset}/{decoding}: {cut} of the generations ran to "
                    "max_new_tokens (a model that loops, or eval.max_new_tokens too small)"
                )
    return "\n".join(lines + warnings)
