"""Base models as lm-evaluation-harness v0.4.12 runs them: its `gsm8k` and `minerva_math` prompts (exemplars, text),
stop sequences and GSM8K answer filters, checked against what that version's task files and sampler produce."""

from __future__ import annotations

import pytest

from clozemath.data.sources import load_problems
from clozemath.data.gold import last_boxed
from clozemath.eval.predictions import Prediction, grade_generation, metrics, prediction_from_row, regrade
from clozemath.plan import expand_grid, load_config
from clozemath.tasks import few_shot_prompt
from clozemath.tasks.gsm8k import GSM8K_STOP, gsm8k_shots
from clozemath.tasks.harness import (
    FLEXIBLE_EXTRACT, STRICT_MATCH, exact_match, filtered_answer, harness_verdicts, numeric_match,
)
from clozemath.tasks.math import MINERVA_EXEMPLARS, MINERVA_MATH_STOP

HARNESS_DRAWS = {0: [6374, 3610, 957, 61, 742], 1: [7462, 6610, 4769, 286, 5501]}
"""The train indices the harness's default sampler (`random.Random(1234)`, `sample(train, 5)` per test document, in
document order) shows before GSM8K test documents 0 and 1."""


def test_gsm8k_five_shot_prompt_as_the_harness_builds_it() -> None:
    train, test = load_problems("gsm8k", "train"), load_problems("gsm8k", "test", limit=2)
    for document, indices in HARNESS_DRAWS.items():
        shots = [train[i] for i in indices]
        assert gsm8k_shots(train, document) == shots
        prompt = few_shot_prompt(test[document])
        blocks = [f"Question: {shot.question}\nAnswer: {shot.solution}" for shot in shots]
        assert prompt == "\n\n".join([*blocks, f"Question: {test[document].question}\nAnswer:"])
        assert all("<<" in block for block in blocks) and all(f"#### {s.answer}" in prompt for s in shots)
    assert GSM8K_STOP == ("Question:", "</s>", "<|im_end|>")


def test_minerva_math_four_shot_prompt_as_the_harness_builds_it() -> None:
    problem = load_problems("math", "test", limit=1)[0]
    prompt = few_shot_prompt(problem)
    terrell = (
        "Problem:\nTerrell usually lifts two 20-pound weights 12 times. If he uses two 15-pound weights instead, how "
        "many times must Terrell lift them in order to lift the same total weight?\n\nSolution: If Terrell lifts two "
        "20-pound weights 12 times, he lifts a total of $2\\cdot 12\\cdot20=480$ pounds of weight.  If he lifts two "
        "15-pound weights instead for $n$ times, he will lift a total of $2\\cdot15\\cdot n=30n$ pounds of weight.  "
        "Equating this to 480 pounds, we can solve for $n$:\n\\begin{align*}\n30n&=480\\\n\\Rightarrow\\qquad "
        "n&=480/30=\\boxed{16}\n\\end{align*}\nFinal Answer: The final answer is $16$. I hope it is correct.\n\n"
    )
    assert terrell in prompt
    assert prompt.startswith("Problem:\nFind the domain of the expression  $\\frac{\\sqrt{x-2}}{\\sqrt{5-x}}$.}\n\n"
                             "Solution: The expressions inside each square root must be non-negative.")
    assert prompt.endswith(f".$$\nFinal Answer: The final answer is $-\\frac{{2}}{{3}}$. I hope it is correct.\n\n"
                           f"Problem:\n{problem.question}\n\nSolution:")
    assert prompt.count("\n\nSolution: ") == 4 and all(last_boxed(s) == a for _, s, a in MINERVA_EXEMPLARS)
    assert MINERVA_MATH_STOP == ("Problem:",)


@pytest.mark.parametrize(
    ("generation", "strict", "flexible"),
    [
        ("She pays 3 * 4 = 12 dollars.\n#### 12", "12", "12"),
        ("#### 1,234.\nSo 5 more.", "1,234.", "5"),  # strict takes the first `#### N`, flexible the last number
        ("The total is $18.00.", None, "$18.00."),
        ("no number here", None, None),
        ("It costs -$5, that is #### -5", "-5", "-5"),
    ],
)
def test_gsm8k_filters_extract_as_the_harness_regexes(generation: str, strict: str | None, flexible: str | None):
    assert filtered_answer(STRICT_MATCH, generation) == strict
    assert filtered_answer(FLEXIBLE_EXTRACT, generation) == flexible


def test_exact_match_ignores_commas_dollars_the_answer_line_and_a_final_period() -> None:
    assert exact_match("1,234.", "1234") and exact_match("$18.00.", "18.00") and not exact_match("18.00", "18")
    assert exact_match("72", "Natalia sold 48/2 = 24 clips.\n#### 72") and not exact_match(None, "72")
    assert harness_verdicts("#### 7\nThen 8", "8") == {STRICT_MATCH: False, FLEXIBLE_EXTRACT: True}


def test_gsm_symbolic_golds_written_with_a_decimal_match_the_base_models_whole_number() -> None:
    """Apple's GSM-P2 writes some golds `45.0`: a base model's `#### 45` is right there, as the grading rule judges
    every method (numbers within 1e-4), while GSM8K, a harness task, keeps the harness's text match."""
    assert numeric_match("45", "45.0") and numeric_match("1,234.", "#### 1234") and numeric_match("$18.00.", "18")
    assert not numeric_match("45.01", "45") and not numeric_match("..", "45") and not numeric_match(None, "45")
    right = grade_generation("gsm_p2", "So 45 in all.\n#### 45", "45.0", harness=True)
    assert right.correct and right.harness == {STRICT_MATCH: True, FLEXIBLE_EXTRACT: True}
    assert not grade_generation("gsm8k", "So 45 in all.\n#### 45", "45.0", harness=True).correct


def test_stored_gsm_symbolic_harness_verdicts_are_read_as_numbers_and_gsm8ks_as_written() -> None:
    """Predictions graded before 2026-12-05 by text: a compact row (no generation) is re-judged from strict-match's
    answer and keeps its flexible-extract verdict; a full row has flexible-extract's answer found again."""
    row = {"id": "gsm_p2-0", "dataset": "gsm_p2", "gold": "45.0", "extracted": "45", "correct": False,
           "rule": "strict", "harness": {STRICT_MATCH: False, FLEXIBLE_EXTRACT: False}}
    compact = prediction_from_row({**row, "generation": ""}, "compact")
    assert compact.correct and compact.harness == {STRICT_MATCH: True, FLEXIBLE_EXTRACT: False}
    full = prediction_from_row({**row, "generation": "So 45 in all.\n#### 45"}, "full")
    assert full.correct and full.harness == {STRICT_MATCH: True, FLEXIBLE_EXTRACT: True}
    gsm8k = prediction_from_row({**row, "id": "gsm8k-test-0", "dataset": "gsm8k", "generation": ""}, "gsm8k")
    assert not gsm8k.correct and gsm8k.harness == {STRICT_MATCH: False, FLEXIBLE_EXTRACT: False}


def test_harness_graded_predictions_report_both_filters_and_regrade_with_them() -> None:
    rows = [("#### 8", True, True), ("so 8", False, True), ("#### 7", False, False), ("#### 8 then 9", True, False)]
    predictions = [
        Prediction(f"gsm8k-test-{i}", "gsm8k", "greedy", "", text, None, "8", False, None, {STRICT_MATCH: False})
        for i, (text, _, _) in enumerate(rows)
    ]
    regraded = regrade(predictions)
    assert [(p.correct, p.harness) for p in regraded] == [
        (strict, {STRICT_MATCH: strict, FLEXIBLE_EXTRACT: flexible}) for _, strict, flexible in rows
    ]
    values = metrics(regraded)
    assert values["eval/gsm8k/greedy/accuracy"] == values["eval/gsm8k/greedy/strict-match"] == 0.5
    assert values["eval/gsm8k/greedy/flexible-extract"] == 0.5


def test_a_base_model_decodes_at_most_the_harness_256_new_tokens_unless_told_otherwise() -> None:
    """lm-evaluation-harness stops a few-shot generation at `max_gen_toks`, 256: a base model's evaluation that leaves
    `eval.max_new_tokens` unset does too, a fine-tuned model's takes 512, and a value set holds for both."""
    from clozemath.eval.evaluate import decode_settings, prompting

    def new_tokens(*overrides: str) -> int:
        config = load_config("configs/experiments/smoke.yaml", list(overrides))
        return decode_settings(config.eval, "gsm8k", prompting(config), "auto").max_new_tokens

    assert new_tokens("method=base", "eval.max_new_tokens=null") == 256
    assert new_tokens("method=clozemath", "eval.max_new_tokens=null") == 512
    assert new_tokens("method=base", "eval.max_new_tokens=300") == new_tokens("method=it", "eval.max_new_tokens=300") \
        == 300


def test_the_paper_grid_runs_base_models_as_the_harness_does() -> None:
    grid = load_config("configs/grids/paper.yaml", ["axes.method=[base]", "axes.model=[llama-3.2-1b]"])
    for trial in expand_grid(grid):
        assert trial.eval.decodings == ["greedy"] and trial.eval.max_new_tokens == 256
        assert [s.dataset for s in trial.eval.sets] == [trial.data.dataset]
