"""Compute budgets: equal epochs, or the steps / training tokens of a reference method (arithmetic only, no Ray)."""

from __future__ import annotations

import pytest

from clozemath.config import TrainConfig, load_config
from clozemath.errors import ClozeMathError
from clozemath.train.budget import Footprint, matched_steps, planned_steps, planned_tokens

CLOZEMATH = Footprint(samples=1000, tokens=100_000)  # 100 tokens a sample
IT = Footprint(samples=200, tokens=40_000)  # 200 tokens a sample (the whole solution, every time)


def train(budget: str = "epochs", **changes) -> TrainConfig:
    return TrainConfig(micro_batch_size=4, grad_accum=2, epochs=2, budget=budget, **changes)


def test_equal_epochs_give_each_method_its_own_steps() -> None:
    assert planned_steps(CLOZEMATH, train()) == 2 * 1000 // 8 == 250
    assert planned_steps(IT, train()) == 2 * 200 // 8 == 50
    assert planned_tokens(IT, 50, train()) == 50 * 8 * 200 == 80_000


def test_a_matched_budget_gives_the_reference_methods_steps_or_tokens() -> None:
    assert matched_steps(train("steps"), CLOZEMATH, IT) == 250
    # ClozeMath sees 250 steps x 8 samples x 100 tokens = 200,000 tokens; IT's steps hold 1,600 tokens each.
    assert matched_steps(train("tokens"), CLOZEMATH, IT) == 125
    assert matched_steps(train("tokens"), CLOZEMATH, CLOZEMATH) == planned_steps(CLOZEMATH, train())
    assert matched_steps(train("steps", num_workers=2), CLOZEMATH, IT) == 2 * (1000 // 2 // 4) // 2


def test_the_gsm8k_epoch_gap_the_paper_leaves_open() -> None:
    """ClozeMath's 47,395 samples per GSM8K epoch against IT's 7,473: ~6.3x the steps at equal epochs."""
    paper = TrainConfig(micro_batch_size=4, grad_accum=4, epochs=3)
    ratio = planned_steps(Footprint(47_395, 1), paper) / planned_steps(Footprint(7_473, 1), paper)
    assert ratio == pytest.approx(6.34, abs=0.01)


def test_max_steps_and_a_matched_budget_cannot_both_set_the_steps() -> None:
    with pytest.raises(ClozeMathError, match="`max_steps` and `budget: steps` both set the steps"):
        load_config("configs/experiments/smoke.yaml", ["train.budget=steps", "train.max_steps=3"])
    with pytest.raises(ClozeMathError, match="no budget to match"):
        matched_steps(train(), CLOZEMATH, IT)


def test_the_paper_grid_states_its_budget() -> None:
    grid = load_config("configs/grids/paper.yaml", ["axes.model=[deepseek-math-7b]", "axes.method=[it]"])
    assert grid.base["train"]["budget"] == "epochs"
