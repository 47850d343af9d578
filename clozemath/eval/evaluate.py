"""A model on evaluation sets -> predictions (`clozemath.eval.predictions` turns them into files and metrics):
the sets' problems, the prompts, decoding and grading a batch, the evaluated model.

Ray-free: `ray_jobs/eval_job.py` runs `evaluate_batch` in a Ray Data actor pool; a training loop can call it directly.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from clozemath.config import EvalConfig, EvalSetConfig, ExperimentConfig
from clozemath.data.objectives import format_prompt, lm_sample
from clozemath.data.sources import Problem, listed_problems
from clozemath.data.tokenize import encode_samples
from clozemath.errors import ClozeMathError
from clozemath.eval.decoding import DecodeSettings
from clozemath.eval.predictions import Prediction, grade_generation
from clozemath.records import ADAPTER_DIR, run_folder
from clozemath.tasks import few_shot_prompt, get_task

if TYPE_CHECKING:  # peft and the decoders take seconds to import: `clozemath score` and a grid's trial do without
    import torch

    from clozemath.eval.decoding import DecodeProgress, Engine, Generation, OnProgress, PromptAttention
    from clozemath.eval.decoding.job import Emit
    from clozemath.model.load import Loaded


# --------------------------------------------------------------------------------------------------------------
# Evaluation sets


def eval_set_identity(set_cfg: EvalSetConfig) -> str:
    """Where an evaluation set's problems come from and what they hold: its data file, or its templates folder."""
    return get_task(set_cfg.dataset).identity(set_cfg)


def eval_problems(set_cfg: EvalSetConfig) -> list[Problem]:
    """The problems of one evaluation set (its task's, `clozemath.tasks`), those its `ids` file lists; a seeded
    subset of `limit` of them, in order."""
    problems = get_task(set_cfg.dataset).problems(set_cfg)
    if set_cfg.ids is not None:
        problems = listed_problems(problems, set_cfg.ids, f"{set_cfg.dataset}/{set_cfg.split}")
    if set_cfg.limit is None or set_cfg.limit >= len(problems):
        return problems
    subset_seed = f"eval/{set_cfg.dataset}/{set_cfg.seed}"  # a seed, not a metric name: the same subsets as ever
    chosen = random.Random(subset_seed).sample(range(len(problems)), set_cfg.limit)
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


def prompting(config: ExperimentConfig) -> Prompting:
    """`eval.few_shot` auto: few-shot for methods that train nothing (`base`); `eval.prompt_attention` auto:
    bidirectional for a prefix_lm-trained model prompted in its own format, causal otherwise."""
    few_shot = not config.method.trains if config.eval.few_shot == "auto" else config.eval.few_shot
    attention = config.eval.prompt_attention
    if attention == "auto":
        attention = "bidirectional" if config.method.attention == "prefix_lm" and not few_shot else "causal"
    return Prompting(few_shot, attention, config.data.prompt_template)


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


def decode_settings(eval_cfg: EvalConfig, dataset: str, prompting: Prompting, engine: Engine) -> DecodeSettings:
    """How a set's prompts decode: the config's lengths (a few-shot prompt's default the harness's), batch size,
    beams and branches; the set's stop strings, its CoT-decoding answer rule (`eval.cot_vote`), the prompt's
    attention and the engine."""
    task = get_task(dataset)
    return DecodeSettings.of(
        eval_cfg, prompting.few_shot, stop=stop_strings(dataset, prompting), prompt_attention=prompting.attention,
        answer_span=partial(task.answer_span, marked_only=eval_cfg.cot_vote == "marked"),
        normalize_answer=task.answer_key, engine=engine,
    )


def decode_prompts(
    loaded: Loaded, prompts: list[Prompt], dataset: str, decoding: str, eval_cfg: EvalConfig, prompting: Prompting,
    engine: Engine = "auto", on_done: Emit | None = None, on_progress: OnProgress | None = None,
) -> list[Generation]:
    """Decode prompts of one set with `decoding` as an evaluation does (its stop strings, answer rule, attention);
    `on_done`, `on_progress`: `decode`'s (each prompt's generation as it ends; where the batch is, at each look)."""
    from clozemath.eval.decoding import decode

    settings = decode_settings(eval_cfg, dataset, prompting, engine)
    return decode(loaded.model, loaded.tokenizer, [prompt.ids for prompt in prompts], decoding, settings,
                  on_done=on_done, on_progress=on_progress)


def evaluate_batch(
    loaded: Loaded, problems: Sequence[Problem], decoding: str, eval_cfg: EvalConfig, prompting: Prompting,
    engine: Engine = "auto", on_prediction: Callable[[Prediction], None] | None = None,
    on_progress: Callable[[str, DecodeProgress], None] | None = None,
) -> list[Prediction]:
    """Decode every problem with `decoding` and grade it; one Prediction per problem, in order (`confidence`: the
    winning answer's summed CoT-decoding confidence). `engine`: `decode`'s. `on_prediction`: takes each prediction
    as soon as its problem's decoding ends (in the order they end), graded then. `on_progress`: takes the set being
    decoded and where its batch is (`decode`'s `on_progress`)."""
    predictions: list[Prediction | None] = [None] * len(problems)

    def evaluate_set(dataset: str) -> None:
        indices = [i for i, problem in enumerate(problems) if problem.dataset == dataset]
        prompts = build_prompts([problems[i] for i in indices], loaded, prompting)

        def graded(position: int, generation: Generation) -> None:
            index = indices[position]
            prediction = predictions[index] = _prediction(problems[index], prompts[position], decoding, generation,
                                                          prompting)
            if on_prediction is not None:
                on_prediction(prediction)

        decode_prompts(loaded, prompts, dataset, decoding, eval_cfg, prompting, engine, on_done=graded,
                       on_progress=None if on_progress is None else partial(on_progress, dataset))

    for dataset in dict.fromkeys(problem.dataset for problem in problems):
        evaluate_set(dataset)
    return [prediction for prediction in predictions if prediction is not None]


def _prediction(problem: Problem, prompt: Prompt, decoding: str, generation: Generation,
                prompting: Prompting) -> Prediction:
    """A problem's generation graded by its set's task."""
    verdict = grade_generation(problem.dataset, generation.text, problem.answer, prompting.few_shot,
                               ended=generation.finish_reason != "length")
    return Prediction(
        problem.id, problem.dataset, decoding, prompt.text, generation.text, verdict.extracted, problem.answer,
        verdict.correct, generation.confidence, verdict.harness, generation.finish_reason, len(generation.token_ids),
        verdict.rule, verdict.lenient,
    )


# --------------------------------------------------------------------------------------------------------------
# The evaluated model and where its results go


def resolve_adapter(config: ExperimentConfig) -> Path | None:
    """The adapter to evaluate: `eval.adapter`, else none for few-shot prompting, else the one the run of this
    config wrote (`<train.output_dir>/<name>/adapter`). A missing adapter is a one-line error."""
    if config.eval.adapter is not None:
        folder = Path(config.eval.adapter)
    elif prompting(config).few_shot:
        return None
    elif not config.method.trains:
        raise ClozeMathError(
            f"method '{config.method.name}' trains no adapter: evaluate it few-shot (eval.few_shot=true) or set "
            "eval.adapter=PATH"
        )
    else:
        folder = run_folder(config) / ADAPTER_DIR
    if not (folder / "adapter_config.json").is_file():
        raise ClozeMathError(
            f"adapter '{folder}': not found (no adapter_config.json); train it with `clozemath run` or set "
            "eval.adapter=PATH"
        )
    return folder


def load_evaluated_model(config: ExperimentConfig, adapter: Path | None, device: torch.device | str) -> Loaded:
    """The base model alone (few-shot), or with the adapter merged in, in eval mode."""
    from clozemath.model.load import load_for_inference, load_model

    if adapter is None:
        return load_model(config.model, 0, device, training=False)
    return load_for_inference(config.model, adapter, device)
