"""Ask a run's model questions (`clozemath generate`): its adapter merged into its base model, each question in the
prompt format the run trained on (PrefixLM's `<SEP>` and bidirectional prompt where its method trains that way; a base
model's few-shot prompt), greedy decoding as an evaluation decodes, and the answer found as grading finds it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from clozemath.config import ExperimentConfig
from clozemath.data.sources import Problem
from clozemath.eval.evaluate import build_prompts, decode_prompts, load_evaluated_model, prompting, resolve_adapter
from clozemath.tasks import get_task


@dataclass(frozen=True)
class Answer:
    question: str
    prompt: str
    generation: str
    answer: str | None
    """What grading would read as the answer (the number after `####`, the last `\\boxed{}`, ...), None if none."""
    finish_reason: str


def ask(config: ExperimentConfig, questions: Sequence[str], device: torch.device | str = "cpu") -> list[Answer]:
    """Each question answered greedily by the model `clozemath eval` would evaluate for `config` (its run's adapter,
    `eval.adapter`, or the base model few-shot), its answer found by the rules of the run's training set."""
    dataset = config.data.dataset
    problems = [Problem(f"question-{i}", dataset, "", question, "", "") for i, question in enumerate(questions)]
    how = prompting(config)
    loaded = load_evaluated_model(config, resolve_adapter(config), device)
    prompts = build_prompts(problems, loaded, how)
    generations = decode_prompts(loaded, prompts, dataset, "greedy", config.eval, how)
    task = get_task(dataset)
    answers = []
    for question, prompt, generation in zip(questions, prompts, generations):
        found = task.find_answer(generation.text)
        answer = None if found is None else generation.text[found[0][0]:found[0][1]]
        answers.append(Answer(question, prompt.text, generation.text, answer, generation.finish_reason))
    return answers
