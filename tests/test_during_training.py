"""Evaluation during training (the paper's Figure 3) on a tiny model being trained: which problems, when, and how the
ranks' counts add up (no Ray: the sum over ranks is handed in)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from clozemath.errors import ClozeMathError
from clozemath.eval.during_training import evaluate_step, step_evaluation
from clozemath.eval.evaluate import eval_problems
from clozemath.model.load import load_model
from clozemath.plan import load_config

SMOKE = Path(__file__).resolve().parents[1] / "configs" / "experiments" / "smoke.yaml"
SETS = "eval.sets=[{dataset: gsm8k, limit: 40, decodings: [beam]}, {dataset: gsm_p1, per_template: 1}]"


@pytest.fixture(scope="module")
def config():
    torch.set_num_threads(1)
    return load_config(SMOKE, [SETS, "eval.decodings=[greedy,beam]", "eval.num_beams=2", "eval.max_new_tokens=4",
                               "eval.every_steps=3", "eval.during_training_limit=5"])


def test_the_first_sets_first_decoding_on_one_subset_every_n_steps_and_after_the_last(config) -> None:
    evaluation = step_evaluation(config)
    assert (evaluation.set_name, evaluation.decoding) == ("gsm8k", "beam")
    chosen = eval_problems(config.eval.sets[0].model_copy(update={"limit": 5}))
    assert [p.id for p in evaluation.problems] == [p.id for p in chosen]
    assert [step for step in range(1, 11) if evaluation.due(step, total_steps=10)] == [3, 6, 9, 10]
    never = config.eval.model_copy(update={"every_steps": None})
    assert step_evaluation(config.model_copy(update={"eval": never})) is None


def test_shares_of_the_budget_put_every_run_at_the_same_points_of_its_steps(config) -> None:
    """`every_share: 0.25` of 10 steps: 2.5, 5, 7.5, 10 rounded halves up -> 3, 5, 8, 10; of 685 at 0.1: 68.5 -> 69,
    137, 205.5 -> 206, ..., 685; a run shorter than the shares still ends with its last step."""
    shares = config.eval.model_copy(update={"every_steps": None, "every_share": 0.25})
    evaluation = step_evaluation(config.model_copy(update={"eval": shares}))
    assert [step for step in range(1, 11) if evaluation.due(step, total_steps=10)] == [3, 5, 8, 10]
    tenths = shares.model_copy(update={"every_share": 0.1})
    assert tenths.during_training_steps(685) == [69, 137, 206, 274, 343, 411, 480, 548, 617, 685]
    assert shares.during_training_steps(2) == [1, 2]
    assert shares.model_copy(update={"every_share": 0.3}).during_training_steps(7) == [2, 4, 6, 7]
    with pytest.raises(ClozeMathError, match="`every_steps` and `every_share` both say when"):
        load_config(SMOKE, ["eval.every_steps=3", "eval.every_share=0.1"])
    with pytest.raises(ClozeMathError, match="every_share"):
        load_config(SMOKE, ["eval.every_share=0"])


@pytest.mark.parametrize(("zero_stage", "expected_total"), [(2, 2 * 2), (3, 5)])
def test_ranks_share_the_problems_and_sum_their_counts(config, zero_stage: int, expected_total: int) -> None:
    """Rank 1 of 2: under ZeRO-2 it decodes problems 1 and 3 and the (stand-in) sum doubles its counts; under ZeRO-3
    every rank decodes all five in step and nothing is summed."""
    config = config.model_copy(update={"train": config.train.model_copy(update={"zero_stage": zero_stage})})
    loaded = load_model(config.model, num_sentinels=2, device="cpu", training=True)
    summed = []

    def double(counts: list[float]) -> list[float]:
        summed.append(counts)
        return [2 * count for count in counts]

    values = evaluate_step(step_evaluation(config), loaded, config, rank=1, world_size=2, sum_over_ranks=double)
    assert values["curve/gsm8k/beam/total"] == expected_total  # apart from the final full-set eval/... metrics
    assert [total for _, total in summed] == ([] if zero_stage == 3 else [2.0])  # this rank's 2 problems, summed once
    assert values["curve/gsm8k/beam/accuracy"] == values["curve/gsm8k/beam/correct"] / expected_total
    assert loaded.model.training  # back to training
