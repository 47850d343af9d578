"""Prompts: the fine-tuned format `P<SEP>`, and few-shot prompts for base models exactly as lm-evaluation-harness
v0.4.12 (`HARNESS`) builds them for its tasks `gsm8k` and `minerva_math_*` (both task version 3.0).

The harness writes each shot as its question, the target delimiter " " and its answer, joins the shots and the test
question with the few-shot delimiter "\n\n", and ends with the test question:

- `gsm8k`: `Question: {question}\nAnswer: {answer}`, the answer as the data has it (calculator annotations and
  `#### N` kept). Its default sampler draws the 5 shots from the train split with one `random.Random(1234)` (the
  harness's default few-shot seed) per task, `sample(train, 5)` once per test document in document order: test
  problem i gets the draw i + 1 of that generator.
- `minerva_math`: the four Minerva exemplars (Lewkowycz et al. 2022) in order (sampler `first_n`), as
  `Problem:\n{problem}\n\nSolution: {solution}`, each solution ending in `\nFinal Answer: The final answer is
  ${answer}$. I hope it is correct.`; the test problem as `Problem:\n{problem}\n\nSolution:`.

Both decode greedily, stop at their `until` strings (and at the model's end-of-sequence token, as our decoder does
anyway), after at most 256 new tokens (the harness's `max_gen_toks` for Hugging Face models); the prompt is encoded
with the tokenizer's own special tokens (Llama's BOS).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from functools import cache

from clozemath.data.sources import Problem

HARNESS = "lm-evaluation-harness v0.4.12"
DEFAULT_TEMPLATE = "Question: {question}\nAnswer:"
GSM8K_SHOTS = 5
HARNESS_FEWSHOT_SEED = 1234
HARNESS_MAX_NEW_TOKENS = 256
GSM8K_STOP = ("Question:", "</s>", "<|im_end|>")
"""The `until` of the harness's `gsm8k` (task version 3.0)."""
MINERVA_MATH_STOP = ("Problem:",)


def finetuned_prompt(question: str, sep_token: str, template: str = DEFAULT_TEMPLATE) -> str:
    """`P<SEP>`: the prefix a fine-tuned model saw in training, `sep_token` being the tokenizer's string for `<SEP>`."""
    return template.format(question=question) + sep_token


@cache
def gsm8k_shot_draws(num_train: int, num_documents: int) -> tuple[tuple[int, ...], ...]:
    """The train indices of each test document's shots, documents in order, as the harness's default sampler draws
    them (its shared generator is why a document's shots depend on its position)."""
    if num_train < GSM8K_SHOTS:
        raise ValueError(f"{GSM8K_SHOTS} shots asked for, {num_train} train problems given")
    generator = random.Random(HARNESS_FEWSHOT_SEED)
    return tuple(tuple(generator.sample(range(num_train), GSM8K_SHOTS)) for _ in range(num_documents))


def gsm8k_shots(train: Sequence[Problem], document: int) -> list[Problem]:
    """The 5 train problems the harness shows before test document `document` (0-based, in file order)."""
    return [train[index] for index in gsm8k_shot_draws(len(train), document + 1)[document]]


def gsm8k_few_shot(question: str, shots: Sequence[Problem]) -> str:
    blocks = [f"Question: {shot.question}\nAnswer: {shot.solution}" for shot in shots]
    return "\n\n".join([*blocks, f"Question: {question}\nAnswer:"])


# The Minerva MATH exemplars (problem, solution, final answer) as the harness v0.4.12 writes them, quirks kept: the
# first problem's double space and stray `}`, and the align rows ended by a single backslash (`480\` + newline).
MINERVA_EXEMPLARS: tuple[tuple[str, str, str], ...] = (
    (
        r"Find the domain of the expression  $\frac{\sqrt{x-2}}{\sqrt{5-x}}$.}",
        r"The expressions inside each square root must be non-negative. Therefore, $x-2 \ge 0$, so $x\ge2$, and "
        r"$5 - x \ge 0$, so $x \le 5$. Also, the denominator cannot be equal to zero, so $5-x>0$, which gives "
        r"$x<5$. Therefore, the domain of the expression is $\boxed{[2,5)}$.",
        r"[2,5)",
    ),
    (
        r"If $\det \mathbf{A} = 2$ and $\det \mathbf{B} = 12,$ then find $\det (\mathbf{A} \mathbf{B}).$",
        r"We have that $\det (\mathbf{A} \mathbf{B}) = (\det \mathbf{A})(\det \mathbf{B}) = (2)(12) = "
        r"\boxed{24}.$",
        r"24",
    ),
    (
        "Terrell usually lifts two 20-pound weights 12 times. If he uses two 15-pound weights instead, how many "
        "times must Terrell lift them in order to lift the same total weight?",
        "If Terrell lifts two 20-pound weights 12 times, he lifts a total of $2\\cdot 12\\cdot20=480$ pounds of "
        "weight.  If he lifts two 15-pound weights instead for $n$ times, he will lift a total of "
        "$2\\cdot15\\cdot n=30n$ pounds of weight.  Equating this to 480 pounds, we can solve for $n$:\n"
        "\\begin{align*}\n30n&=480\\\n\\Rightarrow\\qquad n&=480/30=\\boxed{16}\n\\end{align*}",
        "16",
    ),
    (
        "If the system of equations\n\n\\begin{align*}\n6x-4y&=a,\\\n6y-9x &=b.\n\\end{align*}has a solution "
        "$(x, y)$ where $x$ and $y$ are both nonzero,\nfind $\\frac{a}{b},$ assuming $b$ is nonzero.",
        "If we multiply the first equation by $-\\frac{3}{2}$, we obtain\n\n$$6y-9x=-\\frac{3}{2}a.$$Since we "
        "also know that $6y-9x=b$, we have\n\n$$-\\frac{3}{2}a=b\\Rightarrow\\frac{a}{b}=\\boxed{-\\frac{2}{3}}.$$",
        r"-\frac{2}{3}",
    ),
)


def minerva_math_few_shot(problem: str) -> str:
    blocks = [
        f"Problem:\n{question}\n\nSolution: {solution}\n"
        f"Final Answer: The final answer is ${answer}$. I hope it is correct."
        for question, solution, answer in MINERVA_EXEMPLARS
    ]
    return "\n\n".join([*blocks, f"Problem:\n{problem}\n\nSolution:"])
