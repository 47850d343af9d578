"""Prompts: the fine-tuned format `P<SEP>`, and few-shot prompts for base models as lm-evaluation-harness builds them.

- GSM8K (harness task `gsm8k`): shots `Question: {question}\\nAnswer: {answer}` (the answer as the data has it, with
  its `<<...>>` calculator annotations and `#### N` line), then `Question: {question}\\nAnswer:`, all joined by a
  blank line. The harness samples its 5 shots from the train split with a seeded RNG; we take the first 5 train
  problems, so every test problem sees the same shots.
- MATH (harness task `minerva_math`): the four Minerva exemplars (Lewkowycz et al. 2022), each
  `Problem:\\n{problem}\\n\\nSolution:\\n{solution}\\nFinal Answer: The final answer is ${answer}$. I hope it is
  correct.`, then `Problem:\\n{problem}\\n\\nSolution:`, joined by a blank line.
"""

from __future__ import annotations

from collections.abc import Sequence

from clozemath.data.sources import Problem

DEFAULT_TEMPLATE = "Question: {question}\nAnswer:"
GSM8K_SHOTS = 5
GSM8K_STOP = ("Question:", "</s>", "<|im_end|>", "\n\n")
"""The harness's `until` for `gsm8k` (v3: `Question:`, `</s>`, `<|im_end|>`; v1 had `\\n\\n`, which a GSM8K
answer never holds, so both are here)."""
MINERVA_MATH_STOP = ("Problem:",)


def finetuned_prompt(question: str, sep_token: str, template: str = DEFAULT_TEMPLATE) -> str:
    """`P<SEP>`: the prefix a fine-tuned model saw in training, `sep_token` being the tokenizer's string for `<SEP>`."""
    return template.format(question=question) + sep_token


def gsm8k_shots(train: Sequence[Problem], n: int = GSM8K_SHOTS) -> list[Problem]:
    """The first `n` problems of the GSM8K train split."""
    if len(train) < n:
        raise ValueError(f"{n} shots asked for, {len(train)} train problems given")
    return list(train[:n])


def gsm8k_few_shot(question: str, shots: Sequence[Problem]) -> str:
    blocks = [f"Question: {shot.question}\nAnswer: {shot.solution}" for shot in shots]
    return "\n\n".join([*blocks, f"Question: {question}\nAnswer:"])


# The Minerva MATH exemplars (problem, solution, final answer), written out as lm-evaluation-harness prompts with
# them, quirks kept (the first problem's double space and stray `}`).
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
        "\\begin{align*}\n30n&=480\\\\\n\\Rightarrow\\qquad n&=480/30=\\boxed{16}\n\\end{align*}",
        "16",
    ),
    (
        "If the system of equations\n\n\\begin{align*}\n6x-4y&=a,\\\\\n6y-9x &=b.\n\\end{align*}has a solution "
        "$(x, y)$ where $x$ and $y$ are both nonzero,\nfind $\\frac{a}{b},$ assuming $b$ is nonzero.",
        "If we multiply the first equation by $-\\frac{3}{2}$, we obtain\n\n$$6y-9x=-\\frac{3}{2}a.$$Since we "
        "also know that $6y-9x=b$, we have\n\n$$-\\frac{3}{2}a=b\\Rightarrow\\frac{a}{b}=\\boxed{-\\frac{2}{3}}.$$",
        r"-\frac{2}{3}",
    ),
)


def minerva_math_few_shot(problem: str) -> str:
    blocks = [
        f"Problem:\n{question}\n\nSolution:\n{solution}\n"
        f"Final Answer: The final answer is ${answer}$. I hope it is correct."
        for question, solution, answer in MINERVA_EXEMPLARS
    ]
    return "\n\n".join([*blocks, f"Problem:\n{problem}\n\nSolution:"])
