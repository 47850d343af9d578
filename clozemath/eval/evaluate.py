"""A model on evaluation sets -> predictions + metrics; predictions files (JSONL, one `Prediction` a line): read,
write, regrade, score.

Ray-free: `ray_jobs/evaluate.py` runs `evaluate_batch` in a Ray Data actor pool; a training loop can call it directly.
"""

from __future__ import annotations

import json
import random
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clozemath.config import EvalConfig, EvalSetConfig, ExperimentConfig
from clozemath.data.sources import Problem, read_jsonl
from clozemath.data.objectives import format_prompt, lm_sample
from clozemath.data.tokenize import encode_samples
from clozemath.errors import ClozeMathError
from clozemath.eval.decode import Engine, Generation, PromptAttention, decode
from clozemath.eval.harness import STRICT_MATCH, filtered_answer, harness_verdicts
from clozemath.files import atomic_writer
from clozemath.records import (
    ADAPTER_DIR,
    CUT_SHARE,
    EVAL_PREFIX,
    eval_metric,
    parse_eval_metric,
    run_folder,
    tally_metrics,
)
from clozemath.tasks import few_shot_prompt, get_task

if TYPE_CHECKING:  # peft takes seconds to import: `clozemath score` does without it
    import torch

    from clozemath.model.load import Loaded


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


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "id": (str,), "dataset": (str,), "decoding": (str,), "prompt": (str,), "generation": (str,),
    "extracted": (str, type(None)), "gold": (str,), "correct": (bool,), "confidence": (int, float, type(None)),
    "harness": (dict, type(None)),
    "finish_reason": (str, type(None)), "generated_tokens": (int, type(None)),
}
_REQUIRED = ("id", "dataset", "generation", "gold")  # the rest default: `score` regrades from these
_DEFAULTS: dict[str, Any] = {
    "decoding": "", "prompt": "", "extracted": None, "correct": False, "confidence": None, "harness": None,
    "finish_reason": None, "generated_tokens": None,
}
CUT_WARNING_SHARE = 0.2
"""The results table warns when more than this share of a set's generations ran to `max_new_tokens`."""


def _has_type(value: Any, allowed: tuple[type, ...]) -> bool:
    return bool in allowed if isinstance(value, bool) else isinstance(value, allowed)  # JSON true is no number


def _prediction(row: dict[str, Any], where: str) -> Prediction:
    values = {}
    for field in fields(Prediction):
        if field.name not in row:
            if field.name in _REQUIRED:
                raise ClozeMathError(f"{where}: missing field '{field.name}'")
            values[field.name] = _DEFAULTS[field.name]
            continue
        value = row[field.name]
        if not _has_type(value, _FIELD_TYPES[field.name]):
            raise ClozeMathError(f"{where}: field '{field.name}' has the wrong type ({type(value).__name__})")
        values[field.name] = value
    try:
        get_task(values["dataset"])
    except ClozeMathError as exc:
        raise ClozeMathError(f"{where}: {exc}") from None
    return Prediction(**values)


def read_predictions(path: str | Path) -> list[Prediction]:
    file = Path(path)
    if not file.is_file():
        raise ClozeMathError(f"{file}: no such predictions file")
    predictions = [_prediction(row, where) for where, row in read_jsonl(file)]
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
class _Verdict:
    extracted: str | None
    correct: bool
    harness: dict[str, bool] | None


def _verdict(dataset: str, generation: str, gold: str, harness: bool) -> _Verdict:
    """clozemath's grading, or (`harness`, for few-shot GSM8K-like sets) the harness's filters, strict-match first."""
    task = get_task(dataset)
    if harness and task.harness_filters:
        verdicts = harness_verdicts(generation, gold)
        return _Verdict(filtered_answer(STRICT_MATCH, generation), verdicts[STRICT_MATCH], verdicts)
    graded = task.grade(generation, gold)
    return _Verdict(graded.extracted, graded.correct, None)


def regrade(predictions: list[Prediction]) -> list[Prediction]:
    """The predictions with `extracted`, `correct` (and the harness's verdicts, where it graded) recomputed from
    `generation` and `gold`."""
    regraded = []
    for prediction in predictions:
        by_harness = prediction.harness is not None
        try:
            verdict = _verdict(prediction.dataset, prediction.generation, prediction.gold, by_harness)
        except ClozeMathError as exc:
            raise ClozeMathError(f"prediction '{prediction.id}': {exc}") from None
        regraded.append(
            replace(prediction, extracted=verdict.extracted, correct=verdict.correct, harness=verdict.harness)
        )
    return regraded


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
    regraded = regrade(predictions)
    scores = score_predictions(regraded)
    scores["changed"] = sum(old.correct != new.correct for old, new in zip(predictions, regraded))
    if as_json:
        print(json.dumps(scores, indent=2))
        return
    width = max([len("overall"), *map(len, scores["groups"])])
    print(f"{'set':<{width}}  {'correct':>7}  {'total':>6}  accuracy")
    for key, tally in [*scores["groups"].items(), ("overall", scores["overall"])]:
        print(f"{key:<{width}}  {tally['correct']:>7}  {tally['total']:>6}  {100 * tally['accuracy']:7.2f}%")
    print(f"regraded {len(predictions)} predictions: {scores['changed']} verdicts changed")


# --------------------------------------------------------------------------------------------------------------
# Evaluation sets

def eval_set_identity(set_cfg: EvalSetConfig) -> str:
    """Where an evaluation set's problems come from and what they hold: its data file, or its templates folder."""
    return get_task(set_cfg.dataset).identity(set_cfg)


def eval_problems(set_cfg: EvalSetConfig) -> list[Problem]:
    """The problems of one evaluation set (its task's, `clozemath.tasks`); a seeded subset of `limit` of them, in
    order."""
    problems = get_task(set_cfg.dataset).problems(set_cfg)
    if set_cfg.limit is None or set_cfg.limit >= len(problems):
        return problems
    chosen = random.Random(f"eval/{set_cfg.dataset}/{set_cfg.seed}").sample(range(len(problems)), set_cfg.limit)
    return [problems[index] for index in sorted(chosen)]


# --------------------------------------------------------------------------------------------------------------
# Prompts

@dataclass(frozen=True)
class Prompting:
    """How the evaluated model is prompted."""

    few_shot: bool
    """Few-shot text prompts (base models); else the fine-tuned prefix `P<SEP>` as token ids."""
    attention: PromptAttention
    """Attention over the prompt; generation is always causal."""
    template: str
    """P's template (`data.prompt_template`), for the fine-tuned prefix."""


def prompting(cfg: ExperimentConfig) -> Prompting:
    """`eval.few_shot` auto: few-shot for methods that train nothing (`base`); `eval.prompt_attention` auto:
    bidirectional for a prefix_lm-trained model prompted in its own format, causal otherwise."""
    few_shot = not cfg.method.trains if cfg.eval.few_shot == "auto" else cfg.eval.few_shot
    attention = cfg.eval.prompt_attention
    if attention == "auto":
        attention = "bidirectional" if cfg.method.attention == "prefix_lm" and not few_shot else "causal"
    return Prompting(few_shot, attention, cfg.data.prompt_template)


@dataclass(frozen=True)
class Prompt:
    text: str
    """As the predictions file records it (special tokens by name: `...Answer:<SEP>`)."""
    ids: list[int]


def stop_strings(dataset: str, prompting: Prompting) -> tuple[str, ...]:
    """Few-shot prompts stop where the harness stops them; a fine-tuned model ends with its end-of-sequence token."""
    return get_task(dataset).stop if prompting.few_shot else ()


def finetuned_prompts(problems: Sequence[Problem], loaded: Loaded, template: str) -> list[Prompt]:
    """`P<SEP>`, token for token the prefix of the problem's LM training sample (BOS, P, `<SEP>`): built and encoded by
    the training code itself."""
    samples = [lm_sample(problem.id, format_prompt(template, problem.question), "") for problem in problems]
    encoded = encode_samples(samples, loaded.tokenizer, loaded.specials, max_length=sys.maxsize)
    return [
        Prompt(sample.prefix, row["input_ids"][: row["prefix_len"]])
        for sample, row in zip(samples, encoded)
        if row is not None
    ]


def build_prompts(problems: Sequence[Problem], loaded: Loaded, prompting: Prompting) -> list[Prompt]:
    if not prompting.few_shot:
        return finetuned_prompts(problems, loaded, prompting.template)
    texts = [few_shot_prompt(problem) for problem in problems]
    ids = loaded.tokenizer(texts, add_special_tokens=True)["input_ids"]
    return [Prompt(text, list(row)) for text, row in zip(texts, ids)]


# --------------------------------------------------------------------------------------------------------------
# Decoding and grading


def _decode(
    loaded: Loaded, prompts: list[Prompt], dataset: str, decoding: str, eval_cfg: EvalConfig, prompting: Prompting,
    engine: Engine,
) -> list[Generation]:
    task = get_task(dataset)
    return decode(
        loaded.model, loaded.tokenizer, [prompt.ids for prompt in prompts], decoding,
        max_new_tokens=eval_cfg.max_new_tokens, stop=stop_strings(dataset, prompting),
        prompt_attention=prompting.attention, batch_size=eval_cfg.batch_size, num_beams=eval_cfg.num_beams,
        cot_k=eval_cfg.cot_k, answer_span=task.answer_span, normalize_answer=task.answer_key,
        engine=engine,
    )


def evaluate_batch(
    loaded: Loaded, problems: Sequence[Problem], decoding: str, eval_cfg: EvalConfig, prompting: Prompting,
    engine: Engine = "auto",
) -> list[Prediction]:
    """Decode every problem with `decoding` and grade it; one Prediction per problem, in order (`confidence`: the
    winning answer's summed CoT-decoding confidence). `engine`: `decode`'s."""
    predictions: list[Prediction | None] = [None] * len(problems)
    for dataset in dict.fromkeys(problem.dataset for problem in problems):
        indices = [i for i, problem in enumerate(problems) if problem.dataset == dataset]
        group = [problems[i] for i in indices]
        prompts = build_prompts(group, loaded, prompting)
        generations = _decode(loaded, prompts, dataset, decoding, eval_cfg, prompting, engine)
        for index, problem, prompt, generation in zip(indices, group, prompts, generations):
            verdict = _verdict(dataset, generation.text, problem.answer, prompting.few_shot)
            predictions[index] = Prediction(
                problem.id, dataset, decoding, prompt.text, generation.text, verdict.extracted, problem.answer,
                verdict.correct, generation.confidence, verdict.harness, generation.finish_reason,
                len(generation.token_ids),
            )
    return [prediction for prediction in predictions if prediction is not None]


def metrics(predictions: Iterable[Prediction]) -> dict[str, float]:
    """`eval/<set>/<decoding>/accuracy`, `.../correct`, `.../total` for every set (dataset) and decoding present;
    `.../cut_share`, the share of generations cut at `max_new_tokens` (of those that record why they ended); where the
    harness graded, also its filters' accuracies, `.../strict-match` and `.../flexible-extract`."""
    counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0])  # correct, total, cut, recorded
    by_filter: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    for prediction in predictions:
        tally = counts[(prediction.dataset, prediction.decoding)]
        tally[0] += prediction.correct
        tally[1] += 1
        by_filter[(prediction.dataset, prediction.decoding)].update(prediction.harness or {})
        tally[2] += prediction.finish_reason == "length"
        tally[3] += prediction.finish_reason is not None
    out: dict[str, float] = {}
    for (dataset, decoding), (correct, total, cut, recorded) in sorted(counts.items()):
        out.update(tally_metrics(dataset, decoding, correct, total))
        for name, hits in by_filter[(dataset, decoding)].items():
            out[eval_metric(dataset, decoding, name)] = hits / total
        if recorded:
            out[eval_metric(dataset, decoding, CUT_SHARE)] = cut / recorded
    return out


def results_table(values: dict[str, float]) -> str:
    """A markdown table of `eval/<set>/<decoding>/...` metrics: set, decoding, correct, total, accuracy, the share cut
    at max_new_tokens and problems/s (where measured); then a warning line for each set and decoding with more than
    `CUT_WARNING_SHARE` of its generations cut."""
    groups: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for key, value in values.items():
        metric = parse_eval_metric(key)
        if metric is not None and metric.prefix == EVAL_PREFIX:
            groups[(metric.set_name, metric.decoding)][metric.stat] = value
    lines = ["| set | decoding | correct | total | accuracy | cut at max_new_tokens | problems/s |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    warnings = []
    for (dataset, decoding), group in sorted(groups.items()):
        speed = f"{group['problems_per_s']:.2f}" if "problems_per_s" in group else "-"
        cut = f"{100 * group['cut_share']:.1f}%" if "cut_share" in group else "-"
        lines.append(
            f"| {dataset} | {decoding} | {int(group['correct'])} | {int(group['total'])} | "
            f"{100 * group['accuracy']:.2f}% | {cut} | {speed} |"
        )
        if group.get("cut_share", 0.0) > CUT_WARNING_SHARE:
            warnings.append(
                f"warning: {dataset}/{decoding}: {cut} of the generations ran to max_new_tokens (a model that loops, "
                "or eval.max_new_tokens too small)"
            )
    return "\n".join(lines + warnings)


# --------------------------------------------------------------------------------------------------------------
# The evaluated model and where its results go


def resolve_adapter(cfg: ExperimentConfig) -> Path | None:
    """The adapter to evaluate: `eval.adapter`, else none for few-shot prompting, else the one the run of this
    config wrote (`<train.output_dir>/<name>/adapter`). A missing adapter is a one-line error."""
    if cfg.eval.adapter is not None:
        folder = Path(cfg.eval.adapter)
    elif prompting(cfg).few_shot:
        return None
    elif not cfg.method.trains:
        raise ClozeMathError(
            f"method '{cfg.method.name}' trains no adapter: evaluate it few-shot (eval.few_shot=true) or set "
            "eval.adapter=PATH"
        )
    else:
        folder = run_folder(cfg) / ADAPTER_DIR
    if not (folder / "adapter_config.json").is_file():
        raise ClozeMathError(
            f"adapter '{folder}': not found (no adapter_config.json); train it with `clozemath run` or set "
            "eval.adapter=PATH"
        )
    return folder


def load_evaluated_model(cfg: ExperimentConfig, adapter: Path | None, device: torch.device | str) -> Loaded:
    """The base model alone (few-shot), or with the adapter merged in, in eval mode."""
    from clozemath.model.load import load_for_inference, load_model

    if adapter is None:
        return load_model(cfg.model, 0, device, training=False)
    return load_for_inference(cfg.model, adapter, device)
